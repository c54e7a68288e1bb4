//! The `ampgraph` command line: see `ampgraph --help` and docs/design.md §3.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    ampgraph::cli::main_with(|| {
        ampgraph::cli::run(ampgraph::cli::Cli::parse(), &mut std::io::stdout().lock())
    })
}
