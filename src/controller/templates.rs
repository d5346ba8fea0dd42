//! Which model pod templates the API server accepts. A template is checked
//! with a server-side dry run of its pod's create before anything is
//! evicted for the model (and whenever a template is new to the operator,
//! so a typo shows before anyone requests the model). An acceptance is kept
//! by (namespace, template hash): one dry run per distinct template and
//! namespace. A rejection is kept for its residency alone and asked again
//! after a backoff (see [`TemplateVerdicts`]).

use super::pods::{build_pod, template_hash};
use crate::api::ModelResidency;
use crate::metrics::Metrics;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Verdicts kept at most; past it they are forgotten (and asked again).
const MAX_VERDICTS: usize = 10_000;

/// How long a rejection stands before it is asked again: 5 s, doubling
/// with each rejection in a row, at most 5 minutes. A rejection may pass
/// (a full ResourceQuota, a webhook that was down), and nothing about the
/// residency changes when it does.
const FIRST_RECHECK: Duration = Duration::from_secs(5);
const MAX_RECHECK: Duration = Duration::from_secs(300);

/// `None`: accepted; `Some(message)`: rejected, in the API server's words.
type Verdict = Option<String>;

/// A residency's template the API server rejected.
#[derive(Debug)]
struct Rejection {
    message: String,
    recheck_at: Instant,
    /// Rejections in a row, for the backoff.
    times: u32,
}

/// What is known of one residency's template.
#[derive(Debug, PartialEq, Eq)]
enum Known {
    /// Rejected for this residency, until `Duration` from now.
    Rejected(String, Duration),
    /// Accepted (for some residency in the namespace).
    Accepted,
    /// Not known, or a rejection to check again: dry-run it.
    Ask,
}

/// The verdicts. An acceptance is shared by every residency in the
/// namespace (the pods differ only in what the operator sets: node, GPU,
/// labels, owner), so a registry repeated on many GPUs costs one dry run.
/// A rejection is kept for the residency it was met on alone: it may come
/// from that residency's own part of the pod (a node name the API server
/// refuses) rather than from the template, and it may pass, so it is asked
/// again after a backoff, by that residency itself.
#[derive(Debug, Default)]
pub struct TemplateVerdicts {
    accepted: Mutex<HashSet<(String, u64)>>,
    rejected: Mutex<HashMap<(String, String, u64), Rejection>>,
}

/// The registry models of a residency whose pod the API server rejects
/// (with its message), and when the soonest of those rejections is due to
/// be asked again.
#[derive(Debug, Default)]
pub struct Rejections {
    pub by_model: BTreeMap<String, String>,
    pub recheck_in: Option<Duration>,
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
    fn known(&self, (ns, residency, hash): (&str, &str, u64), now: Instant) -> Known {
        let rejected = self.rejected.lock().expect("verdicts lock");
        // Every template of every reconcile comes here, and nearly always
        // nothing is rejected: no key is built for an empty map.
        let key = || (ns.to_owned(), residency.to_owned(), hash);
        if let Some(r) = (!rejected.is_empty())
            .then(|| rejected.get(&key()))
            .flatten()
        {
            return if now < r.recheck_at {
                Known::Rejected(r.message.clone(), r.recheck_at - now)
            } else {
                Known::Ask
            };
        }
        drop(rejected);
        let accepted = self.accepted.lock().expect("verdicts lock");
        if accepted.contains(&(ns.to_owned(), hash)) {
            Known::Accepted
        } else {
            Known::Ask
        }
    }

    fn accept(&self, (ns, residency, hash): (&str, &str, u64)) {
        let mut accepted = self.accepted.lock().expect("verdicts lock");
        if accepted.len() >= MAX_VERDICTS {
            accepted.clear();
        }
        accepted.insert((ns.to_owned(), hash));
        drop(accepted);
        let key = (ns.to_owned(), residency.to_owned(), hash);
        self.rejected.lock().expect("verdicts lock").remove(&key);
    }

