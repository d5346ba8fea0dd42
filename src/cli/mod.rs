//! Command-line surface: argument definitions and dispatch.

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
    /// Print the ModelResidency CustomResourceDefinition as YAML
    /// (`model-residency crd | kubectl apply -f -`).
    Crd,
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
}

pub fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::Crd => {
            print!("{}", model_residency::api::crd_yaml());
            Ok(())
        }
    }
}
