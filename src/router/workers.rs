//! The router's runtime: one thread per core, each with a current-thread
//! tokio runtime, its own `SO_REUSEPORT` listener on the router's address
//! and its own pool of connections to model pods (nginx's shape). The
//! kernel spreads new connections over the listeners; a request is
//! accepted, read, routed, forwarded and answered on one thread, with no
//! hand-off between threads on the way. The watches, the recency ticks
//! and the demand writes run on the process's main runtime, shared by
//! every worker through the [`super::Router`] that `serve` captures.

use std::future::Future;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The serving threads of one router; [`Workers::stop`] ends them.
pub struct Workers {
    threads: Vec<JoinHandle<()>>,
    /// `true`: stop accepting. Dropped: stop serving (after the drain).
    accepting: watch::Sender<bool>,
    serving: Option<watch::Sender<()>>,
    /// The address every worker listens on (its port, where 0 was asked).
    pub addr: SocketAddr,
}

/// A listening socket on `addr` that other sockets may share
/// (`SO_REUSEPORT`): the kernel balances connections among them.
fn shared_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

impl Workers {
    /// Binds `count` listeners on `addr` (the first decides the port when
    /// `addr`'s is 0) and starts a serving thread on each, running
    /// `serve(listener)` until told to stop.
    pub fn start<S, F>(addr: SocketAddr, count: usize, serve: S) -> std::io::Result<Self>
    where
        S: Fn(TcpListener) -> F + Clone + Send + 'static,
        F: Future<Output = ()>,
    {
        let first = shared_listener(addr)?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..count.max(1) {
            listeners.push(shared_listener(addr)?);
        }
        let (accepting, _) = watch::channel(false);
        let (serving, _) = watch::channel(());
        let mut threads = Vec::with_capacity(listeners.len());
        for (i, listener) in listeners.into_iter().enumerate() {
            let serve = serve.clone();
            let mut stop = accepting.subscribe();
            let mut done = serving.subscribe();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let thread = std::thread::Builder::new()
                .name(format!("router-worker-{i}"))
                .spawn(move || {
                    runtime.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "router worker cannot listen");
                                return;
                            }
                        };
                        tokio::select! {
                            () = serve(listener) => {}
                            _ = stop.wait_for(|stop| *stop) => {}
                        }
                        // The listener is closed; requests in flight keep
                        // this runtime until the drain is over.
                        let _ = done.changed().await;
                    });
                })?;
            threads.push(thread);
        }
        Ok(Workers {
            threads,
            accepting,
            serving: Some(serving),
            addr,
        })
    }

    /// Stops accepting connections (requests in flight go on).
    pub fn stop_accepting(&self) {
        let _ = self.accepting.send(true);
    }

    /// Stops serving and waits for the threads.
    pub fn stop(mut self) {
        self.stop_accepting();
        self.serving.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_share_one_port() {
        let a = shared_listener("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = a.local_addr().unwrap();
        let b = shared_listener(addr).unwrap();
        assert_eq!(b.local_addr().unwrap(), addr);
    }
}
