//! The node's disk tier end to end: the real API server, the operator, the
//! node agent as a real process (`model-residency node-agent`), artifacts
//! served over real HTTP by a server the test starts, files on a real disk.

mod fetch;
mod oci;

use crate::support::artifact_server::{serve, serve_logged, sha256_hex, slow_content, weights};
use crate::support::cluster::eventually;
pub(crate) use crate::support::node_agent::{Agent, start_agent, start_agent_with};
use crate::support::operator::Harness;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use model_residency::api::{ArtifactState, ModelResidency, ModelState, NodeModelCache};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;

/// A registry entry with a pod template and, optionally, an artifact.
fn model(name: &str, size: &str, artifact: Option<Value>) -> Value {
    let mut m = json!({"name": name, "size": size, "template": {"spec": {
        "containers": [{"name": "server", "image": format!("example/{name}:1")}]}}});
    if let Some(a) = artifact {
        m["artifact"] = a;
    }
    m
}

async fn create(h: &Harness, name: &str, budget: &str, models: Vec<Value>, prefetch: u32) {
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": name},
        "spec": {"nodeName": h.node, "device": "0", "budget": budget, "models": models, "prefetch": prefetch},
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap();
}

async fn node_cache(h: &Harness) -> Option<NodeModelCache> {
    let api: Api<NodeModelCache> = Api::all(h.env.client.clone());
    api.get_opt(&h.node).await.unwrap()
}

async fn artifact_state(h: &Harness, model: &str) -> Option<ArtifactState> {
    node_cache(h)
        .await?
        .status?
        .artifacts
        .iter()
        .find(|a| a.model == model)
        .map(|a| a.state)
}

fn status_of<'a>(r: &'a ModelResidency, model: &str) -> &'a model_residency::api::ModelStatus {
    r.status.as_ref().unwrap().model(model).unwrap()
}

/// Names in the cache directory, and in its blob store's directories as
/// `.blobs/<dir>/<name>` (the store's empty directories are not listed).
fn cached(cache: &Path) -> Vec<String> {
    let names_in = |dir: &Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut names: Vec<String> = names_in(cache)
        .into_iter()
        .filter(|n| n != model_residency::node_agent::blobs::STORE_DIR)
        .collect();
    let store = cache.join(model_residency::node_agent::blobs::STORE_DIR);
    for sub in names_in(&store) {
        for name in names_in(&store.join(&sub)) {
            names.push(format!(".blobs/{sub}/{name}"));
        }
    }
    names.sort();
    names
}

