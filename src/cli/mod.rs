//! Command-line surface: argument definitions and dispatch.

#[cfg(feature = "local")]
mod container;
mod demand;
#[cfg(feature = "local")]
mod demo;
mod gpus;
#[cfg(feature = "local")]
mod local_cluster;
mod node_agent;
mod operator;
mod process;
mod route;
mod simulate;
mod top;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "model-residency",
    version,
    about = "Per-GPU model residency for Kubernetes: keep the hot models loaded within a VRAM budget"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay requests through the residency engine and report hits, loads,
    /// evictions, refusals and peak VRAM.
    Simulate(simulate::Args),
    /// Print the ModelResidency, ModelDemand and NodeModelCache CustomResourceDefinitions
    /// as YAML (`model-residency crd | kubectl apply -f -`).
    Crd,
    /// Run the whole thing end to end on a local control plane, explained.
    #[cfg(feature = "local")]
    Demo(demo::Args),
    /// Start a local control plane with fake GPU nodes (until Ctrl-C), to
    /// try the operator by hand.
    #[cfg(feature = "local")]
    LocalCluster(local_cluster::Args),
    /// Serve as the fake model server in a container (the local model
    /// server image's entrypoint on a real node; docs/local-cluster.md).
    #[cfg(feature = "local")]
    FakeModelServer(container::FakeModelServerArgs),
    /// Wait for SIGTERM: the local pause image's entrypoint (pod sandboxes).
    #[cfg(feature = "local")]
    #[command(hide = true)]
    Pause,
    /// Run a command in network, mount and PID namespaces of its own, with
    /// a bridge for pods (the real node's lane; docs/local-cluster.md).
    #[cfg(feature = "local")]
    #[command(hide = true)]
    Lane(container::LaneArgs),
    /// Run the controller (watches ModelResidencies and their model pods).
    Run(operator::Args),
    /// Run the request router: proxies model requests to the model pods,
    /// holding a request through its model's load and turning traffic into
    /// demand.
    Route(route::Args),
    /// Run the node agent: keeps model artifacts on this node's disk within
    /// a budget and reports them in the node's NodeModelCache.
    NodeAgent(node_agent::Args),
    /// Load or unload a model by writing spec.demand.
    Demand {
        #[command(flatten)]
        target: demand::Target,
        #[command(subcommand)]
        command: demand::DemandCommand,
    },
    /// List the cluster's GPUs (from the DRA drivers' ResourceSlices): node,
    /// device, uuid, product, memory, the residency that holds it, free.
    Gpus(gpus::Args),
    /// What is loaded where: every GPU (residency) with its models, their
    /// state, size, last use, idle unload and copies, refreshed until
    /// interrupted (also `kubectl residency top`, with the binary installed
    /// as kubectl-residency).
    Top(top::Args),
    /// Show a residency: resident models in LRU order, used/budget, and what
    /// loading each other model would evict.
    Status {
        #[command(flatten)]
        target: demand::Target,
        /// The ModelResidency's name.
        residency: String,
    },
}

/// A command's failure: the message for stderr and the exit code
/// (2 for bad input, 1 for anything else).
pub struct Failure {
    pub message: String,
    pub code: u8,
}

impl Failure {
    pub fn bad_input(message: impl ToString) -> Self {
        Failure {
            message: message.to_string(),
            code: 2,
        }
    }

    /// Anything that is not the input's fault (I/O, a missing tool).
    pub fn other(message: impl ToString) -> Self {
        Failure {
            message: message.to_string(),
            code: 1,
        }
    }
}

/// Binds the calling thread to jemalloc's first arena. The operator's
/// memory is many small, long-lived allocations (its caches), and it is
/// never allocation-bound; jemalloc's default of four arenas per core
/// spreads them over as many arenas, each keeping pages of its own
/// (docs/performance.md, Memory). The router keeps
/// the default: its threads allocate on every request.
#[allow(unsafe_code)] // a libc call std has no safe wrapper for
fn one_arena() {
    let arena: std::ffi::c_uint = 0;
    // SAFETY: "thread.arena" takes a c_uint by pointer; no old value is
    // read (null oldp/oldlenp). A failure (an unknown name) leaves the
    // thread on its arena, which is only a little more memory.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            c"thread.arena".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&arena as *const std::ffi::c_uint).cast_mut().cast(),
            std::mem::size_of::<std::ffi::c_uint>(),
        );
    }
}

pub fn run(cli: Cli) -> Result<(), Failure> {
    let build_with = |builder: &mut tokio::runtime::Builder, threads: u16| {
        builder
            .worker_threads(usize::from(threads))
            .enable_all()
            .build()
            .map_err(|e| Failure {
                message: format!("cannot start the async runtime: {e}"),
                code: 1,
            })
    };
    // Two threads unless a long-running process is told otherwise.
    let runtime = || build_with(&mut tokio::runtime::Builder::new_multi_thread(), 2);
    match cli.command {
        #[cfg(feature = "local")]
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "local")]
        Command::LocalCluster(args) => local_cluster::run(args),
        #[cfg(feature = "local")]
        Command::FakeModelServer(args) => container::fake_model_server(args),
        #[cfg(feature = "local")]
        Command::Pause => container::pause(),
        #[cfg(feature = "local")]
        Command::Lane(args) => container::lane(args),
        Command::Run(args) => {
            args.logging.init();
            one_arena();
            let threads = args.threads.worker_threads;
            let runtime = build_with(
                tokio::runtime::Builder::new_multi_thread().on_thread_start(one_arena),
                threads,
            )?;
            runtime.block_on(operator::run(args))
        }
        Command::Route(args) => {
            args.logging.init();
            runtime()?.block_on(route::run(args))
        }
        Command::NodeAgent(args) => {
            args.logging.init();
            let threads = args.threads.worker_threads;
            build_with(&mut tokio::runtime::Builder::new_multi_thread(), threads)?
                .block_on(node_agent::run(args))
        }
        Command::Demand { target, command } => runtime()?.block_on(demand::demand(target, command)),
        Command::Status { target, residency } => {
            runtime()?.block_on(demand::status(target, residency))
        }
        Command::Simulate(args) => simulate::run(args),
        Command::Gpus(args) => runtime()?.block_on(gpus::run(args)),
        Command::Top(args) => runtime()?.block_on(top::run(args)),
        Command::Crd => {
            for (_, yaml) in model_residency::api::crd_files() {
                print!("{yaml}");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    /// The calling thread's jemalloc arena.
    #[allow(unsafe_code)] // a libc call std has no safe wrapper for
    fn arena() -> std::ffi::c_uint {
        let mut arena: std::ffi::c_uint = u32::MAX;
        let mut len = std::mem::size_of::<std::ffi::c_uint>();
        // SAFETY: reads a c_uint into `arena`, whose size `len` gives.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                c"thread.arena".as_ptr(),
                (&mut arena as *mut std::ffi::c_uint).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(rc, 0, "mallctl thread.arena");
        arena
    }

    #[test]
    fn operator_threads_share_the_first_arena() {
        let arenas: Vec<_> = (0..6)
            .map(|_| {
                std::thread::spawn(|| {
                    let before = arena();
                    super::one_arena();
                    (before, arena())
                })
            })
            .map(|t| t.join().unwrap())
            .collect();
        // Without the binding, threads spread over several arenas.
        assert!(arenas.iter().any(|(before, _)| *before != 0), "{arenas:?}");
        assert!(arenas.iter().all(|(_, after)| *after == 0), "{arenas:?}");
    }
}
