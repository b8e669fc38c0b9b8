//! Child processes of a local environment: where their binaries are, free loopback ports, log
//! files, and the reaper that removes everything when the owning process goes away.
//!
//! Every component is started with its output in `<state dir>/logs/<name>.log` and its PID
//! appended to `<state dir>/pids`. Cleanup is one shell script ([`CLEANUP_SCRIPT`]) used in two
//! ways: as a *reaper* child that waits for its stdin to close (the owning process stopped,
//! panicked or was killed, so the kernel closed the pipe) and then cleans up, and directly by
//! `capm-env down` for a detached environment. Either way every listed PID gets SIGTERM, then
//! SIGKILL after 5 s, and the state directory is removed.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, ExitStatus, Stdio},
};

use crate::Error;

/// Terminates every PID in `$1/pids` (TERM, then KILL after 5 s) and removes `$1`.
/// With `$2 = watch` it first waits for its standard input to reach end-of-file.
pub const CLEANUP_SCRIPT: &str = r#"
dir=$1
if [ "${2:-}" = watch ]; then while read -r _; do :; done; fi
pids=$(cat "$dir/pids" 2>/dev/null)
# A zombie (exited, not yet reaped by its parent) counts as gone.
alive() {
  for p in $pids; do
    s=$(awk '{sub(/.*\) /, ""); print $1}' "/proc/$p/stat" 2>/dev/null)
    [ -n "$s" ] && [ "$s" != Z ] && return 0
  done
  return 1
}
for p in $pids; do kill -TERM "$p" 2>/dev/null; done
i=0; while alive && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
for p in $pids; do kill -KILL "$p" 2>/dev/null; done
# A node's containers, mounts, bridge and iptables rule (see node.rs).
[ -f "$dir/teardown.sh" ] && bash "$dir/teardown.sh"
# Never into a mount that teardown could not remove.
rm -rf --one-file-system "$dir"
"#;

/// Where the Go tools live: `$CAPM_BIN_DIR`, or `bin/` at the repository root.
pub fn bin_dir() -> PathBuf {
    std::env::var_os("CAPM_BIN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bin"))
}

/// The path of a tool binary, or an error that says how to build it.
///
/// # Errors
/// [`Error::BinaryMissing`] when the file is not there or not executable.
pub fn binary(name: &str) -> Result<PathBuf, Error> {
    binary_in(&bin_dir(), name)
}

/// The path of binary `name` in `dir`, or an error that says how to build it.
///
/// # Errors
/// [`Error::BinaryMissing`] when the file is not there.
pub fn binary_in(dir: &Path, name: &str) -> Result<PathBuf, Error> {
    let path = dir.join(name);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => Ok(path),
        _ => Err(Error::BinaryMissing {
            name: name.to_owned(),
            path,
        }),
    }
}

/// A free TCP port on 127.0.0.1 (bound, then released; the component binds it right after).
///
/// # Errors
/// When no port can be bound.
pub fn free_port() -> Result<u16, Error> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(Error::io("binding a free port"))?;
    Ok(listener
        .local_addr()
        .map_err(Error::io("reading a bound port"))?
        .port())
}

