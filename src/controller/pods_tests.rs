use super::*;

#[test]
fn holder_and_model_pod_names_never_meet() {
    // A model pod's name ends in -<5 hex>; the holder's in -holder.
    let model_pod = pod_name("a", "gpu");
    assert_ne!(model_pod, crate::residency::gpu::holder_name("a"));
    assert!(
        !crate::residency::gpu::holder_name("a")
            .rsplit('-')
            .next()
            .unwrap()
            .bytes()
            .all(|b| b.is_ascii_hexdigit())
    );
}
use crate::api::{ByteQuantity, GpuMode, ModelResidencySpec};
use crate::residency::gpu::assumed;
use serde_json::json;

fn build(r: &ModelResidency, t: serde_json::Value) -> Result<Pod, String> {
    build_pod(r, &owner(), &model(t), 1 << 30, &assumed(r))
}

/// The node a pod is kept to by [`require_node`], if any.
fn required_node(spec: &PodSpec) -> Vec<Option<&str>> {
    spec.affinity
        .iter()
        .flat_map(|a| a.node_affinity.as_ref())
        .flat_map(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .flat_map(|r| r.node_selector_terms.iter())
        .map(|t| {
            t.match_fields
                .iter()
                .flatten()
                .find(|f| f.key == "metadata.name")
                .and_then(|f| f.values.as_ref()?.first().map(String::as_str))
        })
        .collect()
}

fn residency() -> ModelResidency {
    let mut r = ModelResidency::new(
        "gpu0",
        ModelResidencySpec {
            catalog: None,
            node_name: Some("node-a".into()),
            device: "GPU-1234".into(),
            gpu: Box::new(crate::api::GpuSpec {
                mode: GpuMode::Env,
                ..Default::default()
            }),
            budget: Some(ByteQuantity("16Gi".into())),
            budget_fraction: None,
            models: vec![],
            prefetch: 0,
            warm: None,
            eviction: Default::default(),
            anticipate: None,
            keep_alive: None,
            demand: Default::default(),
        },
    );
    r.metadata.namespace = Some("models".into());
    r
}

fn model(template: serde_json::Value) -> ModelSpec {
    ModelSpec {
        name: "zimage".into(),
        size: ByteQuantity("1Gi".into()),
        pinned: false,
        gpus: None,
        artifact: None,
        keep_alive: None,
        template: Some(template.into()),
        load_time: None,
        sleep: None,
        copies: None,
        lora: None,
    }
}

fn owner() -> OwnerReference {
    OwnerReference {
        api_version: "residency.dev/v1alpha1".into(),
        kind: "ModelResidency".into(),
        name: "gpu0".into(),
        uid: "u-1".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

#[test]
fn builds_a_bound_labelled_owned_pod_with_the_device() {
    let t = json!({"metadata": {"labels": {"app": "z"}}, "spec": {"containers": [
        {"name": "server", "image": "img", "env": [{"name": DEVICE_ENV, "value": "all"}]}
    ]}});
    let pod = build(&residency(), t).unwrap();
    let meta = &pod.metadata;
    assert_eq!(meta.name, Some(pod_name("gpu0", "zimage")));
    assert!(pod_name("gpu0", "zimage").starts_with("gpu0-zimage-"));
    assert_eq!(meta.namespace.as_deref(), Some("models"));
    let labels = meta.labels.as_ref().unwrap();
    assert_eq!(labels[MODEL_LABEL], "zimage");
    assert_eq!(labels[RESIDENCY_LABEL], "gpu0");
    assert_eq!(labels["app"], "z");
    assert_eq!(
        meta.annotations.as_ref().unwrap()[SIZE_ANNOTATION],
        "1073741824"
    );
    assert_eq!(
        meta.annotations.as_ref().unwrap()[NODE_ANNOTATION],
        "node-a"
    );
    assert_eq!(meta.owner_references.as_ref().unwrap()[0].uid, "u-1");
    let spec = pod.spec.unwrap();
    assert_eq!(spec.node_name, None, "placed by the scheduler");
    assert_eq!(required_node(&spec), [Some("node-a")]);
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    let env = spec.containers[0].env.as_ref().unwrap();
    assert_eq!(
        env.len(),
        1,
        "the template's own device setting is replaced"
    );
    assert_eq!(env[0].value.as_deref(), Some("GPU-1234"));
}

#[test]
fn the_templates_own_placement_is_narrowed_to_the_node_never_widened() {
    let t = json!({"spec": {
        "nodeName": "elsewhere",
        "containers": [{"name": "server", "image": "img"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["other"]}]},
            ]}}},
    }});
    let pod = build(&residency(), t).unwrap();
    let spec = pod.spec.unwrap();
    assert_eq!(spec.node_name, None);
    assert_eq!(required_node(&spec), [Some("node-a"), Some("node-a")]);
    let terms = &spec
        .affinity
        .as_ref()
        .unwrap()
        .node_affinity
        .as_ref()
        .unwrap()
        .required_during_scheduling_ignored_during_execution
        .as_ref()
        .unwrap()
        .node_selector_terms;
    assert_eq!(terms[0].match_expressions.as_ref().unwrap()[0].key, "gpu");
    assert_eq!(terms[1].match_fields.as_ref().unwrap().len(), 1);
}

