//! Starting the servers as child processes on free loopback ports, talking to them, reading back
//! what they received, and stopping them on drop.
//!
//! Each child gets a pipe as standard input and exits when it closes, so even a test process
//! killed with SIGKILL leaves no server behind; `Drop` also kills and reaps it.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{Mutex, mpsc},
    time::Duration,
};

use crate::{
    contract::{DelayRule, FailureRule, StoredMessage},
    hostile_smtp::{RelayMode, RelayStats},
    pki::{PkiError, TestPki},
};

/// How long a server may take to print its address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a server could not be started or queried.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A local I/O operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The server did not come up; `log` is the end of its standard error.
    #[error("{name} did not start: {reason}\n--- its stderr ---\n{log}")]
    Startup {
        /// Which server.
        name: &'static str,
        /// What went wrong.
        reason: String,
        /// The end of its standard error.
        log: String,
    },
    /// Building a server binary (the contract server, the hostile relay) with cargo failed.
    #[error("building a server binary failed: {0}")]
    Build(String),
    /// A control request or command got an unexpected answer.
    #[error("{what}: unexpected answer: {answer}")]
    Control {
        /// The request or command.
        what: String,
        /// What came back.
        answer: String,
    },
    /// Test certificates could not be made.
    #[error(transparent)]
    Pki(#[from] PkiError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// A running child process with a stdin pipe and a line-oriented stdout.
struct ChildServer {
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    addr: SocketAddr,
}

impl std::fmt::Debug for ChildServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildServer")
            .field("name", &self.name)
            .field("pid", &self.child.id())
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

impl ChildServer {
    /// Starts `cmd`, whose first stdout line must be its bound `127.0.0.1:<port>`.
    fn spawn(name: &'static str, mut cmd: Command, stderr_log: &Path) -> Result<Self, Error> {
        let log = std::fs::File::create(stderr_log).map_err(io("creating a log file"))?;
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(log);
        let mut child = cmd
            .spawn()
            .map_err(io(format!("starting {name} ({cmd:?})")))?;
        let stdin = child.stdin.take();
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            return Err(Error::Startup {
                name,
                reason: "no stdout pipe".into(),
                log: String::new(),
            });
        };
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            let result = reader.read_line(&mut line).map(|_| line);
            let _ = tx.send((reader, result));
        });
        let fail = |child: &mut Child, reason: String| {
            let _ = child.kill();
            let _ = child.wait();
            Error::Startup {
                name,
                reason,
                log: tail(stderr_log),
            }
        };
        let (stdout, line) = match rx.recv_timeout(STARTUP_TIMEOUT) {
            Ok((reader, Ok(line))) => (reader, line),
            Ok((_, Err(e))) => return Err(fail(&mut child, format!("reading its stdout: {e}"))),
            Err(_) => {
                return Err(fail(
                    &mut child,
                    format!("no address after {STARTUP_TIMEOUT:?}"),
                ));
            }
        };
        let addr = match line.trim().parse::<SocketAddr>() {
            Ok(addr) => addr,
            Err(_) => {
                return Err(fail(
                    &mut child,
                    format!("expected its address on stdout, got {line:?}"),
                ));
            }
        };
        Ok(Self {
            name,
            child,
            stdin,
            stdout,
            addr,
        })
    }

    /// Sends one command line and reads the one-line answer.
    fn command(&mut self, line: &str) -> Result<String, Error> {
        let what = format!("{} command {line:?}", self.name);
        let stdin = self.stdin.as_mut().ok_or_else(|| Error::Control {
            what: what.clone(),
            answer: "stdin closed".into(),
        })?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .map_err(io(what.clone()))?;
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).map_err(io(what))?;
        Ok(answer.trim().to_owned())
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.1 request for the control endpoints: `(status, body)`.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, String), Error> {
    let what = format!("{method} {path}");
    let mut stream = TcpStream::connect(addr).map_err(io(what.clone()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io(what.clone()))?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(io(what.clone()))?;
    let mut reply = String::new();
    stream
        .read_to_string(&mut reply)
        .map_err(io(what.clone()))?;
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| Error::Control {
            what: what.clone(),
            answer: reply.chars().take(200).collect(),
        })?;
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// Where `mailgun-contract-server` is: `$CAPM_MAILGUN_SERVER_BIN`, or built on first use with
/// `cargo build` into the target directory of the running executable (same profile).
///
/// # Errors
/// [`Error::Build`] when cargo fails.
pub fn contract_server_binary() -> Result<PathBuf, Error> {
    server_binary("mailgun-contract-server", "CAPM_MAILGUN_SERVER_BIN")
}

/// Where `hostile-smtp-relay` is: `$CAPM_HOSTILE_SMTP_RELAY_BIN`, or built on first use with
/// `cargo build` into the target directory of the running executable (same profile).
///
/// # Errors
/// [`Error::Build`] when cargo fails.
pub fn hostile_smtp_relay_binary() -> Result<PathBuf, Error> {
    server_binary("hostile-smtp-relay", "CAPM_HOSTILE_SMTP_RELAY_BIN")
}

/// Where this crate's binary `name` is: `$<env>`, or built once per process with `cargo build`
/// into the target directory of the running executable (same profile).
fn server_binary(name: &'static str, env: &str) -> Result<PathBuf, Error> {
    static BUILT: Mutex<BTreeMap<&'static str, PathBuf>> = Mutex::new(BTreeMap::new());
    if let Some(path) = std::env::var_os(env) {
        return Ok(PathBuf::from(path));
    }
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = built.get(name) {
        return Ok(path.clone());
    }
    let exe = std::env::current_exe().map_err(io("finding the current executable"))?;
    // <target>/<profile>/deps/<test> or <target>/<profile>/examples/<example>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| Error::Build(format!("cannot place {}", exe.display())))?;
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| Error::Build(format!("cannot place {}", exe.display())))?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = Command::new(cargo)
        .current_dir(&workspace)
        .env("CARGO_TARGET_DIR", target_dir)
        .args(["build", "--quiet", "-p", "capm-mail-servers", "--bin", name])
        .args(["--profile", profile])
        .output()
        .map_err(io("running cargo build"))?;
    if !output.status.success() {
        return Err(Error::Build(format!(
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    let path = profile_dir.join(name);
    built.insert(name, path.clone());
    Ok(path)
}

/// A running `mailgun-contract-server`.
///
/// # Example
/// ```no_run
/// use capm_mail_servers::{FailureMode, FailureRule, FailureTarget, MailgunServer};
///
/// let server = MailgunServer::start("key-test", "mg.example.test")?;
/// println!("POST {}/v3/mg.example.test/messages", server.base_url());
/// server.set_failure(FailureRule {
///     mode: FailureMode::RateLimited,
///     count: Some(1),
///     retry_after: Some(3),
///     target: FailureTarget::Messages,
///     body_bytes: None,
///     drip_ms: None,
/// })?;
/// assert!(server.messages()?.is_empty());
/// # Ok::<(), capm_mail_servers::Error>(())
/// ```
#[derive(Debug)]
pub struct MailgunServer {
    server: ChildServer,
    api_key: String,
    domain: String,
    _dir: tempfile::TempDir,
}

/// The domain sending key a server started with `api_key` accepts beside it.
fn sending_key(api_key: &str) -> String {
    format!("{api_key}-sending")
}

/// The read-only key a server started with `api_key` accepts beside it.
fn read_key(api_key: &str) -> String {
    format!("{api_key}-read")
}

impl MailgunServer {
    /// Starts the server on a free loopback port, expecting `api_key` (or the scoped keys
    /// [`Self::sending_key`] and [`Self::read_key`]) and `domain`.
    ///
    /// # Errors
    /// [`Error`] when the binary cannot be built or started.
    pub fn start(api_key: &str, domain: &str) -> Result<Self, Error> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into(), api_key, domain)
    }

    /// Starts the server on a free port of `ip` (an address of this host: e.g. the bridge of
    /// a local node, so Pods reach it).
    ///
    /// # Errors
    /// [`Error`] when the binary cannot be built or started.
    pub fn start_on(ip: std::net::IpAddr, api_key: &str, domain: &str) -> Result<Self, Error> {
        let dir = tempfile::tempdir().map_err(io("creating a temporary directory"))?;
        let mut cmd = Command::new(contract_server_binary()?);
        cmd.args(["--listen", &format!("{ip}:0"), "--domain", domain])
            .env("MAILGUN_CONTRACT_API_KEY", api_key)
            .env("MAILGUN_CONTRACT_SENDING_KEY", sending_key(api_key))
            .env("MAILGUN_CONTRACT_READ_KEY", read_key(api_key));
        let server = ChildServer::spawn(
            "mailgun-contract-server",
            cmd,
            &dir.path().join("stderr.log"),
        )?;
        Ok(Self {
            server,
            api_key: api_key.to_owned(),
            domain: domain.to_owned(),
            _dir: dir,
        })
    }

    /// `http://127.0.0.1:<port>`: the `baseUrl` for a Mailgun backend.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.server.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// The server process's id (e.g. to read its memory in `/proc/<pid>/status`).
    pub fn pid(&self) -> u32 {
        self.server.child.id()
    }

    /// The API key it expects.
    pub fn api_key(&self) -> &str {
        &self.api_key
    }

    /// A domain sending key it also accepts: it may only send, for [`Self::domain`].
    pub fn sending_key(&self) -> String {
        sending_key(&self.api_key)
    }

    /// A read-only key it also accepts (Mailgun's `Analyst` role): events and Logs only.
    pub fn read_key(&self) -> String {
        read_key(&self.api_key)
    }

    /// The domain it serves.
    pub fn domain(&self) -> &str {
        &self.domain
    }

    fn control(&self, method: &str, path: &str, body: Option<&str>) -> Result<String, Error> {
        let (status, reply) = http(self.server.addr, method, path, body)?;
        if !(200..300).contains(&status) {
            return Err(Error::Control {
                what: format!("{method} {path}"),
                answer: format!("{status} {reply}"),
            });
        }
        Ok(reply)
    }

    /// Injects a failure.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn set_failure(&self, rule: FailureRule) -> Result<(), Error> {
        let body = serde_json::to_string(&rule).map_err(|e| Error::Control {
            what: "encoding the failure rule".into(),
            answer: e.to_string(),
        })?;
        self.control("PUT", "/_control/failure", Some(&body))
            .map(drop)
    }

    /// Stops injecting failures.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn clear_failure(&self) -> Result<(), Error> {
        self.control("DELETE", "/_control/failure", None).map(drop)
    }

    /// Records what became of an accepted message (delivered, failed temporarily or for good).
    ///
    /// # Errors
    /// [`Error`] when the control request fails (for example: no such message).
    pub fn add_event(&self, rule: &crate::EventRule) -> Result<(), Error> {
        let body = serde_json::to_string(rule).map_err(|e| Error::Control {
            what: "encoding the event rule".into(),
            answer: e.to_string(),
        })?;
        self.control("PUT", "/_control/events", Some(&body))
            .map(drop)
    }

    /// Serves the events API in pages of at most `page_size` items.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn set_page_size(&self, page_size: usize) -> Result<(), Error> {
        let body = serde_json::to_string(&crate::PagingRule { page_size }).map_err(|e| {
            Error::Control {
                what: "encoding the paging rule".into(),
                answer: e.to_string(),
            }
        })?;
        self.control("PUT", "/_control/paging", Some(&body))
            .map(drop)
    }

    /// The server's request counts.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn stats(&self) -> Result<crate::Stats, Error> {
        let body = self.control("GET", "/_control/stats", None)?;
        serde_json::from_str(&body).map_err(|e| Error::Control {
            what: "GET /_control/stats".into(),
            answer: format!("{e}: {body}"),
        })
    }

    /// Answers the next `count` message posts (every one when `None`) `delay` late, then
    /// normally: a slow server, not a failing one.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn set_delay(&self, delay: Duration, count: Option<u32>) -> Result<(), Error> {
        let rule = DelayRule {
            delay_ms: u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            count,
        };
        let body = serde_json::to_string(&rule).map_err(|e| Error::Control {
            what: "encoding the delay rule".into(),
            answer: e.to_string(),
        })?;
        self.control("PUT", "/_control/delay", Some(&body))
            .map(drop)
    }

    /// Answers at once again.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn clear_delay(&self) -> Result<(), Error> {
        self.control("DELETE", "/_control/delay", None).map(drop)
    }

    /// Every message accepted so far, oldest first.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn messages(&self) -> Result<Vec<StoredMessage>, Error> {
        let body = self.control("GET", "/_control/messages", None)?;
        serde_json::from_str(&body).map_err(|e| Error::Control {
            what: "GET /_control/messages".into(),
            answer: format!("{e}: {body}"),
        })
    }

    /// Forgets every accepted message.
    ///
    /// # Errors
    /// [`Error`] when the control request fails.
    pub fn clear_messages(&self) -> Result<(), Error> {
        self.control("DELETE", "/_control/messages", None).map(drop)
    }
}