/// Whether process `pid` is stopped (SIGSTOP): `/proc/<pid>/stat` shows state `T`.
pub fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// A size field of `/proc/<pid>/status` (`"VmHWM:"` the peak resident set, `"RssAnon:"` its
/// anonymous part), in bytes; `None` when the process or the field is not there.
pub fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// `RssAnon` of `pid` (in bytes) after its C allocator gave back the free memory it keeps:
/// `malloc_trim(0)` called in the process through `gdb` (Debian's `gdb`, installed by `make
/// deps`). glibc keeps freed chunks of its arenas resident for later allocations, so the
/// untrimmed figure of a process that allocated and freed the same amount twice differs by
/// megabytes from run to run (measured in the churn test: 5.2 or 8.0 MiB after equal rounds,
/// with 2.1-2.3 MB in use and 4.7-5.2 MiB after the trim); a leak stays resident after it.
///
/// # Errors
/// When `gdb` cannot be run or attached, or the call does not return.
pub fn trimmed_rss_anon(pid: u32) -> Result<u64, String> {
    let pid_text = pid.to_string();
    let out = Command::new("gdb")
        .args([
            "-nx",
            "-q",
            "-batch",
            "-p",
            &pid_text,
            "-ex",
            "print (int) malloc_trim(0)",
        ])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running gdb (make deps installs it): {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !stdout.lines().any(|l| l.starts_with("$1 = ")) {
        return Err(format!(
            "gdb could not call malloc_trim in process {pid}: {} / {}",
            stdout.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    status_bytes(pid, "RssAnon:").ok_or_else(|| format!("RssAnon of process {pid}"))
}

/// Checks that `port` on 127.0.0.1 can be bound.
///
/// # Errors
/// [`Error::PortInUse`] when it cannot.
pub fn check_port_free(port: u16) -> Result<(), Error> {
    TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
        .map(drop)
        .map_err(|source| Error::PortInUse { port, source })
}

/// The last `lines` lines of a file (empty when it cannot be read).
pub fn tail(path: &Path, lines: usize) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    let _ = file.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A running component: a child process whose output goes to a log file.
#[derive(Debug)]
pub struct Component {
    /// Short name (`etcd`, `kube-apiserver`, ...).
    pub name: String,
    /// Its log file.
    pub log: PathBuf,
    child: Child,
}

impl Component {
    /// Starts `cmd` as component `name` of the environment in `state_dir`.
    ///
    /// The child gets its own process group (a Ctrl-C meant for the caller does not reach it;
    /// the reaper stops it instead), no stdin, and `state_dir/logs/<name>.log` as output
    /// (appended to, so a restarted component keeps its earlier log).
    ///
    /// # Errors
    /// When the log file cannot be created or the binary cannot be executed.
    pub fn spawn(state_dir: &Path, name: &str, mut cmd: Command) -> Result<Self, Error> {
        let logs = state_dir.join("logs");
        std::fs::create_dir_all(&logs).map_err(Error::io("creating the log directory"))?;
        let log = logs.join(format!("{name}.log"));
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(Error::io("creating a log file"))?;
        let err = out.try_clone().map_err(Error::io("opening a log file"))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            name: name.to_owned(),
            source,
        })?;
        let mut pids = OpenOptions::new()
            .create(true)
            .append(true)
            .open(state_dir.join("pids"))
            .map_err(Error::io("recording a PID"))?;
        writeln!(pids, "{}", child.id()).map_err(Error::io("recording a PID"))?;
        Ok(Self {
            name: name.to_owned(),
            log,
            child,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// An error describing this component's death, with the end of its log.
    pub fn died(&mut self, status: Option<ExitStatus>) -> Error {
        Error::ComponentExited {
            name: self.name.clone(),
            status: status
                .map(|s| s.to_string())
                .unwrap_or_else(|| "unknown status".into()),
            log: self.log.clone(),
            log_tail: tail(&self.log, 25),
        }
    }

    /// Kills the process and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The reaper of an attached environment: cleans up `state_dir` when dropped or when this
/// process dies.
#[derive(Debug)]
pub struct Reaper {
    stdin: Option<ChildStdin>,
    child: Child,
}

impl Reaper {
    /// Starts the reaper for `state_dir`.
    ///
    /// # Errors
    /// When `bash` cannot be started.
    pub fn start(state_dir: &Path) -> Result<Self, Error> {
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(CLEANUP_SCRIPT)
            .arg("capm-reaper")
            .arg(state_dir)
            .arg("watch")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|source| Error::Spawn {
                name: "reaper (bash)".into(),
                source,
            })?;
        Ok(Self {
            stdin: child.stdin.take(),
            child,
        })
    }

    /// Closes the pipe and waits until the reaper has removed everything.
    pub fn finish(mut self) {
        self.stdin.take();
        let _ = self.child.wait();
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        // Closing stdin is the signal; without waiting, the reaper still finishes on its own.
        self.stdin.take();
    }
}

/// Cleans up a detached environment now (what the reaper does once its pipe closes).
///
/// # Errors
/// When `bash` cannot be run or the script fails.
pub fn cleanup_now(state_dir: &Path) -> Result<(), Error> {
    let status = Command::new("bash")
        .arg("-c")
        .arg(CLEANUP_SCRIPT)
        .arg("capm-cleanup")
        .arg(state_dir)
        .status()
        .map_err(Error::io("running the cleanup script"))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Cleanup {
            dir: state_dir.to_owned(),
            status: status.to_string(),
        })
    }
}
