//! The `ampgraph` command line: see `ampgraph --help` and docs/design.md §3.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    let cli = ampgraph::cli::Cli::parse();
    match ampgraph::cli::run(cli, &mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => ampgraph::cli::report_error(&e),
    }
}