#[test]
fn a_claim_is_referenced_by_the_chosen_containers_and_no_variable_is_set() {
    let mut r = residency();
    *r.spec.gpu = crate::api::GpuSpec {
        containers: Some(vec!["server".into()]),
        ..Default::default()
    };
    let t = json!({"spec": {"containers": [
        {"name": "server", "image": "img", "env": [{"name": DEVICE_ENV, "value": "all"}]},
        {"name": "sidecar", "image": "proxy"},
    ]}});
    let pod = build(&r, t).unwrap();
    let annotations = pod.metadata.annotations.as_ref().unwrap();
    assert_eq!(annotations[GPU_ACCESS_ANNOTATION], "claim:gpu0-gpu");
    let spec = pod.spec.unwrap();
    let claims = spec.resource_claims.as_ref().unwrap();
    assert_eq!(claims.len(), 1);
    assert_eq!(claims[0].name, CLAIM_REQUEST);
    assert_eq!(claims[0].resource_claim_name.as_deref(), Some("gpu0-gpu"));
    let server = &spec.containers[0];
    assert_eq!(server.env, None, "the claim's device is the one it sees");
    let used = server.resources.as_ref().unwrap().claims.as_ref().unwrap();
    assert_eq!(used[0].name, CLAIM_REQUEST);
    assert_eq!(spec.containers[1].resources, None, "not chosen");
    // An existing claim is referenced by its own name.
    r.spec.gpu.existing_claim = Some("team-gpu".into());
    let pod = build(&r, json!({"spec": {"containers": [{"name": "server"}]}})).unwrap();
    let claims = pod.spec.unwrap().resource_claims.unwrap();
    assert_eq!(claims[0].resource_claim_name.as_deref(), Some("team-gpu"));
}

#[test]
fn the_device_plugin_mode_requests_one_resource() {
    let mut r = residency();
    *r.spec.gpu = crate::api::GpuSpec {
        mode: GpuMode::DevicePlugin,
        resource_name: Some("nvidia.com/gpu.shared".into()),
        ..Default::default()
    };
    let pod = build(&r, json!({"spec": {"containers": [{"name": "server"}]}})).unwrap();
    let c = &pod.spec.as_ref().unwrap().containers[0];
    let resources = c.resources.as_ref().unwrap();
    for list in [&resources.limits, &resources.requests] {
        assert_eq!(list.as_ref().unwrap()["nvidia.com/gpu.shared"].0, "1");
    }
    assert_eq!(c.env, None);
    assert_eq!(pod.spec.unwrap().resource_claims, None);
}

#[test]
fn pod_names_are_unique_per_residency_and_model() {
    // Two pairs whose names joined with '-' are the same text.
    assert_ne!(pod_name("gpu", "a-b"), pod_name("gpu-a", "b"));
    assert_eq!(pod_name("gpu", "a-b"), pod_name("gpu", "a-b"), "stable");
}

