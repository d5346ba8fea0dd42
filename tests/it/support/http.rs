//! The HTTP client tests talk to model pods (and, later, the router)
//! with: the library's, on hyper.

pub use model_residency::http::Answer;
use std::net::SocketAddr;

/// A port free on 127.0.0.1 now, for a process that must be told its
/// address.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends `method path` with a JSON `body` (empty for none) to `addr`.
pub async fn send(addr: SocketAddr, method: &str, path: &str, body: &str) -> Answer {
    model_residency::http::send(addr, method, path, body)
        .await
        .unwrap_or_else(|e| panic!("{method} http://{addr}{path}: {e}"))
}
