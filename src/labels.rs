//! Label and annotation keys shared by the operator, its model pods and the
//! kubelet stand-in.

/// Label on a model pod: the model it serves.
pub const MODEL_LABEL: &str = "residency.dev/model";
/// Label on a model pod: the ModelResidency that owns it.
pub const RESIDENCY_LABEL: &str = "residency.dev/residency";
/// Annotation on a model pod: the model's declared VRAM size in bytes.
pub const SIZE_ANNOTATION: &str = "residency.dev/size";
