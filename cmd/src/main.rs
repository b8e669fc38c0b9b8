//! The cluster-api-provider-mailgun manager: configuration, logging, leader election, the
//! metrics / probe / conversion-webhook endpoints, and the `capm_controllers` reconcilers.
//!
//! What it is for: turning flags, environment variables and an optional config file into a
//! running process, and stopping it cleanly. What it is not for: reconciling (that is
//! `capm_controllers`) or sending mail (`capm_mailer`).
//!
//! Exit status: 0 after SIGTERM/SIGINT and a clean shutdown; 1 for invalid configuration, a
//! fatal error or a lost leader Lease; 2 for unparsable command lines (clap).

mod app;
mod client_metrics;
mod fulfil;
mod lease_elector;
mod logging;
mod manager;
mod metrics_auth;
mod reconcilers;
mod reload;
mod server;
mod settings;
mod tls;

use std::{process::ExitCode, time::Duration};

use clap::CommandFactory;

use settings::{Args, Settings, SettingsError, process_env};

const NAME: &str = "cluster-api-provider-mailgun";

fn main() -> ExitCode {
    let argv: Vec<_> = std::env::args_os().collect();
    let settings = match Settings::resolve(Args::command(), &argv, &process_env) {
        Ok(settings) => settings,
        // --help, --version, unknown flags: clap prints them and exits as it always did.
        Err(SettingsError::Usage(e)) => e.exit(),
        Err(e) => {
            eprintln!("{NAME}: invalid configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    logging::init(&settings);
    // One thread: reconciles wait on the API server and the mail backend (about 1 ms of CPU per
    // object in `make bench`), so more workers buy nothing and each costs a stack and a malloc
    // arena. The scheduler that runs tasks on the thread that drives the runtime is also the
    // only one that does not pull libm into the process (tokio's work-stealing scheduler uses
    // `powf`): half a MiB of resident set less while idle.
    let mut builder = tokio::runtime::Builder::new_current_thread();
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("{NAME}: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(app::run(settings));
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{NAME}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
