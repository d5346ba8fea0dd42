//! Sleep and wake requests to model pods (the warm tier): sent to the
//! pod's own address, confirmed with the server's status request, and
//! only then counted as done.

//!
//! A pod may take long to answer, or never answer: a tenant's timeout is
//! its own (capped by the operator's `--pod-call-timeout-max`), so the
//! calls never run inside a reconcile slot. A reconcile that has calls to
//! make hands them, with the rest of its work (the status write and the
//! events, which must follow the confirmation), to a task of its own
//! ([`Asking`]); until that task ends its residency is busy and its
//! reconciles return at once, and the task's end reconciles it again.

use super::decide::PodCall;
use crate::api::ModelResidency;
use crate::residency::warm::{Call, says_asleep};
use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::ObjectRef;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest a sleep, wake or status request may take by default,
/// whatever its spec says: a sleep of a large model that offloads its
/// weights to host memory takes seconds to tens of seconds; two minutes
/// leaves room for that and bounds what a server that never answers holds.
pub const DEFAULT_CALL_TIMEOUT_MAX: Duration = Duration::from_secs(120);

type Key = ObjectRef<ModelResidency>;

/// The residencies whose pod calls are being made, each by its task.
#[derive(Debug, Default)]
pub struct Asking {
    /// Each busy residency's task, by a number of its own (an aborted
    /// task that ends late must not free a newer task's residency).
    busy: Mutex<HashMap<Key, (u64, tokio::task::AbortHandle)>>,
    next: std::sync::atomic::AtomicU64,
    /// Where a task's end is announced (the controller's reconcile
    /// triggers); set by each run of the controller.
    done: Mutex<Option<UnboundedSender<Key>>>,
}

impl Asking {
    /// Whether `key`'s calls are still being made.
    pub fn busy(&self, key: &Key) -> bool {
        self.busy.lock().expect("asking lock").contains_key(key)
    }

    /// Where the ends of tasks started from now on are sent.
    pub fn announce_to(&self, done: UnboundedSender<Key>) {
        *self.done.lock().expect("asking lock") = Some(done);
    }

    /// Runs `work` for `key` in a task of its own; `key` is busy until it
    /// ends, and its end is announced.
    pub fn spawn(
        self: &Arc<Self>,
        key: Key,
        work: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        // Held while the task is made, so that its end (even at once)
        // comes after it is recorded.
        let mut busy = self.busy.lock().expect("asking lock");
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ending = Ending {
            asking: self.clone(),
            key: key.clone(),
            id,
        };
        let task = tokio::spawn(async move {
            let _ending = ending;
            work.await;
        });
        busy.insert(key, (id, task.abort_handle()));
    }

    /// Stops every task (the controller stopped, or this replica lost the
    /// lead: another one decides now).
    fn abort_all(&self) {
        for (_, (_, task)) in self.busy.lock().expect("asking lock").drain() {
            task.abort();
        }
    }

    /// Aborts every task when dropped: a controller run holds it, so its
    /// tasks end with it however it ends (a run aborted by a lost lease
    /// too).
    pub fn while_running(self: &Arc<Self>) -> impl Drop + use<> {
        struct Guard(Arc<Asking>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.abort_all();
            }
        }
        Guard(self.clone())
    }
}

/// A task's end, however it ends (done, panicked, aborted): its residency
/// is no longer busy, and is reconciled again.
struct Ending {
    asking: Arc<Asking>,
    key: Key,
    id: u64,
}

impl Drop for Ending {
    fn drop(&mut self) {
        let a = &self.asking;
        let mut busy = a.busy.lock().expect("asking lock");
        if busy.get(&self.key).is_some_and(|(id, _)| *id == self.id) {
            busy.remove(&self.key);
        }
        drop(busy);
        if let Some(done) = a.done.lock().expect("asking lock").as_ref() {
            let _ = done.unbounded_send(self.key.clone());
        }
    }
}

/// Asks the pod to sleep or wake and confirms it, each request within its
/// timeout and at most `limit`; how long it took, or why it did not work.
pub async fn ask(call: &PodCall, limit: Duration) -> (Result<(), String>, f64) {
    let t0 = Instant::now();
    let result = ask_and_confirm(call, limit).await;
    (result, t0.elapsed().as_secs_f64())
}

