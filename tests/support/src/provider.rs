//! The provider binary as every test crate runs it: [`Launch`] builds its command line (a clean
//! environment, the kubeconfig, metrics and probes on free loopback ports if asked), [`Provider`]
//! is the running process (its output in a log file, killed when dropped).
//!
//! What a test adds (the mail backend, leader election, flags under test) stays in the test.
//!
//! ```no_run
//! # fn f(kubeconfig: &std::path::Path, dir: &std::path::Path) -> Result<(), capm_test_support::Error> {
//! use capm_test_support::provider::Launch;
//! let (launch, ports) =
//!     Launch::new("target/debug/cluster-api-provider-mailgun", kubeconfig).on_free_ports()?;
//! let provider = launch
//!     .env("MAIL_RECIPIENT", "ops@example.com")
//!     .args(["--leader-elect=false"])
//!     .spawn(&dir.join("provider.log"))?;
//! println!("pid {}, metrics on {}", provider.pid(), ports.metrics);
//! # Ok(()) }
//! ```

use std::{
    ffi::OsString,
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use crate::{
    Error,
    process::{free_port, tail},
};

/// The loopback addresses [`Launch::on_free_ports`] chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ports {
    /// `--metrics-bind-address`.
    pub metrics: SocketAddr,
    /// `--health-probe-bind-address`.
    pub probes: SocketAddr,
}

/// How one provider process is started.
#[derive(Debug)]
pub struct Launch {
    program: OsString,
    /// Arguments before the provider's own (a wrapper such as `prlimit`, then the binary).
    prefix: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    /// Start from this process's environment rather than an empty one.
    inherit_env: bool,
    removed: Vec<OsString>,
    args: Vec<OsString>,
}

impl Launch {
    /// `binary` with an empty environment (see [`Self::inherit_env`]) and
    /// `--kubeconfig kubeconfig`.
    pub fn new(binary: impl Into<OsString>, kubeconfig: &Path) -> Self {
        Self {
            program: binary.into(),
            prefix: Vec::new(),
            env: Vec::new(),
            inherit_env: false,
            removed: Vec::new(),
            args: Vec::new(),
        }
        .arg("--kubeconfig")
        .arg(kubeconfig)
    }

    /// Metrics and probes on free loopback ports.
    ///
    /// # Errors
    /// When no free port can be had.
    pub fn on_free_ports(self) -> Result<(Self, Ports), Error> {
        let ports = Ports {
            metrics: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)),
            probes: SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)),
        };
        let launch = self
            .arg("--metrics-bind-address")
            .arg(ports.metrics.to_string())
            .arg("--health-probe-bind-address")
            .arg(ports.probes.to_string());
        Ok((launch, ports))
    }

    /// Runs the binary under `wrapper` (for example `prlimit --nofile=64:64 --`).
    #[must_use]
    pub fn under<I, S>(mut self, wrapper: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        let mut wrapper = wrapper.into_iter().map(Into::into);
        if let Some(program) = wrapper.next() {
            let binary = std::mem::replace(&mut self.program, program);
            self.prefix = wrapper.chain(std::iter::once(binary)).collect();
        }
        self
    }

    /// One environment variable.
    #[must_use]
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Starts from this process's environment (as a Pod gets its image's and the chart's),
    /// less what [`Self::env_remove`] names.
    #[must_use]
    pub fn inherit_env(mut self) -> Self {
        self.inherit_env = true;
        self
    }

    /// Leaves `key` out of an inherited environment.
    #[must_use]
    pub fn env_remove(mut self, key: impl Into<OsString>) -> Self {
        self.removed.push(key.into());
        self
    }

    /// One argument.
    #[must_use]
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Arguments.
    #[must_use]
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The command, for a harness that runs processes its own way.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        if !self.inherit_env {
            cmd.env_clear();
        }
        for key in &self.removed {
            cmd.env_remove(key);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .args(&self.prefix)
            .args(&self.args)
            .stdin(Stdio::null());
        cmd
    }

    /// Starts it, standard output and error appended to `log`.
    ///
    /// # Errors
    /// When the log cannot be created or the process cannot start.
    pub fn spawn(self, log: &Path) -> Result<Provider, Error> {
        let out = File::create(log).map_err(Error::io("creating the provider's log"))?;
        let err = out
            .try_clone()
            .map_err(Error::io("creating the provider's log"))?;
        let child = self
            .command()
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| Error::Spawn {
                name: "the provider".into(),
                source,
            })?;
        Ok(Provider {
            child,
            log: log.to_owned(),
        })
    }
}

/// One running provider process; killed when dropped.
#[derive(Debug)]
pub struct Provider {
    child: Child,
    log: PathBuf,
}

impl Provider {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines it logged.
    pub fn tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// Its exit status, once it has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends it SIGTERM.
    ///
    /// # Errors
    /// When `kill` cannot be run or refuses.
    pub fn terminate(&self) -> Result<(), Error> {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .map_err(Error::io("running kill"))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Io {
                context: "kill -TERM",
                source: std::io::Error::other(status.to_string()),
            })
        }
    }

    /// Waits at most `within` for it to end on its own; `None` when it still runs.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills it (if it still runs) and waits for it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.kill();
    }
}
