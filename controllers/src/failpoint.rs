//! Crash and freeze injection for the exactly-once tests (`CAPM_FAILPOINT`,
//! `CAPM_FAILPOINT_FILE`: docs/testing.md, "Failpoints"). Compiled in only with the `failpoints`
//! cargo feature, which only the tests enable: a release build has no way to make library code
//! abort.

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
    hit_file(step);
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
        stop(&format!("CAPM_FAILPOINT={armed}"));
    }
}

/// Freezes the process when the armed file names this step (see the module documentation).
#[cfg(feature = "failpoints")]
fn hit_file(step: &str) {
    use std::sync::OnceLock;
    static FILE: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    let Some(path) = FILE.get_or_init(|| std::env::var_os("CAPM_FAILPOINT_FILE").map(Into::into))
    else {
        return;
    };
    let Ok(armed) = std::fs::read_to_string(path) else {
        return;
    };
    if armed.trim().strip_suffix(":stop") == Some(step) && std::fs::remove_file(path).is_ok() {
        stop(&format!("CAPM_FAILPOINT_FILE {}", armed.trim()));
    }
}

#[cfg(feature = "failpoints")]
fn stop(what: &str) {
    eprintln!("{what}: freezing on purpose (SIGSTOP)");
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &std::process::id().to_string()])
        .status();
    if !stopped.is_ok_and(|s| s.success()) {
        eprintln!("{what}: could not stop; aborting instead");
        std::process::abort();
    }
}
