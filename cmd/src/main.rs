//! The cluster-api-provider-mailgun manager.
//!
//! **Placeholder.** Configuration, leader election, metrics and the reconcilers arrive with the
//! controllers + cmd issue; until then the binary refuses to run.

fn main() -> std::process::ExitCode {
    eprintln!(
        "cluster-api-provider-mailgun: the manager is not implemented yet \
         (see the controllers + cmd issue); nothing was started"
    );
    std::process::ExitCode::FAILURE
}