async fn ask_and_confirm(call: &PodCall, limit: Duration) -> Result<(), String> {
    let addr = call.addr.ok_or("its pod has no IP yet")?;
    let p = &call.protocol;
    let requests = if call.wake {
        p.wake.as_slice()
    } else {
        std::slice::from_ref(&p.sleep)
    };
    for request in requests {
        let (code, body) = send_until_it_works(addr, request, limit).await?;
        if !request.worked(code) {
            return Err(format!(
                "{} {} answered {code}: {}",
                request.method,
                request.path,
                body.chars().take(200).collect::<String>()
            ));
        }
    }
    let Some((status, field)) = &p.status else {
        return Ok(());
    };
    let (code, body) = send(addr, status, limit).await?;
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

/// The most of a sleep, wake or status answer the operator reads: they are
/// a few bytes of JSON, and a pod answering gigabytes (a black-box round
/// sent 1.5 GiB) must not take the operator's memory.
pub const ANSWER_LIMIT: usize = 16 << 10;

/// How often a call that waits for its server to be idle is tried again.
const IDLE_RETRY: Duration = Duration::from_millis(500);

/// [`send`], and for a call that waits for its server to be idle, sent
/// again while its answer says it did not work, within its timeout: the
/// last answer.
async fn send_until_it_works(
    addr: SocketAddr,
    call: &Call,
    limit: Duration,
) -> Result<(u16, String), String> {
    if !call.until_idle {
        return send(addr, call, limit).await;
    }
    let deadline = Instant::now() + call.timeout.clamp(Duration::from_millis(1), limit);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let answer = send(addr, call, left).await?;
        if call.worked(answer.0) || left <= IDLE_RETRY {
            return Ok(answer);
        }
        tokio::time::sleep(IDLE_RETRY).await;
    }
}

async fn send(addr: SocketAddr, call: &Call, limit: Duration) -> Result<(u16, String), String> {
    let within = call.timeout.clamp(Duration::from_millis(1), limit);
    match tokio::time::timeout(
        within,
        crate::http::send_capped(addr, &call.method, &call.path, &call.body, ANSWER_LIMIT),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::decide::PodRef;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A loopback server that answers every connection with `answer`
    /// (`None`: never answers), then keeps writing `endless` forever.
    async fn server(answer: Option<&'static str>, endless: bool) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let Some(answer) = answer else {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        return;
                    };
                    let _ = conn.write_all(answer.as_bytes()).await;
                    // 64 KiB chunks of a body that never ends.
                    let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
                    while endless && conn.write_all(chunk.as_bytes()).await.is_ok() {}
                });
            }
        });
        addr
    }

    fn call(addr: SocketAddr, timeout: Duration) -> PodCall {
        let spec: crate::api::SleepSpec =
            serde_json::from_value(serde_json::json!({"sleepingSize": "1Gi"})).unwrap();
        let mut protocol = crate::residency::warm::protocol(&spec);
        protocol.sleep.timeout = timeout;
        protocol.status.as_mut().unwrap().0.timeout = timeout;
        PodCall {
            model: "a".into(),
            pod: PodRef {
                name: "p".into(),
                uid: "u".into(),
            },
            addr: Some(addr),
            wake: false,
            protocol,
        }
    }

    #[tokio::test]
    async fn a_tenants_timeout_is_capped_by_the_operators() {
        let addr = server(None, false).await;
        let t0 = Instant::now();
        let (result, _) = ask(
            &call(addr, Duration::from_secs(36_000_000)),
            Duration::from_millis(300),
        )
        .await;
        let why = result.unwrap_err();
        assert!(why.contains("did not answer within 0.3s"), "{why}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn an_answer_longer_than_the_limit_is_refused_without_reading_it_all() {
        // A body that never ends (the black-box round sent 1.5 GiB to the
        // status request, and the operator read it whole).
        let endless = server(
            Some("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
            true,
        )
        .await;
        let t0 = Instant::now();
        let (result, _) = ask(
            &call(endless, Duration::from_secs(30)),
            Duration::from_secs(30),
        )
        .await;
        let why = result.unwrap_err();
        assert!(
            why.contains(&format!("longer than {ANSWER_LIMIT} bytes")),
            "{why}"
        );
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    }
}
