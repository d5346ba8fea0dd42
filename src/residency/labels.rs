//! Label and annotation keys shared by the operator, its model pods and the
//! kubelet stand-in.

/// Label on a model pod: the model it serves.
pub const MODEL_LABEL: &str = "residency.dev/model";
/// Label on a model pod: the ModelResidency that owns it.
pub const RESIDENCY_LABEL: &str = "residency.dev/residency";
/// Annotation on a model pod: the model's declared VRAM size in bytes.
pub const SIZE_ANNOTATION: &str = "residency.dev/size";
/// Annotation on a model pod: the GPU it was given.
pub const DEVICE_ANNOTATION: &str = "residency.dev/device";
/// Annotation on a model pod: a hash of the template it was built from, so
/// a changed template is seen and rolled out.
pub const TEMPLATE_HASH_ANNOTATION: &str = "residency.dev/template-hash";

/// The longest a label value may be. A residency's name is a label value
/// on its pods, so it is held to this too.
pub const LABEL_VALUE_MAX: usize = 63;

/// Lowercase letters, digits and '-', starting and ending with a letter or
/// digit: one part of a DNS-1123 name, of any length.
fn dns_part(s: &str) -> bool {
    let b = s.as_bytes();
    let inner = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && inner(&b[0])
        && inner(&b[b.len() - 1])
        && b.iter().all(|c| inner(c) || *c == b'-')
}

/// Whether `s` is a DNS-1123 label, as model names are.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= 63 && dns_part(s)
}

/// Whether `s` is a DNS-1123 subdomain, as a pod's `spec.nodeName` must be.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns_part)
}

/// Whether `s` is short enough to be a label value.
pub fn fits_label_value(s: &str) -> bool {
    s.len() <= LABEL_VALUE_MAX
}
