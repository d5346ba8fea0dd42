//! Sleep and wake requests to model pods (the warm tier): sent to the
//! pod's own address, confirmed with the server's status request, and
//! only then counted as done.

use super::decide::PodCall;
use crate::residency::warm::{Call, says_asleep};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Asks the pod to sleep or wake and confirms it; how long it took, or why
/// it did not work.
pub async fn ask(call: &PodCall) -> (Result<(), String>, f64) {
    let t0 = Instant::now();
    let result = ask_and_confirm(call).await;
    (result, t0.elapsed().as_secs_f64())
}

async fn ask_and_confirm(call: &PodCall) -> Result<(), String> {
    let addr = call.addr.ok_or("its pod has no IP yet")?;
    let p = &call.protocol;
    let request = if call.wake { &p.wake } else { &p.sleep };
    let answer = send(addr, request).await?;
    if !request.worked(answer.0) {
        return Err(format!(
            "{} {} answered {}: {}",
            request.method,
            request.path,
            answer.0,
            answer.1.chars().take(200).collect::<String>()
        ));
    }
    let Some((status, field)) = &p.status else {
        return Ok(());
    };
    let (code, body) = send(addr, status).await?;
    match says_asleep(&body, field) {
        Some(asleep) if asleep != call.wake && status.worked(code) => Ok(()),
        Some(asleep) => Err(format!(
            "{} {} says {field}={asleep} after the {}",
            status.method,
            status.path,
            if call.wake { "wake" } else { "sleep" }
        )),
        None => Err(format!(
            "{} {} answered {code} without a boolean {field}",
            status.method, status.path
        )),
    }
}

async fn send(addr: SocketAddr, call: &Call) -> Result<(u16, String), String> {
    let within = call.timeout.max(Duration::from_millis(1));
    match tokio::time::timeout(
        within,
        crate::http::send(addr, &call.method, &call.path, ""),
    )
    .await
    {
        Ok(Ok(a)) => Ok((a.status, a.body)),
        Ok(Err(e)) => Err(format!("{} {}: {e}", call.method, call.path)),
        Err(_) => Err(format!(
            "{} {} did not answer within {}s",
            call.method,
            call.path,
            within.as_secs_f64()
        )),
    }
}
