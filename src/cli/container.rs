//! The commands the local images run as containers on a real node:
//! `fake-model-server` (the model server image's entrypoint) and `pause`
//! (the pod sandbox's), and `lane`, which runs a command in namespaces of
//! its own for the real node (src/local/lane.rs).

use super::Failure;
use model_residency::local::model_server::{
    ContainerOptions, Identity, SleepBehaviour, run_in_container,
};
use std::ffi::OsString;
use std::net::SocketAddr;
use std::time::Duration;

#[derive(clap::Args, Debug)]
pub struct FakeModelServerArgs {
    /// The address to serve on.
    #[arg(long, default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// The model it says it serves (a pod's template sets it from the
    /// residency.dev/model label with the downward API).
    #[arg(long, env = "MODEL_NAME")]
    model: String,
    /// The pod it says it is (the downward API's metadata.name).
    #[arg(long, env = "POD_NAME", default_value = "")]
    pod: String,
    /// Its sleep delays and faults, as the stand-in's annotation says them
    /// (`sleep=200ms,wake=50ms`, `mode=missing|lies|slow`).
    #[arg(long, env = "FAKE_SLEEP", default_value = "")]
    sleep: String,
    /// The pause between a stream's chunks, in milliseconds.
    #[arg(long, default_value_t = 20)]
    stream_delay_ms: u64,
    /// The longest SIGTERM waits for answers in progress, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Serve LoRA adapters as vLLM 0.32 does with `--enable-lora`, up to
    /// this rank (`--max-lora-rank`): its runtime load and unload
    /// endpoints, adapters in `/v1/models`, requests that name one.
    #[arg(long)]
    max_lora_rank: Option<u64>,
}

pub fn fake_model_server(args: FakeModelServerArgs) -> Result<(), Failure> {
    let options = ContainerOptions {
        listen: args.listen,
        identity: Identity {
            model: args.model,
            pod: args.pod,
        },
        sleep: SleepBehaviour::parse(&args.sleep),
        stream_delay: Duration::from_millis(args.stream_delay_ms),
        drain: Duration::from_secs(args.drain_secs),
        max_lora_rank: args.max_lora_rank,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Failure::other)?
        .block_on(run_in_container(options))
        .map_err(|e| Failure::other(format!("fake model server: {e}")))
}

/// A pod sandbox's process: waits for SIGTERM or SIGINT, reaping any
/// child handed to it (it is PID 1 of the pod when the pod shares its
/// process namespace).
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
pub fn pause() -> Result<(), Failure> {
    // SAFETY: sigprocmask and sigwait on a set built here; no handler runs.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, signal);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        loop {
            let mut signal = 0;
            libc::sigwait(&set, &mut signal);
            if signal == libc::SIGCHLD {
                while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {}
            } else {
                return Ok(());
            }
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct LaneArgs {
    /// The command and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

/// Runs this very command again inside a lane, with `extra` arguments
/// added (`--node real`), and waits for it.
pub fn rerun_in_lane(extra: &[&str]) -> Result<(), Failure> {
    let mut command: Vec<OsString> = vec![std::env::current_exe().map_err(Failure::other)?.into()];
    command.extend(std::env::args_os().skip(1));
    command.extend(extra.iter().map(OsString::from));
    let status = model_residency::local::lane::run(&command).map_err(Failure::other)?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure {
            message: format!("in its lane, {status}"),
            code: 1,
        })
    }
}

/// Runs the command in a lane; exits with its status.
pub fn lane(args: LaneArgs) -> Result<(), Failure> {
    let status = model_residency::local::lane::run(&args.command)
        .map_err(|e| Failure::other(format!("lane: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(Failure {
            message: format!("the lane's command {status}"),
            code: status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .unwrap_or(1),
        })
    }
}