#[test]
fn unusable_templates_are_reported() {
    for (t, want) in [
        (json!({"spec": {"containers": []}}), "no containers"),
        (json!({"metadata": {}}), "no spec"),
        (
            json!({"spec": {"containers": "x"}}),
            "not a valid PodTemplateSpec",
        ),
    ] {
        let err = build(&residency(), t).unwrap_err();
        assert!(err.contains(want), "{err}");
    }
    let mut m = model(json!({}));
    m.template = None;
    assert!(
        build_pod(&residency(), &owner(), &m, 1, &assumed(&residency()))
            .unwrap_err()
            .contains("no pod template")
    );
    // The GPU given to a container the template does not have: no pod
    // without its GPU.
    let mut r = residency();
    r.spec.gpu.containers = Some(vec!["sever".into()]);
    let err = build(&r, json!({"spec": {"containers": [{"name": "server"}]}})).unwrap_err();
    assert!(err.contains("spec.gpu.containers names \"sever\""), "{err}");
}

#[test]
fn a_gang_pod_is_every_members_and_gets_every_members_gpu() {
    use crate::residency::gangs::{GangMember, GangPlacement};
    let r = residency();
    let t = json!({"spec": {"containers": [
        {"name": "server", "image": "img"},
        {"name": "sidecar", "image": "img"}
    ]}});
    let member = |name: &str, device: &str| GangMember {
        residency: name.into(),
        uid: format!("u-{name}"),
        device: Some(device.into()),
        claim: Some(format!("{name}-gpu")),
    };
    let gang = GangPlacement {
        members: vec![member("gpu0", "GPU-1234"), member("gpu3", "GPU-9")],
        ready: true,
        at: String::new(),
        sleep: None,
    };
    // Env mode: every member's device in NVIDIA_VISIBLE_DEVICES.
    let mut pod = build(&r, t.clone()).unwrap();
    make_gang_pod(&mut pod, &r, &assumed(&r), &owner(), &gang);
    let meta = &pod.metadata;
    assert_eq!(
        meta.annotations.as_ref().unwrap()[GANG_MEMBERS_ANNOTATION],
        "gpu0,gpu3"
    );
    let owners: Vec<(&str, Option<bool>)> = meta
        .owner_references
        .iter()
        .flatten()
        .map(|o| (o.name.as_str(), o.controller))
        .collect();
    assert_eq!(owners, [("gpu0", Some(true)), ("gpu3", None)]);
    let spec = pod.spec.as_ref().unwrap();
    let env = |c: &Container, name: &str| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(
        env(&spec.containers[0], DEVICE_ENV).as_deref(),
        Some("GPU-1234,GPU-9")
    );
    assert_eq!(
        env(&spec.containers[0], GANG_SIZE_ENV).as_deref(),
        Some("2")
    );
    assert_eq!(
        env(&spec.containers[0], GANG_DEVICES_ENV).as_deref(),
        Some("GPU-1234,GPU-9")
    );
    // The GPU goes to every container unless spec.gpu.containers names them.
    assert_eq!(
        env(&spec.containers[1], GANG_SIZE_ENV).as_deref(),
        Some("2")
    );
    // Claim mode: one claim reference per member, the head's first.
    let mut claimed = r.clone();
    claimed.spec.gpu.mode = GpuMode::Claim;
    let gpu = Placement {
        access: Access::Claim {
            claim: "gpu0-gpu".into(),
        },
        ..assumed(&r)
    };
    let mut pod = build_pod(&claimed, &owner(), &model(t), 1 << 30, &gpu).unwrap();
    make_gang_pod(&mut pod, &claimed, &gpu, &owner(), &gang);
    let spec = pod.spec.unwrap();
    let claims: Vec<(&str, &str)> = spec
        .resource_claims
        .iter()
        .flatten()
        .map(|c| (c.name.as_str(), c.resource_claim_name.as_deref().unwrap()))
        .collect();
    assert_eq!(claims, [("gpu", "gpu0-gpu"), ("gpu-1", "gpu3-gpu")]);
    let used: Vec<&str> = spec.containers[0]
        .resources
        .iter()
        .flat_map(|r| r.claims.iter().flatten())
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(used, ["gpu", "gpu-1"]);
}
