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

/// What a streamed OpenAI answer came to: its last `finish_reason`, and
/// how many tokens it carried (its usage chunk's count when it sent one,
/// as vLLM does on `stream_options.include_usage`; else its chunks of
/// text, one token each as the fake sends them).
pub fn streamed(a: &Answer) -> (Option<String>, u64) {
    let chunks: Vec<serde_json::Value> = a
        .body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let reason = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["finish_reason"].as_str())
        .next_back()
        .map(str::to_owned);
    let usage = chunks
        .iter()
        .find_map(|c| c["usage"]["completion_tokens"].as_u64());
    let text = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count() as u64;
    (reason, usage.unwrap_or(text))
}