/// How the SMTP server uses TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SmtpTls {
    /// Plain text only.
    #[default]
    None,
    /// STARTTLS offered, not required.
    Starttls,
    /// STARTTLS required before MAIL.
    StarttlsRequired,
    /// TLS from the first byte (smtps).
    Implicit,
}

/// Options for [`SmtpServer::start`].
#[derive(Debug, Clone, Default)]
pub struct SmtpOptions {
    /// TLS mode; any mode but `None` generates a CA and server certificate.
    pub tls: SmtpTls,
    /// Require AUTH PLAIN/LOGIN with this `(user, password)`.
    pub auth: Option<(String, String)>,
}

/// A message the SMTP server received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedMail {
    /// The raw message as received (after the SMTP dot-unstuffing).
    pub raw: String,
    /// Header fields in order, names as sent, values unfolded and trimmed.
    pub headers: Vec<(String, String)>,
    /// Everything after the blank line.
    pub body: String,
    /// The envelope sender.
    pub mail_from: String,
    /// The envelope recipients.
    pub rcpt_tos: Vec<String>,
    /// The authenticated user, if any.
    pub auth_user: Option<String>,
    /// Whether the session was encrypted (implicit TLS or STARTTLS).
    pub tls: bool,
}

impl ReceivedMail {
    /// Parses a raw message and its envelope metadata.
    fn parse(raw: String, meta: &serde_json::Value) -> Self {
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .or_else(|| raw.split_once("\n\n"))
            .unwrap_or((raw.as_str(), ""));
        let mut headers: Vec<(String, String)> = Vec::new();
        for line in head.lines() {
            if line.starts_with([' ', '\t']) {
                if let Some((_, value)) = headers.last_mut() {
                    value.push(' ');
                    value.push_str(line.trim());
                }
            } else if let Some((name, value)) = line.split_once(':') {
                headers.push((name.to_owned(), value.trim().to_owned()));
            }
        }
        let str_field = |k: &str| meta.get(k).and_then(|v| v.as_str()).map(str::to_owned);
        Self {
            body: body.to_owned(),
            headers,
            mail_from: str_field("mail_from").unwrap_or_default(),
            rcpt_tos: meta
                .get("rcpt_tos")
                .and_then(|v| v.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            auth_user: str_field("auth_user"),
            tls: meta.get("tls").and_then(|v| v.as_bool()).unwrap_or(false),
            raw,
        }
    }

    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers_named(name).into_iter().next()
    }

