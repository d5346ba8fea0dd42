//! Command-line surface: argument definitions and dispatch.

mod demand;
#[cfg(feature = "local")]
mod demo;
#[cfg(feature = "local")]
mod local_cluster;
mod node_agent;
mod operator;
mod route;
mod simulate;

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

pub fn run(cli: Cli) -> Result<(), Failure> {
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Failure {
                message: format!("cannot start the async runtime: {e}"),
                code: 1,
            })
    };
    match cli.command {
        #[cfg(feature = "local")]
        Command::Demo(args) => demo::run(args),
        #[cfg(feature = "local")]
        Command::LocalCluster(args) => local_cluster::run(args),
        Command::Run(args) => {
            args.logging.init();
            runtime()?.block_on(operator::run(args))
        }
        Command::Route(args) => {
            args.logging.init();
            runtime()?.block_on(route::run(args))
        }
        Command::NodeAgent(args) => {
            args.logging.init();
            runtime()?.block_on(node_agent::run(args))
        }
        Command::Demand { target, command } => runtime()?.block_on(demand::demand(target, command)),
        Command::Status { target, residency } => {
            runtime()?.block_on(demand::status(target, residency))
        }
        Command::Simulate(args) => simulate::run(args),
        Command::Crd => {
            for (_, yaml) in model_residency::api::crd_files() {
                print!("{yaml}");
            }
            Ok(())
        }
    }
}
