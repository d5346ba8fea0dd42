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

/// Whether `s` is short enough to be a label value.
pub fn fits_label_value(s: &str) -> bool {
    s.len() <= LABEL_VALUE_MAX
}
