//! What every process knows of a residency: its spec validated and its
//! state restored from status (`state`), the words its status uses
//! (`reasons`), its conditions (`conditions`), the one write that requests
//! or unloads a model (`demand`), where its GPU is and how its pods get it (`gpu`), the names on its pods (`labels`),
//! where a model's load or its next copy goes (`placement`), and its
//! registry with the ModelCatalog it names (`catalog`), the LoRA adapters
//! it can never serve (`adapters`), whose a name is when several namespaces list it (`names`), the gangs placed on its GPU (`gangs`), the GPUs ResourceSlices publish
//! and which a set's CEL selectors pick (`devices`, held to `cel_bounds`).
//! The operator, the router, the node agent and the CLI all build on this;
//! none of it knows the reconciler. No I/O but the demand merge patch.

pub mod adapters;
pub mod catalog;
pub mod cel_bounds;
pub mod conditions;
pub mod demand;
pub mod devices;
pub mod gangs;
pub mod gpu;
pub mod health;
pub mod labels;
pub mod names;
pub mod placement;
pub mod reasons;
pub mod state;
pub mod warm;
