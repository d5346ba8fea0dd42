//! The demo's chapter on the node's disk: a model store served over HTTP
//! (or the local registry), and `model-residency node-agent` fetching a
//! new model's weights, verified, before its pod starts with them.

use super::*;

/// The weights the demo's artifact server serves: 8 MiB of a pattern.
pub(super) fn demo_weights() -> bytes::Bytes {
    (0..8u32 << 20).map(|i| (i % 251) as u8).collect()
}

/// Serves `/llama/model.safetensors` (`weights`) over HTTP on a free
/// loopback port, as a model store would; returns its address.
pub(super) async fn artifact_server(
    weights: bytes::Bytes,
) -> Result<std::net::SocketAddr, Failure> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(Failure::other)?;
    let addr = listener.local_addr().map_err(Failure::other)?;
    tokio::spawn(model_residency::http::accept_loop(
        listener,
        move |stream| {
            let weights = weights.clone();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let weights = weights.clone();
                        async move {
                            let mut answer =
                                http::Response::new(http_body_util::Full::new(weights));
                            if req.uri().path() != "/llama/model.safetensors" {
                                *answer.body_mut() = http_body_util::Full::new(bytes::Bytes::new());
                                *answer.status_mut() = http::StatusCode::NOT_FOUND;
                            }
                            Ok::<_, std::convert::Infallible>(answer)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        },
    ));
    Ok(addr)
}

/// The registry credentials Secret of the demo's node agent.
pub(super) const DEMO_REGISTRY_SECRET: &str = "demo-registry";

/// Where llama's weights come from: an OCI artifact in a local registry
/// (Debian's docker-registry, TLS and basic auth), pushed here; or, when no
/// registry can be started, the plain http store.
pub(super) struct WeightsSource {
    pub(super) artifact: serde_json::Value,
    pub(super) allowed: String,
    pub(super) agent_flags: Vec<String>,
    pub(super) says: String,
    pub(super) _registry: Option<model_residency::local::registry::LocalRegistry>,
}

pub(super) async fn weights_source(
    plane: &ControlPlane,
    weights: bytes::Bytes,
    sha: &str,
) -> Result<WeightsSource, Failure> {
    use model_residency::local::registry::{LocalRegistry, PASSWORD, USER, docker_config};
    match LocalRegistry::start() {
        Ok(registry) => {
            let digest = registry
                .push(
                    "models/llama",
                    "1.0",
                    &[(
                        "application/octet-stream",
                        &weights,
                        Some("model.safetensors"),
                    )],
                )
                .await
                .map_err(Failure::other)?;
            let secrets: Api<k8s_openapi::api::core::v1::Secret> =
                Api::namespaced(plane.client().await.map_err(Failure::other)?, OPERATOR_NS);
            let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(serde_json::json!({
                "metadata": {"name": DEMO_REGISTRY_SECRET},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": docker_config(&registry.host(), USER, PASSWORD)},
            }))
            .map_err(Failure::other)?;
            let _ = secrets
                .create(&kube::api::PostParams::default(), &secret)
                .await;
            let host = registry.host();
            Ok(WeightsSource {
                artifact: serde_json::json!({"size": "8Mi", "source": format!("oci://{host}/models/llama@{digest}")}),
                allowed: format!("oci://{host}/models"),
                agent_flags: vec![
                    "--registry-credentials".into(),
                    DEMO_REGISTRY_SECRET.into(),
                    "--namespace".into(),
                    OPERATOR_NS.into(),
                    "--registry-ca-file".into(),
                    registry.ca_file().display().to_string(),
                ],
                says: format!(
                    "pulling only from the local OCI registry at {host} (TLS, htpasswd; its credentials in the Secret {OPERATOR_NS}/{DEMO_REGISTRY_SECRET}), where llama's weights were pushed as an ORAS artifact, {digest}"
                ),
                _registry: Some(registry),
            })
        }
        Err(why) => {
            let store = artifact_server(weights).await?;
            Ok(WeightsSource {
                artifact: serde_json::json!({"size": "8Mi", "files": [{
                    "uri": format!("http://{store}/llama/model.safetensors"), "sha256": sha}]}),
                allowed: format!("http://{store}/"),
                agent_flags: Vec::new(),
                says: format!(
                    "fetching only from the model store at http://{store}/ (no local registry: {why})"
                ),
                _registry: None,
            })
        }
    }
}

