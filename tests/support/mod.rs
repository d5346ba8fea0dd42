//! Shared test support.
pub mod reference;
