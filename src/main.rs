//! The `model-residency` binary: one entry point, a subcommand per job.

mod cli;

use clap::Parser;
use std::process::ExitCode;

// jemalloc rather than glibc's malloc: the operator's cache is many small
// allocations replaced as objects change, and glibc keeps more of the holes
// between them (docs/performance.md, Memory).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(cli::Failure { message, code }) => {
            eprintln!("error: {message}");
            ExitCode::from(code)
        }
    }
}
