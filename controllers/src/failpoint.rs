//! Crash injection for the exactly-once tests.
//!
//! `CAPM_FAILPOINT=<name>` makes the process abort when it reaches the step of that name
//! (`after-intent`: intent recorded, mail not sent; `after-send`: mail accepted, not recorded).
//! Only tests set it; the Helm chart never does.

use std::sync::OnceLock;

/// Aborts the process if `CAPM_FAILPOINT` names this step.
pub fn hit(step: &str) {
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        std::env::var("CAPM_FAILPOINT")
            .ok()
            .filter(|s| !s.is_empty())
    });
    if armed.as_deref() == Some(step) {
        eprintln!("CAPM_FAILPOINT={step}: aborting on purpose");
        std::process::abort();
    }
}
