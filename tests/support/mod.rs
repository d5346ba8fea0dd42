//! Shared test support. Each test binary uses part of it.
#![allow(dead_code)]

pub mod artifact_server;
pub mod cluster;
pub mod http;
pub mod operator;
pub mod reference;
pub mod router;
pub mod seed;