    /// Every value of header `name` (case-insensitive), in order.
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Header names and their counts, for "exactly one of each" assertions.
    pub fn header_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for (name, _) in &self.headers {
            *counts.entry(name.to_ascii_lowercase()).or_insert(0) += 1;
        }
        counts
    }
}

/// A running SMTP test server (`smtp_server.py` on aiosmtpd).
///
/// # Example
/// ```no_run
/// use capm_mail_servers::{SmtpOptions, SmtpServer, SmtpTls};
///
/// let mut server = SmtpServer::start(SmtpOptions { tls: SmtpTls::Implicit, auth: None })?;
/// println!("{} trusting {:?}", server.url(), server.ca_cert());
/// server.fail_next(451, 1)?;
/// # Ok::<(), capm_mail_servers::Error>(())
/// ```
#[derive(Debug)]
pub struct SmtpServer {
    server: ChildServer,
    options: SmtpOptions,
    pki: Option<TestPki>,
    dir: tempfile::TempDir,
}

impl SmtpServer {
    /// The script, next to this crate's manifest.
    pub fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("smtp_server.py")
    }

    /// Starts the server on a free loopback port. The interpreter is `$CAPM_PYTHON` or
    /// `python3`; it needs `aiosmtpd` (see `requirements.txt`).
    ///
    /// # Errors
    /// [`Error`] when certificates cannot be made or the server does not start.
    pub fn start(options: SmtpOptions) -> Result<Self, Error> {
        let dir = tempfile::tempdir().map_err(io("creating a temporary directory"))?;
        let python = std::env::var_os("CAPM_PYTHON").unwrap_or_else(|| "python3".into());
        let mut cmd = Command::new(python);
        cmd.arg(Self::script())
            .arg("--dir")
            .arg(dir.path().join("messages"));
        let mode = match options.tls {
            SmtpTls::None => "none",
            SmtpTls::Starttls => "starttls",
            SmtpTls::StarttlsRequired => "starttls-required",
            SmtpTls::Implicit => "implicit",
        };
        cmd.args(["--tls", mode]);
        let pki = if options.tls == SmtpTls::None {
            None
        } else {
            let pki = TestPki::generate(dir.path())?;
            cmd.arg("--cert")
                .arg(&pki.server_cert)
                .arg("--key")
                .arg(&pki.server_key);
            Some(pki)
        };
        if let Some((user, password)) = &options.auth {
            cmd.args(["--auth-user", user])
                .env("SMTP_TEST_PASSWORD", password);
        }
        let server = ChildServer::spawn("smtp_server.py", cmd, &dir.path().join("stderr.log"))?;
        Ok(Self {
            server,
            options,
            pki,
            dir,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// `smtps://127.0.0.1:<port>` for implicit TLS, else `smtp://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        let scheme = if self.options.tls == SmtpTls::Implicit {
            "smtps"
        } else {
            "smtp"
        };
        format!("{scheme}://{}", self.server.addr)
    }

    /// The CA certificate (PEM file) clients must trust, when TLS is on.
    pub fn ca_cert(&self) -> Option<&Path> {
        self.pki.as_ref().map(|p| p.ca_cert.as_path())
    }

    /// Answers `code` (e.g. 451 or 550) to the DATA of the next `count` messages.
    ///
    /// # Errors
    /// [`Error`] when the server does not acknowledge.
    pub fn fail_next(&mut self, code: u16, count: u32) -> Result<(), Error> {
        self.expect_ok(&format!("fail {code} {count}"))
    }

    /// Stores the next `count` messages and then never answers their DATA (the client cannot
    /// tell whether they were accepted; they were). The sessions stay open until the client
    /// gives up.
    ///
    /// # Errors
    /// [`Error`] when the server does not acknowledge.
    pub fn hang_after_data(&mut self, count: u32) -> Result<(), Error> {
        self.expect_ok(&format!("hang {count}"))
    }

    /// Accepts the next `count` connections and never greets them (nothing can be sent on
    /// them).
    ///
    /// # Errors
    /// [`Error`] when the server does not acknowledge.
    pub fn no_greeting(&mut self, count: u32) -> Result<(), Error> {
        self.expect_ok(&format!("nogreet {count}"))
    }

    /// Answers the DATA of the next `count` messages `delay` late (then stores them and answers
    /// 250 as usual).
    ///
    /// # Errors
    /// [`Error`] when the server does not acknowledge.
    pub fn slow_data(&mut self, delay: Duration, count: u32) -> Result<(), Error> {
        self.expect_ok(&format!("slow {} {count}", delay.as_millis()))
    }

    /// Stops failing, hanging, delaying and ignoring connections (sessions already hanging or
    /// never greeted stay so until the client gives up).
    ///
    /// # Errors
    /// [`Error`] when the server does not acknowledge.
    pub fn reset(&mut self) -> Result<(), Error> {
        self.expect_ok("reset")
    }

    fn expect_ok(&mut self, line: &str) -> Result<(), Error> {
        match self.server.command(line)? {
            answer if answer == "ok" => Ok(()),
            answer => Err(Error::Control {
                what: line.to_owned(),
                answer,
            }),
        }
    }

    /// Every message received so far, oldest first.
    ///
    /// # Errors
    /// [`Error`] when the message directory cannot be read.
    pub fn messages(&self) -> Result<Vec<ReceivedMail>, Error> {
        let dir = self.dir.path().join("messages");
        let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
            .map_err(io(format!("reading {}", dir.display())))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "eml"))
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|eml| {
                let raw = std::fs::read(&eml).map_err(io(format!("reading {}", eml.display())))?;
                let meta_path = eml.with_extension("json");
                let meta = std::fs::read(&meta_path)
                    .map_err(io(format!("reading {}", meta_path.display())))?;
                let meta = serde_json::from_slice(&meta).unwrap_or(serde_json::Value::Null);
                Ok(ReceivedMail::parse(
                    String::from_utf8_lossy(&raw).into_owned(),
                    &meta,
                ))
            })
            .collect()
    }
}