/// The node's disk: the node agent fetches a model's weights, verified,
/// before its pod starts, and the pod mounts them read-only. Returns the
/// agent and its cache directory (removed when dropped, after the agent
/// has stopped).
pub(super) async fn disk_tier(
    plane: &ControlPlane,
    api: &Api<ModelResidency>,
    name: &str,
    residency: &ModelResidency,
    router: &str,
) -> Result<(Process, tempfile::TempDir), Failure> {
    let kc = plane.kubeconfig();
    let weights = demo_weights();
    let sha = model_residency::node_agent::fetch::encode_hex(
        ring::digest::digest(&ring::digest::SHA256, &weights).as_ref(),
    );
    let source = weights_source(plane, weights, &sha).await?;
    let cache = tempfile::tempdir().map_err(Failure::other)?;
    let cache_dir = cache.path().join("model-cache");
    say(&format!(
        "The node's disk: starting the node agent (model-residency node-agent, as the chart's node-agent ServiceAccount) with a 64Mi disk budget, {}",
        source.says
    ));
    let node = demo_node(residency);
    let cache_arg = cache_dir.display().to_string();
    let mut args: Vec<&str> = vec![
        "node-agent",
        "--node",
        &node,
        "--disk-budget",
        "64Mi",
        "--cache-dir",
        &cache_arg,
        "--allowed-sources",
        &source.allowed,
    ];
    args.extend(source.agent_flags.iter().map(String::as_str));
    let agent = spawn_as(plane, "node agent", "model-residency-node-agent", &args).await?;
    // The new model's pod is the seed's first template with its own image.
    let mut template = residency
        .spec
        .models
        .first()
        .map(|m| serde_json::to_value(&m.template).unwrap_or_default())
        .unwrap_or_default();
    // The stand-in runs any image; a real node keeps the local one.
    if template["spec"]["containers"][0]["image"] != MODEL_SERVER_IMAGE {
        template["spec"]["containers"][0]["image"] = "ghcr.io/example/llama-server:1.0".into();
        template["spec"]["containers"][0]["args"] = serde_json::json!(["--model", "llama"]);
    }
    let model = serde_json::json!({
        "name": "llama", "size": "2000Mi", "template": template,
        "artifact": source.artifact,
    });
    let patch = serde_json::json!([{"op": "add", "path": "/spec/models/-", "value": model}]);
    say(
        "Registering llama (2000Mi of VRAM) with an artifact: 8Mi of weights, pinned by digest, that its pod needs on the node's disk",
    );
    println!(
        "$ kubectl patch mres {name} -n {NAMESPACE} --type=json -p '[{{\"op\":\"add\",\"path\":\"/spec/models/-\",\"value\":{{\"name\":\"llama\",\"size\":\"2000Mi\",\"artifact\":{{...}},...}}}}]'"
    );
    api.patch(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::<()>::Json(serde_json::from_value(patch).map_err(Failure::other)?),
    )
    .await
    .map_err(fail("add llama to the registry"))?;
    settle(api, name).await?;
    say(
        "Asking for llama: the router holds the request while the operator waits in Fetching for the node agent to download and verify the weights, then starts the pod with them mounted read-only",
    );
    ask(router, "llama").await?;
    let r = settle(api, name).await?;
    kubectl(kc, &["get", "nmc"]);
    kubectl(
        kc,
        &[
            "get",
            "nmc",
            &node,
            "-o",
            "custom-columns=ARTIFACT:.status.artifacts[*].key,STATE:.status.artifacts[*].state,BYTES:.status.artifacts[*].bytes,SHA256:.status.artifacts[*].sha256,DIGEST:.status.artifacts[*].digest",
        ],
    );
    if let Some(pod) = r
        .status
        .as_ref()
        .and_then(|s| s.model("llama"))
        .and_then(|m| m.pod.clone())
    {
        kubectl(
            kc,
            &[
                "get",
                "pod",
                &pod,
                "-n",
                NAMESPACE,
                "-o",
                "jsonpath={.spec.volumes[0].hostPath.path} -> {.spec.containers[0].volumeMounts[0].mountPath} (readOnly {.spec.containers[0].volumeMounts[0].readOnly})",
            ],
        );
        println!();
    }
    println!("$ ls -l {}/*", cache_dir.display());
    for dir in std::fs::read_dir(&cache_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|d| d.file_name() != model_residency::node_agent::blobs::STORE_DIR)
    {
        for file in std::fs::read_dir(dir.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            println!(
                "   {}/{}  {} bytes",
                dir.file_name().to_string_lossy(),
                file.file_name().to_string_lossy(),
                file.metadata().map(|m| m.len()).unwrap_or(0)
            );
        }
    }
    Ok((agent, cache))
}
