//! The CEL rules (`x-kubernetes-validations`) the API server checks at
//! admission. Each answers with a sentence (`messageExpression`) that names
//! the value and says what is right, where a schema `pattern` would answer
//! with its raw regex; the demand map's names the key that is wrong. Only facts about one field live here; facts that need another
//! object (is that model in the registry?) stay conditions, since an
//! autoscaler may write demand before the registry edit lands.
//!
//! The rules are cheap by construction: every string they read has a
//! `maxLength`, every list a `maxItems`, the demand map a `maxProperties`,
//! so the API server's cost estimate accepts them (it refuses a CRD whose
//! worst case is too expensive). A raw CEL string (`r'...'`) carries each
//! regex, so its backslashes are the regex's own.

use serde_json::{Value, json};

/// DNS label: lowercase alphanumerics and '-', starting and ending with an
/// alphanumeric. Model names become pod-name parts and label values.
pub const DNS_LABEL: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// A DNS-1123 subdomain, what the API server accepts as a node's name.
pub const DNS_SUBDOMAIN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// One GPU: an index, a `GPU-...` UUID or a `MIG-...` UUID (MIG's own
/// `MIG-GPU-<uuid>/<gi>/<ci>` form included). Not `all`, `none`, a list or
/// empty: one object is one GPU's budget.
/// An index has at most four digits: a longer one (`99999999999999999999`)
/// is no device, and in claim mode it made a claim selector the API server
/// refuses at every retry.
pub const ONE_GPU: &str = r"^([0-9]{1,4}|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)$";
/// A duration as the operator reads it: numbers with units (`30s`,
/// `1m30s`, `500ms`, `2h`).
pub const DURATION: &str = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$";
/// A request to a model's own pod: a path (and query) on it, printable
/// ASCII without spaces, never a URL of another host.
pub const POD_PATH: &str = r"^/[!-~]*$";
/// A positive Kubernetes quantity without sign or milli-units.
pub const POSITIVE_QUANTITY: &str = r"^\+?(0*[1-9][0-9]*(\.[0-9]*)?|0*\.0*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|[eE]\+?[0-9]+)?$";
/// A normalized absolute path: no `.`, `..` or empty segments, not `/`.
pub const NORMAL_ABSOLUTE_PATH: &str = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$";
const SHA256_HEX: &str = "^[0-9a-fA-F]{64}$";

/// `self` (a string) must match `pattern`; else the message is the value,
/// quoted, and `is_not` (the API server names the field; 1.37 shows the
/// value too, 1.34 only its type).
fn matching(pattern: &str, is_not: &str) -> Value {
    json!([{
        "rule": format!("self.matches(r'{pattern}')"),
        "messageExpression": quoted_self(is_not),
    }])
}

/// A CEL message: `self` in single quotes, then `rest`.
fn quoted_self(rest: &str) -> String {
    format!("\"'\" + self + \"' {rest}\"")
}

/// `spec.nodeName`.
pub fn node_name() -> Value {
    matching(
        DNS_SUBDOMAIN,
        "is not a node name: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit",
    )
}

/// `spec.device`.
pub fn one_gpu() -> Value {
    matching(
        ONE_GPU,
        "is not one GPU: give its index (0), its UUID (GPU-...) or a MIG instance's (MIG-...); not all, none or a list",
    )
}

/// A duration field (`timeout`, `wakeTime`).
pub fn duration() -> Value {
    matching(
        DURATION,
        "is not a duration: a number and a unit (30s, 500ms, 2m, 1h30m)",
    )
}

/// A sleep, wake or status request's `path`.
pub fn pod_path() -> Value {
    matching(
        POD_PATH,
        "is not a path on the model's pod: start with '/', printable characters, no spaces",
    )
}

/// `spec.budgetFraction`. The schema's `minimum` let an integer 0 through
/// (a 1-byte budget) while it refused `1e-07`: the rule reads every number.
pub fn fraction() -> Value {
    json!([{
        "rule": "double(self) >= 0.01 && double(self) <= 1.0",
        "message": "budgetFraction is a share of the device's memory: at least 0.01, at most 1",
    }])
}