fn weights_artifact(addr: SocketAddr) -> Value {
    json!({"files": [{"uri": format!("http://{addr}/weights.bin"), "sha256": sha256_hex(&weights())}], "size": "1Mi"})
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_artifact_is_fetched_once_mounted_and_reused_after_eviction() {
    let h = Harness::start("agent-fetch").await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    create(
        &h,
        "gpu",
        "2Gi",
        vec![
            model("qwen", "1Gi", Some(weights_artifact(addr))),
            model("sd", "2Gi", None),
        ],
        0,
    )
    .await;
    h.request_nowait("gpu", "qwen").await;
    let r = h.until_state("gpu", "qwen", ModelState::Loaded, 60).await;
    let key = status_of(&r, "qwen").pod.clone().unwrap();
    let pod: Pod = h.pods.get(&key).await.unwrap();
    let spec = pod.spec.unwrap();
    let host = spec.volumes.unwrap()[0].host_path.clone().unwrap();
    assert!(
        host.path.starts_with(&cache.display().to_string()),
        "{}",
        host.path
    );
    assert_eq!(host.type_.as_deref(), Some("Directory"));
    let mount = &spec.containers[0].volume_mounts.as_ref().unwrap()[0];
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        ("/models/qwen", Some(true))
    );
    assert_eq!(
        std::fs::read(Path::new(&host.path).join("weights.bin")).unwrap(),
        weights()
    );
    assert_eq!(requests.load(Ordering::Relaxed), 1, "fetched once");
    assert_eq!(artifact_state(&h, "qwen").await, Some(ArtifactState::Ready));
    let status = node_cache(&h).await.unwrap().status.unwrap();
    let qwen = status.artifacts.iter().find(|a| a.model == "qwen").unwrap();
    assert_eq!(
        qwen.sha256.as_deref(),
        Some(sha256_hex(&weights()).as_str())
    );
    assert_eq!(qwen.bytes, weights().len() as u64);

    // Evicted from VRAM, kept on disk; loaded again without a download.
    h.request_nowait("gpu", "sd").await;
    h.until_state("gpu", "qwen", ModelState::Evicted, 30).await;
    h.until_state("gpu", "sd", ModelState::Loaded, 30).await;
    assert!(Path::new(&host.path).join("weights.bin").exists());
    h.request_nowait("gpu", "qwen").await;
    h.until_state("gpu", "qwen", ModelState::Loaded, 30).await;
    assert_eq!(
        requests.load(Ordering::Relaxed),
        1,
        "a cached artifact is not fetched again"
    );
    // What the agent's /metrics says of it (the gauges as last published).
    const M: &str = "model_residency_node_agent_";
    assert_eq!(
        agent
            .metric(&format!("{M}fetches_total"), r#"result="Fetched""#)
            .await,
        1
    );
    assert_eq!(agent.metric(&format!("{M}fetches_total"), "").await, 1);
    assert_eq!(
        agent.metric(&format!("{M}fetched_bytes_total"), "").await,
        weights().len() as u64
    );
    assert_eq!(
        agent
            .metric(&format!("{M}fetch_duration_seconds_count"), "")
            .await,
        1
    );
    assert_eq!(
        agent.metric(&format!("{M}disk_budget_bytes"), "").await,
        10 << 20
    );
    assert_eq!(
        agent.metric(&format!("{M}disk_used_bytes"), "").await,
        weights().len() as u64,
        "a Ready artifact counts its bytes on disk (its blobs), not its declared size"
    );
    assert_eq!(
        agent
            .metric(&format!("{M}artifacts"), r#"state="Ready""#)
            .await,
        1
    );
    assert_eq!(agent.metric(&format!("{M}evictions_total"), "").await, 0);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn artifact_failures_fail_the_load_with_their_reason_and_leave_nothing() {
    let h = Harness::start("agent-failures").await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    let artifact = |uri: String, sha: Option<String>, size: &str| json!({"files": [{"uri": uri, "sha256": sha}], "size": size});
    create(
        &h,
        "gpu",
        "8Gi",
        vec![
            model(
                "badsum",
                "1Gi",
                Some(artifact(
                    format!("http://{addr}/weights.bin"),
                    Some("0".repeat(64)),
                    "1Mi",
                )),
            ),
            model(
                "elsewhere",
                "1Gi",
                Some(artifact("http://10.255.255.1/w.bin".into(), None, "1Mi")),
            ),
            model(
                "missing",
                "1Gi",
                Some(artifact(format!("http://{addr}/missing"), None, "1Mi")),
            ),
            model(
                "huge",
                "1Gi",
                Some(artifact(format!("http://{addr}/weights.bin"), None, "20Mi")),
            ),
        ],
        0,
    )
    .await;
    for (m, reason, says) in [
        ("badsum", "ArtifactFailed", "sha256"),
        ("elsewhere", "ArtifactFailed", "allowed source"),
        ("missing", "ArtifactFailed", "404"),
        ("huge", "DiskFull", "disk budget"),
    ] {
        h.request_nowait("gpu", m).await;
        let r = h.until_state("gpu", m, ModelState::Failed, 60).await;
        let st = status_of(&r, m);
        assert_eq!(st.reason.as_deref(), Some(reason), "{m}: {st:?}");
        assert!(
            st.message.as_deref().unwrap_or_default().contains(says),
            "{m}: {st:?}"
        );
        assert!(st.pod.is_none(), "{m}: no pod for a missing artifact");
    }
    let c = node_cache(&h).await.unwrap();
    let disk_full = c
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.type_ == "DiskFull")
        .unwrap();
    assert_eq!(disk_full.status, "True");
    // Nothing half-written, nothing of the failed artifacts.
    assert!(cached(&cache).is_empty(), "{:?}", cached(&cache));
    let r = h.api.get("gpu").await.unwrap();
    assert_eq!(
        r.status
            .unwrap()
            .conditions
            .iter()
            .find(|c| c.type_ == "Degraded")
            .unwrap()
            .status,
        "True"
    );
    assert!(
        requests.load(Ordering::Relaxed) >= 2,
        "badsum and missing were fetched, the others never"
    );
    // Each failure is counted by its reason (retries count again); the
    // refused one was never fetched.
    let fetches = "model_residency_node_agent_fetches_total";
    for reason in ["ChecksumMismatch", "SourceNotAllowed", "DownloadFailed"] {
        let n = agent.metric(fetches, &format!("result=\"{reason}\"")).await;
        assert!(n >= 1, "{reason}: {n}");
    }
    assert_eq!(agent.metric(fetches, r#"result="Fetched""#).await, 0);
    assert_eq!(
        agent
            .metric("model_residency_node_agent_artifacts", r#"state="Refused""#)
            .await,
        1
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_agent_killed_mid_download_resumes_it_and_leaves_nothing_else() {
    let h = Harness::start("agent-killed").await;
    let (addr, _, log) = serve_logged().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    let slow = json!({"files": [{"uri": format!("http://{addr}/slow"), "path": "w.bin",
                                  "sha256": sha256_hex(&slow_content())}], "size": "3Mi"});
    create(&h, "gpu", "8Gi", vec![model("slow", "1Gi", Some(slow))], 0).await;
    h.request_nowait("gpu", "slow").await;
    let r = h.until_state("gpu", "slow", ModelState::Fetching, 30).await;
    let s = r.status.as_ref().unwrap();
    assert_eq!(
        (s.fetching, s.loading, s.resident),
        (1, 0, 1),
        "counted as fetching"
    );
    // Killed with part of the file on disk (SIGKILL: no cleanup).
    eventually(30, "part of the download on disk", || async {
        let partial = cached(&cache)
            .into_iter()
            .find(|n| n.starts_with(".partial-"))?;
        let file = cache.join(partial).join("w.bin");
        (std::fs::metadata(file).ok()?.len() > 0).then_some(())
    })
    .await;
    drop(agent);
    // And a partial of a download nobody wants any more (an older agent's
    // name for it, too).
    std::fs::create_dir_all(cache.join(".partial-gone-1234-0")).unwrap();
    std::fs::write(cache.join(".partial-gone-1234-0/x.bin"), b"stale").unwrap();
    let agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    let r = h.until_state("gpu", "slow", ModelState::Loaded, 60).await;
    let names: Vec<String> = cached(&cache)
        .into_iter()
        .filter(|n| !n.starts_with(".blobs/"))
        .collect();
    assert_eq!(
        names.len(),
        1,
        "{names:?}: the partials are gone, the artifact in place"
    );
    let resumed_at: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("/slow bytes="))
        .cloned()
        .collect();
    assert_eq!(
        resumed_at.len(),
        1,
        "the restart asked for the rest only: {resumed_at:?}"
    );
    let resumed = agent
        .metric("model_residency_node_agent_resumed_bytes_total", "")
        .await;
    let fetched = agent
        .metric("model_residency_node_agent_fetched_bytes_total", "")
        .await;
    assert!(resumed > 0, "{resumed}");
    assert_eq!(
        resumed + fetched,
        slow_content().len() as u64,
        "nothing fetched twice"
    );
    assert_eq!(
        std::fs::metadata(cache.join(&names[0]).join("w.bin"))
            .unwrap()
            .len(),
        slow_content().len() as u64,
        "the whole file"
    );
    assert!(status_of(&r, "slow").pod.is_some());
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn recently_requested_models_are_prefetched_and_load_without_a_download() {
    let h = Harness::start("agent-prefetch").await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    // One model fits in VRAM at a time; the disk holds all three.
    let models = ["a", "b", "c"]
        .iter()
        .map(|m| model(m, "1Gi", Some(json!({"files": [{"uri": format!("http://{addr}/weights.bin")}], "size": format!("{}Ki", 300 + m.as_bytes()[0] as u32)}))))
        .collect();
    create(&h, "gpu", "1Gi", models, 2).await;
    for m in ["a", "b", "c"] {
        h.request_nowait("gpu", m).await;
        h.until_state("gpu", m, ModelState::Loaded, 60).await;
    }
    // c is resident; a and b, the two most recent others, stay on disk.
    for m in ["a", "b", "c"] {
        assert_eq!(
            artifact_state(&h, m).await,
            Some(ArtifactState::Ready),
            "{m}"
        );
    }
    let fetched = requests.load(Ordering::Relaxed);
    assert_eq!(fetched, 3);
    h.request_nowait("gpu", "a").await;
    h.until_state("gpu", "a", ModelState::Loaded, 30).await;
    assert_eq!(
        requests.load(Ordering::Relaxed),
        fetched,
        "a was on disk already"
    );
    let pods = h
        .pods
        .list(&ListParams::default().labels("residency.dev/model=a"))
        .await
        .unwrap();
    assert!(!pods.items.is_empty());
}

/// Bytes of the regular files under `dir`, partial downloads included.
fn bytes_on_disk(dir: &Path) -> u64 {
    // Each inode once: artifacts link the blobs they share.
    model_residency::node_agent::blobs::unique_usage(dir).unwrap_or(0)
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_storm_of_loads_never_puts_more_on_disk_than_the_budget() {
    let h = Harness::start("agent-storm").await;
    let (addr, _) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    // Room for three 300Ki artifacts (each file is 256 KiB): a pinned one
    // and two others.
    let agent = start_agent(&h, &cache, "900Ki", &format!("http://{addr}/"));
    let artifact =
        json!({"files": [{"uri": format!("http://{addr}/weights.bin")}], "size": "300Ki"});
    let mut models = vec![{
        let mut p = model("pinned", "1Gi", Some(artifact.clone()));
        p["pinned"] = json!(true);
        p
    }];
    // Distinct artifacts, of distinct content (the blob store would hold
    // one copy of the same file for all of them).
    for i in 0..6 {
        let a = json!({"files": [{"uri": format!("http://{addr}/distinct/m{i}.bin")}], "size": "300Ki"});
        models.push(model(&format!("m{i}"), "1Gi", Some(a)));
    }
    create(&h, "gpu", "2Gi", models, 0).await;
    h.request_nowait("gpu", "pinned").await;
    h.until_state("gpu", "pinned", ModelState::Loaded, 60).await;

    // An independent watcher of the directory itself, every 10 ms.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = std::thread::spawn({
        let (cache, stop) = (cache.clone(), stop.clone());
        move || {
            let mut most = 0;
            while !stop.load(Ordering::Relaxed) {
                most = most.max(bytes_on_disk(&cache));
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            most
        }
    });
    let order = [0, 3, 1, 4, 2, 5, 0, 1, 5, 3, 2, 4, 0, 5];
    for i in order {
        h.request_nowait("gpu", &format!("m{i}")).await;
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    // Loads take longer than the requests' spacing under load, so requests
    // queue; the one resident at the end is the last served.
    let r = h.drained("gpu").await;
    let last = r
        .status
        .unwrap()
        .models
        .iter()
        .find(|m| m.state == ModelState::Loaded && &*m.name != "pinned")
        .map(|m| m.name.to_string())
        .expect("one model besides the pinned one is resident");
    stop.store(true, Ordering::Relaxed);
    let most = watcher.join().unwrap();
    assert!(
        most <= 900 * 1024,
        "{most} bytes on disk at most, budget 900Ki"
    );
    assert!(
        most >= 2 * 256 * 1024,
        "the watcher saw the artifacts ({most})"
    );
    // The pinned model's artifact was never evicted; the resident one is
    // there; the disk never ran out for a required artifact.
    assert_eq!(
        artifact_state(&h, "pinned").await,
        Some(ArtifactState::Ready)
    );
    assert_eq!(artifact_state(&h, &last).await, Some(ArtifactState::Ready));
    let status = node_cache(&h).await.unwrap().status.unwrap();
    let ready = status
        .artifacts
        .iter()
        .filter(|a| a.state == ArtifactState::Ready)
        .count();
    assert!(ready <= 3, "{ready} artifacts of 300Ki in a 900Ki budget");
    assert!(
        status
            .artifacts
            .iter()
            .any(|a| a.state == ArtifactState::Evicted),
        "least recently used artifacts were evicted: {:?}",
        status.artifacts
    );
    let evicted = agent
        .metric("model_residency_node_agent_evictions_total", "")
        .await;
    assert!(evicted >= 1, "evictions counted: {evicted}");
    let r = h.api.get("gpu").await.unwrap();
    assert!(
        r.status
            .unwrap()
            .models
            .iter()
            .all(|m| m.reason.as_deref() != Some("DiskFull")),
        "never refused: only unrequired artifacts had to go"
    );
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn an_artifact_a_terminating_pod_mounts_stays_until_the_pod_is_gone() {
    // Model pods take 5 s to terminate (a server finishing its requests).
    let h = Harness::start_kubelet("agent-mounted", |c| {
        c.terminating_delay = std::time::Duration::from_secs(5)
    })
    .await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    // Room on disk for one 300Ki artifact, in VRAM for one model.
    let agent = start_agent(&h, &cache, "400Ki", &format!("http://{addr}/"));
    let artifact = |file: &str| json!({"files": [{"uri": format!("http://{addr}/weights.bin"), "path": file}], "size": "300Ki"});
    create(
        &h,
        "gpu",
        "1Gi",
        vec![
            model("a", "1Gi", Some(artifact("a.bin"))),
            model("b", "1Gi", Some(artifact("b.bin"))),
        ],
        0,
    )
    .await;
    h.request_nowait("gpu", "a").await;
    let r = h.until_state("gpu", "a", ModelState::Loaded, 60).await;
    let pod_a = status_of(&r, "a").pod.clone().unwrap();
    let a_dir = h
        .pods
        .get(&pod_a)
        .await
        .unwrap()
        .spec
        .unwrap()
        .volumes
        .unwrap()[0]
        .host_path
        .clone()
        .unwrap()
        .path;

    // b evicts a from VRAM; a's pod is terminating and still mounts its
    // files, so b's artifact waits for the room instead of taking it.
    h.request_nowait("gpu", "b").await;
    h.until_state("gpu", "a", ModelState::Evicted, 30).await;
    eventually(20, "b's artifact to wait for a's pod", || async {
        (artifact_state(&h, "b").await == Some(ArtifactState::Waiting)).then_some(())
    })
    .await;
    let still_there = h.pods.get_opt(&pod_a).await.unwrap();
    assert!(
        still_there.is_some_and(|p| p.metadata.deletion_timestamp.is_some()),
        "a's pod is terminating"
    );
    assert!(
        Path::new(&a_dir).join("a.bin").exists(),
        "a's files stay while its pod mounts them"
    );
    let c = node_cache(&h).await.unwrap().status.unwrap();
    let b = c.artifacts.iter().find(|x| x.model == "b").unwrap();
    assert_eq!(
        b.reason.as_deref(),
        Some("MountedArtifactsHoldRoom"),
        "{b:?}"
    );
    assert!(
        b.message.as_deref().unwrap_or_default().contains("a-"),
        "names what it waits for: {b:?}"
    );
    // The operator reads the agent's report from its own watch: a moment
    // after the test did (seen to lag under a full v1.34.4 run).
    let r = eventually(20, "b's status to say it waits for room", || async {
        let r = h.api.get("gpu").await.unwrap();
        let says = status_of(&r, "b")
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("waits for room");
        says.then_some(r)
    })
    .await;
    let st = status_of(&r, "b");
    assert_eq!(
        st.state,
        ModelState::Fetching,
        "waiting, not failed: {st:?}"
    );
    assert_eq!(
        agent
            .metric("model_residency_node_agent_artifacts", r#"state="Waiting""#)
            .await,
        1
    );

    // Once the pod is gone, a's artifact goes and b's comes.
    h.until_state("gpu", "b", ModelState::Loaded, 60).await;
    assert!(!Path::new(&a_dir).exists(), "a's artifact evicted");
    assert_eq!(artifact_state(&h, "a").await, Some(ArtifactState::Evicted));
    assert_eq!(requests.load(Ordering::Relaxed), 2);
}

/// Claim mode without spec.nodeName: the scheduler picks the node, the
/// operator writes it into status.gpu.node, and the agent on that node
/// finds the residency by its second watch (status.gpu.node is a
/// selectable field) and fetches the artifact there.
#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn a_residency_the_scheduler_placed_gets_its_artifact_from_that_nodes_agent() {
    let h = Harness::start("agent-placed").await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let _agent = start_agent(&h, &cache, "10Mi", &format!("http://{addr}/"));
    let uuid = model_residency::local::kubelet::fake_gpu_uuid(&h.node, 3);
    let r: ModelResidency = serde_json::from_value(json!({
        "apiVersion": "residency.dev/v1alpha1", "kind": "ModelResidency",
        "metadata": {"name": "gpu"},
        "spec": {"device": uuid, "budget": "2Gi",
                 "models": [model("qwen", "1Gi", Some(weights_artifact(addr)))]},
    }))
    .unwrap();
    h.api.create(&PostParams::default(), &r).await.unwrap();
    let placed = h.placed("gpu").await;
    let gpu = placed.status.as_ref().unwrap().gpu.as_ref().unwrap();
    assert_eq!(gpu.node.as_deref(), Some(h.node.as_str()));
    h.request_nowait("gpu", "qwen").await;
    let r = h.until_state("gpu", "qwen", ModelState::Loaded, 60).await;
    let pod: Pod = h
        .pods
        .get(&status_of(&r, "qwen").pod.clone().unwrap())
        .await
        .unwrap();
    let host = pod.spec.unwrap().volumes.unwrap()[0]
        .host_path
        .clone()
        .unwrap();
    assert_eq!(
        std::fs::read(Path::new(&host.path).join("weights.bin")).unwrap(),
        weights()
    );
    assert_eq!(requests.load(Ordering::Relaxed), 1);
}

#[tokio::test]
#[ignore = "needs the local control plane: scripts/test.sh runs it with --include-ignored"]
async fn three_models_naming_one_file_by_sha256_download_and_store_it_once() {
    let h = Harness::start("agent-dedup").await;
    let (addr, requests) = serve().await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    // Three declared 300Ki artifacts of one 256Ki file: 900Ki if each
    // counted whole, 256Ki (and what is not known yet) as one blob.
    let agent = start_agent(&h, &cache, "700Ki", &format!("http://{addr}/"));
    let same = json!({"files": [{"uri": format!("http://{addr}/weights.bin"), "sha256": sha256_hex(&weights())}], "size": "300Ki"});
    let models = ["x", "y", "z"].map(|m| model(m, "1Gi", Some(same.clone())));
    create(&h, "gpu", "3Gi", models.to_vec(), 0).await;
    for m in ["x", "y", "z"] {
        h.request_nowait("gpu", m).await;
        h.until_state("gpu", m, ModelState::Loaded, 60).await;
    }
    assert_eq!(requests.load(Ordering::Relaxed), 1, "downloaded once");
    let status = node_cache(&h).await.unwrap().status.unwrap();
    assert_eq!(status.ready, 3, "{status:?}");
    assert_eq!(status.conditions[0].status, "False", "never DiskFull");
    let w = weights().len() as u64;
    assert_eq!(bytes_on_disk(&cache), w, "stored once");
    assert_eq!(
        model_residency::quantity::parse_bytes(status.deduplicated.as_deref().unwrap()).unwrap(),
        2 * w
    );
    assert_eq!(
        agent
            .metric("model_residency_node_agent_shared_bytes_total", "")
            .await,
        2 * w
    );
    for a in &status.artifacts {
        let file = cache.join(&a.key).join("weights.bin");
        assert_eq!(std::fs::read(&file).unwrap(), weights(), "{}", a.key);
    }
}
