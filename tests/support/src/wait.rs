//! Waiting for what a test cannot be told about: [`eventually`] and [`try_eventually`], the one
//! polling loop of every test crate.
//!
//! ```no_run
//! # async fn f(api: kube::Api<k8s_openapi::api::core::v1::ConfigMap>) {
//! use std::time::Duration;
//! use capm_test_support::wait::eventually;
//! // A check says yes with `true` or `Some(value)`; `Err` ends the wait at once.
//! let found = eventually(Duration::from_secs(30), "the ConfigMap", || async {
//!     api.get_opt("settings").await.map(|cm| cm.and_then(|cm| cm.data))
//! })
//! .await;
//! # let _ = found; }
//! ```

use std::{
    convert::Infallible,
    fmt::Display,
    future::Future,
    time::{Duration, Instant},
};

/// How often a check is asked again.
pub const POLL: Duration = Duration::from_millis(100);

/// What one look of a check found: a value (done), nothing yet, or an error that ends the wait.
pub trait Look {
    /// What the wait returns once done.
    type Value;
    /// An error that ends the wait.
    type Error: Display;
    /// `Ok(Some(_))`: done; `Ok(None)`: not yet.
    ///
    /// # Errors
    /// The check's own error: waiting longer would not help.
    fn look(self) -> Result<Option<Self::Value>, Self::Error>;
}

impl Look for bool {
    type Value = ();
    type Error = Infallible;
    fn look(self) -> Result<Option<()>, Infallible> {
        Ok(self.then_some(()))
    }
}

impl<T> Look for Option<T> {
    type Value = T;
    type Error = Infallible;
    fn look(self) -> Result<Option<T>, Infallible> {
        Ok(self)
    }
}

impl<E: Display> Look for Result<bool, E> {
    type Value = ();
    type Error = E;
    fn look(self) -> Result<Option<()>, E> {
        self.map(|done| done.then_some(()))
    }
}

impl<T, E: Display> Look for Result<Option<T>, E> {
    type Value = T;
    type Error = E;
    fn look(self) -> Result<Option<T>, E> {
        self
    }
}

/// Why a wait ended without its value.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The check never said yes.
    #[error("timed out after {within:?} waiting for {what}")]
    TimedOut {
        /// What was waited for.
        what: String,
        /// How long.
        within: Duration,
    },
    /// The check failed (a process died, the API refused).
    #[error("while waiting for {what}: {error}")]
    Failed {
        /// What was waited for.
        what: String,
        /// The check's error, with its causes.
        error: String,
    },
}

/// Asks `check` every [`POLL`] until it says yes, for at most `within`.
///
/// # Errors
/// [`WaitError::Failed`] as soon as `check` fails; [`WaitError::TimedOut`] past `within`.
pub async fn try_eventually<F, Fut>(
    within: Duration,
    what: &str,
    mut check: F,
) -> Result<<Fut::Output as Look>::Value, WaitError>
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Look,
{
    let deadline = Instant::now() + within;
    loop {
        match check().await.look() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => {
                return Err(WaitError::Failed {
                    what: what.to_owned(),
                    error: format!("{error:#}"),
                });
            }
        }
        if Instant::now() >= deadline {
            return Err(WaitError::TimedOut {
                what: what.to_owned(),
                within,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// [`try_eventually`] for a test: a timeout or a failed check fails the test.
///
/// # Panics
/// When [`try_eventually`] fails, with its reason.
pub async fn eventually<F, Fut>(
    within: Duration,
    what: &str,
    check: F,
) -> <Fut::Output as Look>::Value
where
    F: FnMut() -> Fut,
    Fut: Future,
    Fut::Output: Look,
{
    match try_eventually(within, what, check).await {
        Ok(value) => value,
        Err(e) => panic!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_check_that_says_yes_late_is_waited_for() {
        let mut looks = 0;
        let value = eventually(Duration::from_secs(5), "the third look", || {
            looks += 1;
            let n = looks;
            async move { (n == 3).then_some(n) }
        })
        .await;
        assert_eq!(value, 3);
    }

    #[tokio::test]
    async fn a_failed_check_ends_the_wait_at_once() {
        let started = Instant::now();
        let result = try_eventually(Duration::from_secs(30), "nothing", || async {
            Err::<bool, _>("refused")
        })
        .await;
        assert!(
            matches!(&result, Err(WaitError::Failed { error, .. }) if error == "refused"),
            "{result:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_check_that_never_says_yes_times_out_after_its_bound() {
        let started = Instant::now();
        let result = try_eventually(Duration::from_millis(300), "never", || async { false }).await;
        assert!(
            matches!(result, Err(WaitError::TimedOut { .. })),
            "{result:?}"
        );
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
    }
}