/// Rules across spec fields: what only claim mode may leave out, and the
/// fields each mode reads.
pub fn spec() -> Value {
    const CLAIM: &str = "(!has(self.gpu) || !has(self.gpu.mode) || self.gpu.mode == 'claim')";
    json!([
        {
            "rule": format!("has(self.nodeName) || {CLAIM}"),
            "message": "spec.nodeName is required unless spec.gpu.mode is claim (where the scheduler may choose the node)",
        },
        {
            "rule": format!("has(self.budget) || {CLAIM}"),
            "message": "spec.budget is required unless spec.gpu.mode is claim (where it is the allocated device's memory times spec.budgetFraction)",
        },
        {
            "rule": format!("!has(self.gpu) || !has(self.gpu.existingClaim) || {CLAIM}"),
            "message": "spec.gpu.existingClaim is for spec.gpu.mode claim only",
        },
        {
            "rule": "!has(self.gpu) || !has(self.gpu.resourceName) || (has(self.gpu.mode) && self.gpu.mode == 'devicePlugin')",
            "message": "spec.gpu.resourceName is for spec.gpu.mode devicePlugin only",
        },
        {
            "rule": format!("!has(self.budgetFraction) || {CLAIM}"),
            "message": "spec.budgetFraction is for spec.gpu.mode claim only (the other modes cannot read the device's memory)",
        },
    ])
}

/// A model's name, in the registry and in a ModelDemand.
pub fn model_name() -> Value {
    matching(
        DNS_LABEL,
        "is not a model name: lowercase letters, digits and '-', starting and ending with a letter or digit",
    )
}

/// `budget` and every `size`.
pub fn positive_quantity() -> Value {
    matching(
        POSITIVE_QUANTITY,
        "is not a positive size: write bytes (17179869184) or a number and a unit (16000Mi, 80Gi, 1.5T); no sign, no milli-units",
    )
}

/// An artifact's `mountPath`.
pub fn mount_path() -> Value {
    matching(
        NORMAL_ABSOLUTE_PATH,
        "is not a normalized absolute path (one that starts with '/' and has no empty, '.' or '..' segments)",
    )
}

/// An artifact file's `uri`. Prefix tests, not a regex: a regex over
/// 2048 characters, in 64 files of 1000 models, is past the API server's
/// cost budget.
pub fn http_uri() -> Value {
    json!([{
        "rule": "self.startsWith('http://') || self.startsWith('https://')",
        "messageExpression": quoted_self("is not an http:// or https:// URI (the node agent fetches nothing else)"),
    }])
}

/// An artifact's `source`: an OCI reference pinned by digest or tag.
pub fn oci_source() -> Value {
    json!([{
        "rule": "self.startsWith('oci://') && size(self) > 7",
        "messageExpression": quoted_self("is not an oci://<registry>/<repository>[:tag|@sha256:digest] reference"),
    }])
}

/// An artifact names its files or a registry source, not both.
pub fn artifact_source() -> Value {
    json!([{
        "rule": "has(self.source) != (has(self.files) && size(self.files) > 0)",
        "message": "an artifact has either files (http) or a source (oci://), exactly one of them",
    }, {
        "rule": "!has(self.path) || has(self.source)",
        "message": "path selects a directory inside an OCI source's layers; it needs source",
    }])
}

/// `spec.models[].lora`: host slots hold the GPU slots' adapters too, and
/// the pinned adapters fit in a pod (each pod holds every one once asked).
pub fn lora() -> Value {
    json!([{
        "rule": "!has(self.hostSlots) || !has(self.slots) || self.hostSlots >= self.slots",
        "message": "hostSlots counts the adapters a pod holds in GPU and host memory together: at least slots",
    }, {
        "rule": "!has(self.adapters) || self.adapters.filter(a, has(a.pinned) && a.pinned).size() <= (has(self.hostSlots) ? self.hostSlots : (has(self.slots) ? self.slots : 1))",
        "message": "more pinned adapters than a pod holds (hostSlots, else slots): one of them could never load",
    }])
}

/// An artifact file's `sha256`.
pub fn sha256() -> Value {
    matching(SHA256_HEX, "is not a SHA-256 (64 hexadecimal digits)")
}

/// `spec.demand`: every key is a model name. The message names one key
/// that is not (the first; naming them all costs more than the API server
/// allows a message at 100,000 keys).
pub fn demand_keys() -> Value {
    let bad = format!("size(k) > 63 || !k.matches(r'{DNS_LABEL}')");
    json!([{
        "rule": format!("!self.exists(k, {bad})"),
        "messageExpression": format!(
            "\"keys are model names (lowercase letters, digits and '-', at most 63), and '\" + self.filter(k, {bad})[0] + \"' is not one\""
        ),
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_quotes_its_regex_raw() {
        let rule = &positive_quantity()[0];
        let text = rule["rule"].as_str().unwrap();
        assert_eq!(text, format!("self.matches(r'{POSITIVE_QUANTITY}')"));
        assert!(!POSITIVE_QUANTITY.contains('\''));
        let demand = &demand_keys()[0];
        let message = demand["messageExpression"].as_str().unwrap();
        assert!(message.starts_with("\"keys are model names"), "{message}");
    }
}