/// A running `hostile-smtp-relay` in front of a real SMTP server: see
/// [`crate::hostile_smtp`] and [`RelayMode`] for what each mode does on the wire.
///
/// # Example
/// ```no_run
/// use capm_mail_servers::{HostileSmtpRelay, RelayMode, SmtpOptions, SmtpServer};
///
/// let server = SmtpServer::start(SmtpOptions::default())?;
/// let relay = HostileSmtpRelay::start(server.addr())?;
/// println!("send through {} (starttls: never)", relay.url());
/// relay.set_mode(RelayMode::EndlessGreeting)?;
/// // ... the client must give up on its own ...
/// relay.set_mode(RelayMode::Pass)?;
/// # Ok::<(), capm_mail_servers::Error>(())
/// ```
#[derive(Debug)]
pub struct HostileSmtpRelay {
    server: Mutex<ChildServer>,
    addr: SocketAddr,
    pid: u32,
    upstream: SocketAddr,
    _dir: tempfile::TempDir,
}

impl HostileSmtpRelay {
    /// Starts the relay on a free loopback port, in [`RelayMode::Pass`] to `upstream`.
    ///
    /// # Errors
    /// [`Error`] when the binary cannot be built or started.
    pub fn start(upstream: SocketAddr) -> Result<Self, Error> {
        let dir = tempfile::tempdir().map_err(io("creating a temporary directory"))?;
        let mut cmd = Command::new(hostile_smtp_relay_binary()?);
        cmd.args([
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            &upstream.to_string(),
        ]);
        let server = ChildServer::spawn("hostile-smtp-relay", cmd, &dir.path().join("stderr.log"))?;
        Ok(Self {
            addr: server.addr,
            pid: server.child.id(),
            server: Mutex::new(server),
            upstream,
            _dir: dir,
        })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `smtp://127.0.0.1:<port>` (plain SMTP: `starttls: never`).
    pub fn url(&self) -> String {
        format!("smtp://{}", self.addr)
    }

    /// The real server `Pass` mode forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// The relay process's id (e.g. to read its memory in `/proc/<pid>/status`).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn command(&self, line: &str) -> Result<String, Error> {
        self.server
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .command(line)
    }

