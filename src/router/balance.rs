//! Which of a model's Ready copies gets a request.
//!
//! - `least-in-flight` (the default): the copy with the fewest requests
//!   this router is proxying to it now.
//! - `prefix-hash` (opt-in, for KV-cache reuse): consistent hashing with
//!   bounded loads, as KubeAI's `PrefixHash` does. The key is the first
//!   [`PREFIX_CHARS`] characters of the prompt (a chat's messages' text in
//!   order, or a completion's `prompt`); each copy has [`VIRTUAL_NODES`]
//!   points on a ring; a request goes to the first copy clockwise from its
//!   key whose load stays within [`LOAD_FACTOR`] times the mean (Mirrokni,
//!   Thorup and Zadimoghaddam's bound: `ceil(c * (total + 1) / copies)`),
//!   so requests sharing a prefix meet the copy that has it cached, and a
//!   hot prefix spills to the next copy instead of piling up. A request
//!   without a prompt falls back to least-in-flight.

use super::snapshot::Endpoint;
use std::sync::atomic::Ordering;

/// How many characters of the prompt make the key.
pub const PREFIX_CHARS: usize = 100;
/// Points per copy on the ring.
pub const VIRTUAL_NODES: u32 = 256;
/// A copy may take up to this many times the mean load.
pub const LOAD_FACTOR: f64 = 1.25;

/// The balancing strategy (`--balance`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Strategy {
    #[default]
    LeastInFlight,
    PrefixHash,
}

/// The copy for a request with prompt prefix `key` (prefix-hash only),
/// not `avoid` (a pod that could not be reached) unless it is the only one.
pub fn pick(
    strategy: Strategy,
    ready: &[Endpoint],
    avoid: Option<&str>,
    key: Option<&str>,
) -> Option<Endpoint> {
    let candidates: Vec<&Endpoint> = ready.iter().filter(|e| avoid != Some(&*e.pod)).collect();
    let chosen = match (strategy, key) {
        (Strategy::PrefixHash, Some(key)) if candidates.len() > 1 => bounded_ring(&candidates, key),
        _ => least_in_flight(&candidates),
    };
    chosen.or_else(|| ready.first()).cloned()
}

fn load(e: &Endpoint) -> usize {
    e.in_flight.load(Ordering::Relaxed)
}

fn least_in_flight<'e>(candidates: &[&'e Endpoint]) -> Option<&'e Endpoint> {
    candidates.iter().copied().min_by_key(|e| load(e))
}

/// Consistent hashing with bounded loads (module docs).
fn bounded_ring<'e>(candidates: &[&'e Endpoint], key: &str) -> Option<&'e Endpoint> {
    let total: usize = candidates.iter().map(|e| load(e)).sum();
    let bound = (LOAD_FACTOR * (total + 1) as f64 / candidates.len() as f64).ceil() as usize;
    let mut ring: Vec<(u64, usize)> = Vec::with_capacity(candidates.len() * VIRTUAL_NODES as usize);
    for (i, e) in candidates.iter().enumerate() {
        for v in 0..VIRTUAL_NODES {
            ring.push((hash(&[e.pod.as_bytes(), &v.to_le_bytes()]), i));
        }
    }
    ring.sort_unstable();
    let point = hash(&[key.as_bytes()]);
    let start = ring.partition_point(|(h, _)| *h < point);
    let mut tried = vec![false; candidates.len()];
    for k in 0..ring.len() {
        let (_, i) = ring[(start + k) % ring.len()];
        if std::mem::replace(&mut tried[i], true) {
            continue;
        }
        if load(candidates[i]) < bound {
            return Some(candidates[i]);
        }
    }
    least_in_flight(candidates)
}

