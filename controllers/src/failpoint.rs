//! Crash and freeze injection for the exactly-once tests.
//!
//! `CAPM_FAILPOINT=<name>` makes the process abort when it reaches the step of that name
//! (`after-intent`: intent recorded, mail not sent; `after-send`: mail accepted, not recorded).
//! `CAPM_FAILPOINT=<name>:stop` freezes it there instead, once (SIGSTOP to itself, as an
//! operator's `kill -STOP` or a stalled node would): the test resumes it with SIGCONT.
//! Compiled in only with the `failpoints` cargo feature, which only the tests enable: a release
//! build has no way to make library code abort.

/// Does nothing: failpoints are compiled out (`failpoints` feature off).
#[cfg(not(feature = "failpoints"))]
#[inline]
pub fn hit(_step: &str) {}

/// Aborts (or freezes) the process if `CAPM_FAILPOINT` names this step.
#[cfg(feature = "failpoints")]
pub fn hit(step: &str) {
    use std::sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    };
    static ARMED: OnceLock<Option<String>> = OnceLock::new();
    static STOPPED: AtomicBool = AtomicBool::new(false);
    let armed = ARMED.get_or_init(|| {
        std::env::var("CAPM_FAILPOINT")
            .ok()
            .filter(|s| !s.is_empty())
    });
    let Some(armed) = armed.as_deref() else {
        return;
    };
    if armed == step {
        eprintln!("CAPM_FAILPOINT={step}: aborting on purpose");
        std::process::abort();
    }
    if armed.strip_suffix(":stop") == Some(step) && !STOPPED.swap(true, Ordering::SeqCst) {
        eprintln!("CAPM_FAILPOINT={armed}: freezing on purpose (SIGSTOP)");
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &std::process::id().to_string()])
            .status();
        if !stopped.is_ok_and(|s| s.success()) {
            eprintln!("CAPM_FAILPOINT={armed}: could not stop; aborting instead");
            std::process::abort();
        }
    }
}
