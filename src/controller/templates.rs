//! Which model pod templates the API server accepts. A template is checked
//! with a server-side dry run of its pod's create before anything is
//! evicted for the model (and whenever a template is new to the operator,
//! so a typo shows before anyone requests the model). Verdicts are kept by
//! (namespace, template hash): one dry run per distinct template and
//! namespace for the life of the process.

use super::pods::{build_pod, template_hash};
use crate::api::ModelResidency;
use crate::metrics::Metrics;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// Verdicts kept at most; past it they are forgotten (and asked again).
const MAX_VERDICTS: usize = 10_000;

/// `None`: accepted; `Some(message)`: rejected, in the API server's words.
type Verdict = Option<String>;

#[derive(Debug, Default)]
pub struct TemplateVerdicts {
    known: Mutex<HashMap<(String, u64), Verdict>>,
}

/// Whether an API answer to a create rejects the pod itself (rather than
/// saying the API server is busy or the name is taken).
pub fn rejects_the_pod(e: &kube::Error) -> Option<String> {
    match e {
        kube::Error::Api(s) if (400..500).contains(&s.code) && ![409, 429].contains(&s.code) => {
            Some(s.message.clone())
        }
        _ => None,
    }
}

impl TemplateVerdicts {
    fn get(&self, key: &(String, u64)) -> Option<Verdict> {
        self.known.lock().expect("verdicts lock").get(key).cloned()
    }

    fn put(&self, key: (String, u64), verdict: Verdict) {
        let mut known = self.known.lock().expect("verdicts lock");
        if known.len() >= MAX_VERDICTS {
            known.clear();
        }
        known.insert(key, verdict);
    }

    /// Records that the API server rejected a real create of a pod built
    /// from `template` (JSON text) in `namespace`.
    pub fn rejected_create(&self, namespace: &str, template: &str, message: String) {
        let key = (namespace.to_owned(), template_hash(template));
        self.put(key, Some(message));
    }

    /// The registry models of `r` whose pod the API server rejects, with
    /// its message. Templates not seen before are dry-run now; an answer
    /// that says nothing about the pod (the server busy or unreachable)
    /// leaves the template unjudged and is asked again next time.
    pub async fn rejected(
        &self,
        api: &Api<Pod>,
        r: &ModelResidency,
        owner: &OwnerReference,
        metrics: &Metrics,
    ) -> BTreeMap<String, String> {
        let namespace = r.namespace().unwrap_or_default();
        let mut rejected = BTreeMap::new();
        // A registry may repeat one template thousands of times.
        let mut seen: HashMap<&str, Verdict> = HashMap::new();
        for m in &r.spec.models {
            let Some(template) = &m.template else {
                continue;
            };
            if let Some(verdict) = seen.get(template.json()) {
                if let Some(message) = verdict {
                    rejected.insert(m.name.clone(), message.clone());
                }
                continue;
            }
            let key = (namespace.clone(), template_hash(template.json()));
            let verdict = match self.get(&key) {
                Some(verdict) => verdict,
                None => {
                    // A template that cannot even be built is decide's to
                    // report; the size does not matter to the API server.
                    let Ok(pod) = build_pod(r, owner, m, 0) else {
                        continue;
                    };
                    let dry_run = PostParams {
                        dry_run: true,
                        ..PostParams::default()
                    };
                    let answer = api.create(&dry_run, &pod).await;
                    metrics.api_request("create-dry-run", "pods");
                    let verdict = match &answer {
                        // A name that exists passed validation first.
                        Ok(_) => None,
                        Err(kube::Error::Api(s)) if s.code == 409 => None,
                        Err(e) => match rejects_the_pod(e) {
                            Some(message) => Some(message),
                            None => continue,
                        },
                    };
                    self.put(key, verdict.clone());
                    verdict
                }
            };
            if let Some(message) = &verdict {
                rejected.insert(m.name.clone(), message.clone());
            }
            seen.insert(template.json(), verdict);
        }
        rejected
    }
}