/// FNV-1a over the parts, then a 64-bit finaliser (splitmix64's) so that
/// near keys spread over the ring.
fn hash(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in *part {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The first [`PREFIX_CHARS`] characters of a request's prompt: the text
/// of a chat's messages in order, or a completion's `prompt` (a string, or
/// the first of a list). None when the body has neither.
pub fn prompt_prefix(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Request {
        #[serde(default)]
        messages: Option<Vec<Message>>,
        #[serde(default)]
        prompt: Option<serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    struct Message {
        #[serde(default)]
        content: Option<serde_json::Value>,
    }
    let request: Request = serde_json::from_slice(body).ok()?;
    let mut text = String::new();
    if let Some(messages) = request.messages {
        for m in messages {
            match m.content {
                Some(serde_json::Value::String(s)) => text.push_str(&s),
                // Content parts: their text, in order.
                Some(serde_json::Value::Array(parts)) => {
                    for p in parts {
                        if let Some(t) = p.get("text").and_then(|t| t.as_str()) {
                            text.push_str(t);
                        }
                    }
                }
                _ => {}
            }
            if text.chars().count() >= PREFIX_CHARS {
                break;
            }
        }
    } else {
        match request.prompt? {
            serde_json::Value::String(s) => text = s,
            serde_json::Value::Array(list) => text = list.first()?.as_str()?.to_owned(),
            _ => return None,
        }
    }
    (!text.is_empty()).then(|| text.chars().take(PREFIX_CHARS).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    fn endpoints(n: usize) -> Vec<Endpoint> {
        (0..n)
            .map(|i| Endpoint::for_tests(&format!("ns/pod-{i}"), Arc::new(AtomicUsize::new(0))))
            .collect()
    }

    #[test]
    fn the_prefix_is_the_prompts_first_hundred_characters() {
        let long = "x".repeat(150);
        let chat = format!(
            r#"{{"messages":[{{"role":"system","content":"be brief. "}},{{"role":"user","content":"{long}"}}]}}"#
        );
        let p = prompt_prefix(chat.as_bytes()).unwrap();
        assert_eq!(p.chars().count(), 100);
        assert!(p.starts_with("be brief. xxx"));
        assert_eq!(
            prompt_prefix(br#"{"prompt":"hello"}"#).as_deref(),
            Some("hello")
        );
        assert_eq!(
            prompt_prefix(br#"{"prompt":["a","b"]}"#).as_deref(),
            Some("a")
        );
        let parts =
            br#"{"messages":[{"content":[{"type":"text","text":"hi"},{"type":"image_url"}]}]}"#;
        assert_eq!(prompt_prefix(parts).as_deref(), Some("hi"));
        assert_eq!(prompt_prefix(br#"{"input":"embed me"}"#), None);
        assert_eq!(prompt_prefix(b"not json"), None);
    }

    #[test]
    fn one_prefix_goes_to_one_copy_while_it_is_within_its_bound() {
        let ready = endpoints(4);
        let first = pick(
            Strategy::PrefixHash,
            &ready,
            None,
            Some("shared system prompt"),
        )
        .unwrap();
        for _ in 0..10 {
            let again = pick(
                Strategy::PrefixHash,
                &ready,
                None,
                Some("shared system prompt"),
            )
            .unwrap();
            assert_eq!(again.pod, first.pod);
        }
        // Different prefixes spread over the copies.
        let mut seen = std::collections::HashSet::new();
        for i in 0..64 {
            let e = pick(
                Strategy::PrefixHash,
                &ready,
                None,
                Some(&format!("prompt {i}")),
            )
            .unwrap();
            seen.insert(e.pod.clone());
        }
        assert_eq!(seen.len(), 4, "{seen:?}");
    }

    #[test]
    fn a_hot_prefix_spills_over_once_its_copy_is_above_the_bound() {
        let ready = endpoints(4);
        let mut counts = std::collections::HashMap::new();
        // Forty requests of one prefix in flight at once.
        for _ in 0..40 {
            let e = pick(Strategy::PrefixHash, &ready, None, Some("hot")).unwrap();
            e.in_flight.fetch_add(1, Ordering::Relaxed);
            *counts.entry(e.pod.clone()).or_insert(0) += 1;
        }
        // No copy above ceil(1.25 * 40 / 4) = 13.
        assert!(counts.values().all(|&c| c <= 13), "{counts:?}");
        assert!(counts.len() >= 3, "{counts:?}");
    }

    #[test]
    fn without_a_prompt_or_by_default_the_least_busy_copy_is_chosen() {
        let ready = endpoints(3);
        ready[0].in_flight.store(5, Ordering::Relaxed);
        ready[1].in_flight.store(1, Ordering::Relaxed);
        ready[2].in_flight.store(3, Ordering::Relaxed);
        for (strategy, key) in [
            (Strategy::PrefixHash, None),
            (Strategy::LeastInFlight, Some("k")),
        ] {
            assert_eq!(&*pick(strategy, &ready, None, key).unwrap().pod, "ns/pod-1");
        }
        assert_eq!(
            &*pick(Strategy::LeastInFlight, &ready, Some("ns/pod-1"), None)
                .unwrap()
                .pod,
            "ns/pod-2"
        );
        // The only copy left is used even when it was unreachable once.
        let one = endpoints(1);
        assert_eq!(
            &*pick(Strategy::PrefixHash, &one, Some("ns/pod-0"), Some("k"))
                .unwrap()
                .pod,
            "ns/pod-0"
        );
    }
}