    /// Records a rejection; returns how long it stands.
    fn reject(
        &self,
        (ns, residency, hash): (&str, &str, u64),
        message: String,
        now: Instant,
    ) -> Duration {
        let mut rejected = self.rejected.lock().expect("verdicts lock");
        if rejected.len() >= MAX_VERDICTS {
            rejected.clear();
        }
        let key = (ns.to_owned(), residency.to_owned(), hash);
        let times = rejected.get(&key).map_or(0, |r| r.times) + 1;
        let wait = FIRST_RECHECK
            .saturating_mul(1 << (times - 1).min(16))
            .min(MAX_RECHECK);
        rejected.insert(
            key,
            Rejection {
                message,
                recheck_at: now + wait,
                times,
            },
        );
        wait
    }

    /// Records that the API server rejected a real create of residency
    /// `residency`'s pod built from `template` (JSON text) in `namespace`.
    pub fn rejected_create(
        &self,
        namespace: &str,
        residency: &str,
        template: &str,
        message: String,
    ) {
        let key = (namespace, residency, template_hash(template));
        self.reject(key, message, Instant::now());
    }

    /// The registry models of `r` whose pod the API server rejects, with
    /// its message. Templates not judged yet (or whose rejection is due
    /// again) are dry-run now; an answer that says nothing about the pod
    /// (the server busy or unreachable) leaves the template unjudged and is
    /// asked again next time.
    pub async fn rejected(
        &self,
        api: &Api<Pod>,
        r: &ModelResidency,
        owner: &OwnerReference,
        gpu: &crate::residency::gpu::Placement,
        metrics: &Metrics,
    ) -> Rejections {
        let namespace = r.namespace().unwrap_or_default();
        let residency = r.name_any();
        let mut out = Rejections::default();
        let mut recheck = |wait: Duration| {
            out.recheck_in = Some(out.recheck_in.map_or(wait, |w| w.min(wait)));
        };
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
            let key = (
                namespace.as_str(),
                residency.as_str(),
                template_hash(template.json()),
            );
            let verdict = match self.known(key, Instant::now()) {
                Known::Rejected(message, wait) => {
                    recheck(wait);
                    Some(message)
                }
                Known::Accepted => None,
                Known::Ask => {
                    // A template that cannot even be built is decide's to
                    // report; the size does not matter to the API server.
                    let Ok(pod) = build_pod(r, owner, m, 0, gpu) else {
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
                    match &verdict {
                        None => self.accept(key),
                        Some(message) => recheck(self.reject(key, message.clone(), Instant::now())),
                    }
                    verdict
                }
            };
            if let Some(message) = &verdict {
                rejected.insert(m.name.clone(), message.clone());
            }
            seen.insert(template.json(), verdict);
        }
        out.by_model = rejected;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejection_is_its_residencys_alone_and_is_asked_again_after_a_backoff() {
        let v = TemplateVerdicts::default();
        let t0 = Instant::now();
        let (a, b) = (("ns", "gpu-a", 7), ("ns", "gpu-b", 7));
        assert_eq!(v.known(a, t0), Known::Ask);
        // gpu-a's pod is rejected (its node name, say): gpu-b still asks
        // for itself, and once accepted there, the template is accepted
        // for every residency of the namespace except gpu-a.
        assert_eq!(v.reject(a, "bad node".into(), t0), FIRST_RECHECK);
        assert_eq!(v.known(b, t0), Known::Ask);
        v.accept(b);
        assert_eq!(v.known(b, t0), Known::Accepted);
        assert_eq!(v.known(("ns", "gpu-c", 7), t0), Known::Accepted);
        assert_eq!(v.known(("other", "gpu-c", 7), t0), Known::Ask);
        assert_eq!(
            v.known(a, t0 + Duration::from_secs(1)),
            Known::Rejected("bad node".into(), Duration::from_secs(4))
        );
        // Due again: gpu-a asks itself, not the shared acceptance.
        assert_eq!(v.known(a, t0 + FIRST_RECHECK), Known::Ask);
        // Rejected again and again: the wait doubles, up to its cap.
        let waits: Vec<u64> = (0..9)
            .map(|_| v.reject(a, "bad node".into(), t0).as_secs())
            .collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 300, 300, 300, 300]);
        // Accepted at last (the quota was raised): the rejection is gone.
        v.accept(a);
        assert_eq!(v.known(a, t0), Known::Accepted);
        assert_eq!(v.reject(a, "full".into(), t0), FIRST_RECHECK);
    }
}