    fn expect_ok(&self, line: &str) -> Result<(), Error> {
        match self.command(line)? {
            answer if answer == "ok" => Ok(()),
            answer => Err(Error::Control {
                what: line.to_owned(),
                answer,
            }),
        }
    }

    /// Plays `mode` on every connection accepted from now on (a hostile mode also closes the
    /// connections passing through).
    ///
    /// # Errors
    /// [`Error`] when the relay does not acknowledge.
    pub fn set_mode(&self, mode: RelayMode) -> Result<(), Error> {
        self.expect_ok(&format!("mode {}", mode.name()))
    }

    /// The time between two bytes of [`RelayMode::Drip`] for connections accepted from now on
    /// (default 1 s; whole milliseconds).
    ///
    /// # Errors
    /// [`Error`] when the relay does not acknowledge.
    pub fn set_drip(&self, every: Duration) -> Result<(), Error> {
        self.expect_ok(&format!("drip {}", every.as_millis()))
    }

    /// What the relay has seen so far.
    ///
    /// # Errors
    /// [`Error`] when the relay does not answer with its counts.
    pub fn stats(&self) -> Result<RelayStats, Error> {
        let answer = self.command("stats")?;
        serde_json::from_str(&answer).map_err(|e| Error::Control {
            what: "stats".into(),
            answer: format!("{e}: {answer}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_folded_headers() {
        let raw = "Subject: a\r\n b\r\nX-Tag: 1\r\nx-tag: 2\r\n\r\nbody\r\n".to_owned();
        let meta = serde_json::json!({"mail_from": "a@b", "rcpt_tos": ["c@d"], "tls": true});
        let m = ReceivedMail::parse(raw, &meta);
        assert_eq!(m.header("subject"), Some("a b"));
        assert_eq!(m.headers_named("X-TAG"), vec!["1", "2"]);
        assert_eq!(m.header_counts()["x-tag"], 2);
        assert_eq!(m.body, "body\r\n");
        assert_eq!(m.rcpt_tos, vec!["c@d"]);
        assert!(m.tls);
        assert_eq!(m.auth_user, None);
    }
}
