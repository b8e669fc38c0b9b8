//! Each setting's precedence and every error message, pinned.
#![allow(clippy::unwrap_used)]

use std::{ffi::OsString, path::Path, time::Duration};

use capm_mailer::{MailerConfig, MailgunRegion, SecretSource};
use clap::Command;

use super::{
    endpoints::DEFAULT_WEBHOOK_CERT_DIR,
    mailer::{MAILGUN_API_KEY_ENV, SMTP_PASSWORD_ENV},
    values::parse_duration,
    *,
};

/// Flags only: clap's environment fallbacks are turned off, so the tests do not depend on
/// the variables of whoever runs them.
fn flags_only() -> Command {
    use clap::CommandFactory;
    let mut command = Args::command();
    let ids: Vec<_> = command
        .get_arguments()
        .map(|a| a.get_id().clone())
        .collect();
    for id in ids {
        command = command.mut_arg(id, |a| a.env(None::<&str>));
    }
    command
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn with_key(name: &str) -> Option<String> {
    (name == MAILGUN_API_KEY_ENV).then(|| "key-topsecret".to_owned())
}

const MAILGUN: &[&str] = &[
    "--mailgun-domain",
    "mg.example.com",
    "--mail-recipient",
    "ops@example.com",
];

fn resolve(
    flags: &[&str],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Settings, SettingsError> {
    let argv: Vec<OsString> = std::iter::once("capm")
        .chain(flags.iter().copied())
        .map(Into::into)
        .collect();
    Settings::resolve(flags_only(), &argv, env)
}

impl Settings {
    /// The settings of `--mode all`.
    fn manager(&self) -> &Manager {
        match &self.role {
            Role::All(manager) => manager,
            Role::FulfilmentPage(page) => panic!("not --mode all: {page:?}"),
        }
    }

    fn into_manager(self) -> Manager {
        self.manager().clone()
    }

    fn page_only(self) -> PageOnly {
        match self.role {
            Role::FulfilmentPage(page) => page,
            Role::All(manager) => panic!("not --mode fulfilment-page: {manager:?}"),
        }
    }
}

fn error(flags: &[&str], env: &dyn Fn(&str) -> Option<String>) -> String {
    resolve(flags, env).unwrap_err().to_string()
}

fn file(content: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), content).unwrap();
    f
}

#[test]
fn fulfilment_needs_a_url_and_keys_together() {
    let flags = |extra: &[&'static str]| [MAILGUN, extra].concat();
    assert_eq!(
        resolve(MAILGUN, &with_key)
            .unwrap()
            .into_manager()
            .fulfilment,
        None
    );
    let on = resolve(
        &flags(&[
            "--fulfilment-url",
            "https://capm.example.com/",
            "--fulfilment-keys-file",
            "/keys",
        ]),
        &with_key,
    )
    .unwrap()
    .into_manager()
    .fulfilment
    .unwrap();
    assert_eq!(on.url, "https://capm.example.com");
    assert!(on.secure);
    assert_eq!(on.bind, Some("0.0.0.0:8090".parse().unwrap()));
    assert_eq!(on.validity, Duration::from_secs(30 * 24 * 3600));
    assert!(on.trusted_proxies.is_empty());
    assert_eq!(
        error(&flags(&["--fulfilment-url", "https://x"]), &with_key),
        "--fulfilment-keys-file (FULFILMENT_KEYS_FILE): is required with --fulfilment-url (FULFILMENT_URL)"
    );
    assert_eq!(
        error(&flags(&["--fulfilment-keys-file", "/k"]), &with_key),
        "--fulfilment-keys-file (FULFILMENT_KEYS_FILE): is used only with --fulfilment-url (FULFILMENT_URL)"
    );
    for bad in [
        "capm.example.com",
        "ftp://x",
        "https://x/?a=b",
        "https://x/capm",
        "https:///p",
        "https://x/#f",
        "http://capm.example.com",
        "http://10.0.0.1:8090",
        "https://user:secret@capm.example.com",
    ] {
        let e = error(
            &flags(&["--fulfilment-url", bad, "--fulfilment-keys-file", "/k"]),
            &with_key,
        );
        assert!(
            e.starts_with("--fulfilment-url (FULFILMENT_URL): "),
            "{bad}: {e}"
        );
    }
}

#[test]
fn the_fulfilment_url_is_normalised_https_and_without_userinfo() {
    let flags = |url: &'static str, extra: &[&'static str]| {
        [
            MAILGUN,
            &["--fulfilment-url", url, "--fulfilment-keys-file", "/k"],
            extra,
        ]
        .concat()
    };
    let url = |u: &'static str| {
        resolve(&flags(u, &[]), &with_key)
            .map(|s| s.into_manager().fulfilment.unwrap().url)
            .map_err(|e| e.to_string())
    };
    // As a browser sends it in `Origin`.
    assert_eq!(
        url("HTTPS://Capm.Example.com:443").unwrap(),
        "https://capm.example.com"
    );
    assert_eq!(
        url("https://capm.example.com:8443/").unwrap(),
        "https://capm.example.com:8443"
    );
    for loopback in [
        "http://127.0.0.1:8090",
        "http://localhost:1",
        "http://[::1]:2",
    ] {
        assert!(url(loopback).is_ok(), "{loopback}");
    }
    let e = url("http://capm.example.com").unwrap_err();
    assert!(e.contains("must be https"), "{e}");
    let e = url("https://capm:hunter2@capm.example.com").unwrap_err();
    assert!(
        e.contains("user name or password") && !e.contains("hunter2"),
        "{e}"
    );
    let validity = |v: &'static str| {
        resolve(
            &flags("https://x", &["--fulfilment-link-validity", v]),
            &with_key,
        )
        .map(|s| s.into_manager().fulfilment.unwrap().validity)
        .map_err(|e| e.to_string())
    };
    assert_eq!(
        validity("2160h").unwrap(),
        Duration::from_secs(90 * 24 * 3600)
    );
    assert_eq!(
        validity("2161h").unwrap_err(),
        "--fulfilment-link-validity (FULFILMENT_LINK_VALIDITY): 2161h is above the cap of \
         2160h (90 days): a link is a bearer credential"
    );
}

#[test]
fn trusted_proxies_replace_trusting_every_forwarded_for() {
    let base = [
        MAILGUN,
        &[
            "--fulfilment-url",
            "https://x",
            "--fulfilment-keys-file",
            "/k",
        ],
    ]
    .concat();
    let on = resolve(
        &[
            &base[..],
            &[
                "--fulfilment-trusted-proxies",
                "10.0.0.0/8, 192.168.1.7,fd00::1/8",
            ],
        ]
        .concat(),
        &with_key,
    )
    .unwrap()
    .into_manager()
    .fulfilment
    .unwrap();
    let shown: Vec<String> = on.trusted_proxies.iter().map(ToString::to_string).collect();
    assert_eq!(shown, ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8"]);
    assert_eq!(
        error(
            &[&base[..], &["--fulfilment-trusted-proxies", "10.0.0.0/33"]].concat(),
            &with_key
        ),
        "--fulfilment-trusted-proxies (FULFILMENT_TRUSTED_PROXIES): \"10.0.0.0/33\" is not a \
         CIDR (10.0.0.0/8, fd00::/8) or an address"
    );
    assert_eq!(
        error(
            &[&base[..], &["--fulfilment-trust-forwarded-for"]].concat(),
            &with_key
        ),
        "--fulfilment-trust-forwarded-for (FULFILMENT_TRUST_FORWARDED_FOR): was replaced by \
         --fulfilment-trusted-proxies (FULFILMENT_TRUSTED_PROXIES): list the proxies in front \
         of the page (CIDRs); X-Forwarded-For is then read only from them, right to left past \
         them"
    );
    let off = [&base[..], &["--fulfilment-trust-forwarded-for=false"]].concat();
    assert!(resolve(&off, &with_key).is_ok());
}

#[test]
fn walkthrough_variables_alone_give_the_mailgun_defaults() {
    let s = resolve(MAILGUN, &with_key).unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!("{:?}", s.manager().mailer)
    };
    assert_eq!(m.domain, "mg.example.com");
    assert_eq!(m.api_key, SecretSource::Env("MAILGUN_API_KEY".into()));
    assert_eq!(m.region, MailgunRegion::Us);
    assert_eq!(s.manager().controllers.recipients, ["ops@example.com"]);
    assert_eq!(s.manager().controllers.message_id_domain, "mg.example.com");
    // From: on the sending domain by default (DMARC), not the requester.
    assert_eq!(
        s.manager().controllers.mail_from,
        "cluster-api-provider-mailgun@mg.example.com"
    );
    assert_eq!(s.manager().controllers.concurrency, 10);
    assert_eq!(
        s.diagnostics,
        Some(Diagnostics {
            bind: "0.0.0.0:8443".parse().unwrap(),
            security: DiagnosticsSecurity::Secure { cert_dir: None },
        })
    );
    assert!(s.deprecations.is_empty());
    assert_eq!(s.probe_address, Some("127.0.0.1:8081".parse().unwrap()));
    let le = s.manager().leader_election.as_ref().unwrap();
    assert_eq!(le.name, "cluster-api-provider-mailgun-leader");
    assert_eq!(
        (le.lease_duration, le.renew_deadline, le.retry_period),
        (
            Duration::from_secs(15),
            Duration::from_secs(10),
            Duration::from_secs(2)
        )
    );
    let hook = s.manager().webhook.as_ref().unwrap();
    assert_eq!(hook.bind.port(), 9443);
    assert_eq!(hook.cert_dir, Path::new(DEFAULT_WEBHOOK_CERT_DIR));
    assert_eq!(s.shutdown_timeout, Duration::from_secs(30));
    assert_eq!(s.log_format, LogFormat::Text);
    assert!(!format!("{s:?}").contains("topsecret"));
}

#[test]
fn the_example_config_files_in_config_manager_are_valid() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/manager");
    let load = |name: &str| {
        let path = dir.join(name);
        resolve(&["--config", path.to_str().unwrap()], &no_env)
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let s = load("mailgun.yaml");
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!("{:?}", s.manager().mailer)
    };
    assert_eq!(m.domain, "mg.example.com");
    assert_eq!(
        m.api_key,
        SecretSource::File("/etc/capm/mailgun/api-key".into())
    );
    assert_eq!(
        m.read_api_key,
        Some(SecretSource::File("/etc/capm/mailgun-read/read-key".into()))
    );
    assert_eq!(
        s.diagnostics,
        Some(Diagnostics {
            bind: "0.0.0.0:8443".parse().unwrap(),
            security: DiagnosticsSecurity::Secure {
                cert_dir: Some("/etc/capm/diagnostics".into())
            },
        })
    );
    let s = load("smtp.yaml");
    let MailerConfig::Smtp(c) = &s.manager().mailer else {
        panic!("{:?}", s.manager().mailer)
    };
    assert_eq!(c.url, "smtp://smtp.example.com:587");
    assert_eq!(c.username.as_deref(), Some("capm"));
    assert_eq!(s.manager().controllers.recipients.len(), 2);
}

#[test]
fn flags_override_the_file_which_overrides_defaults() {
    let f = file(
        r#"
mailer:
  mailgun: {domain: file.example.com, region: eu, apiKey: {file: /run/key}, testMode: true}
mailRecipients: [file@example.com]
concurrency: 3
diagnosticsAddress: "0"
leaderElect: false
webhookPort: 0
logFormat: json
shutdownTimeout: 5s
"#,
    );
    let path = f.path().to_str().unwrap();
    let s = resolve(&["--config", path], &no_env).unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!()
    };
    assert_eq!(
        (m.domain.as_str(), m.region, m.test_mode),
        ("file.example.com", MailgunRegion::Eu, true)
    );
    assert_eq!(m.api_key, SecretSource::File("/run/key".into()));
    assert_eq!(s.manager().controllers.recipients, ["file@example.com"]);
    assert_eq!(s.manager().controllers.concurrency, 3);
    assert_eq!(s.diagnostics, None);
    assert!(s.manager().leader_election.is_none());
    assert!(s.manager().webhook.is_none());
    assert_eq!(s.log_format, LogFormat::Json);
    assert_eq!(s.shutdown_timeout, Duration::from_secs(5));

    // Flags win; the environment's API key beats the file's key source; file-only keys stay.
    let s = resolve(
        &[
            "--config",
            path,
            "--mailgun-domain",
            "flag.example.com",
            "--mail-recipient",
            "a@example.com,b@example.com",
            "--concurrency",
            "7",
            "--leader-elect",
            "--diagnostics-address",
            ":9090",
            "--insecure-diagnostics",
            "--mailgun-region",
            "us",
        ],
        &with_key,
    )
    .unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!()
    };
    assert_eq!(
        (m.domain.as_str(), m.region, m.test_mode),
        ("flag.example.com", MailgunRegion::Us, true)
    );
    assert_eq!(m.api_key, SecretSource::Env("MAILGUN_API_KEY".into()));
    assert_eq!(
        s.manager().controllers.recipients,
        ["a@example.com", "b@example.com"]
    );
    assert_eq!(s.manager().controllers.concurrency, 7);
    assert_eq!(
        s.diagnostics,
        Some(Diagnostics {
            bind: "0.0.0.0:9090".parse().unwrap(),
            security: DiagnosticsSecurity::Insecure,
        })
    );
    assert!(s.manager().leader_election.is_some());
    let s = resolve(
        &["--config", path, "--mailgun-api-key-file", "/k"],
        &with_key,
    )
    .unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!()
    };
    assert_eq!(
        m.api_key,
        SecretSource::File("/k".into()),
        "the file flag beats the variable"
    );
}

#[test]
fn smtp_from_flags_and_json_file() {
    let s = resolve(
        &[
            "--smtp-url",
            "smtps://relay.example.com",
            "--smtp-username",
            "capm",
            "--smtp-password-file",
            "/run/pw",
            "--mail-recipient",
            "ops@example.com",
            "--mail-from",
            "capm@relay.example.com",
        ],
        &no_env,
    )
    .unwrap();
    assert_eq!(s.manager().controllers.mail_from, "capm@relay.example.com");
    let MailerConfig::Smtp(c) = &s.manager().mailer else {
        panic!()
    };
    assert_eq!(c.password, Some(SecretSource::File("/run/pw".into())));
    assert_eq!(
        s.manager().controllers.message_id_domain,
        "relay.example.com"
    );
    let f = file(
        r#"{"mailer": {"smtp": {"url": "smtp://relay.example.com:2525", "pool": {"enabled": false}}}, "mailRecipients": ["x@example.com"], "mailFrom": "capm@capm.example.com", "messageIdDomain": "capm.example.com"}"#,
    );
    let s = resolve(&["--config", f.path().to_str().unwrap()], &|n| {
        (n == SMTP_PASSWORD_ENV).then(|| "pw".to_owned())
    });
    // A password without a user name is refused, naming the user-name flag.
    assert_eq!(
        s.unwrap_err().to_string(),
        "--smtp-username (SMTP_USERNAME): required with password"
    );
    let s = resolve(&["--config", f.path().to_str().unwrap()], &no_env).unwrap();
    let MailerConfig::Smtp(c) = &s.manager().mailer else {
        panic!()
    };
    assert!(!c.pool.enabled);
    assert_eq!(
        s.manager().controllers.message_id_domain,
        "capm.example.com"
    );
}

#[test]
fn leader_election_namespace_precedence() {
    let pod = |n: &str| match n {
        "POD_NAMESPACE" => Some("capm-system".to_owned()),
        _ => with_key(n),
    };
    let s = resolve(MAILGUN, &pod).unwrap();
    assert_eq!(
        s.into_manager().leader_election.unwrap().namespace,
        "capm-system"
    );
    let mut flags = MAILGUN.to_vec();
    flags.extend([
        "--leader-election-namespace",
        "other",
        "--leader-election-id",
        "my.lease",
    ]);
    let le = resolve(&flags, &pod)
        .unwrap()
        .into_manager()
        .leader_election
        .unwrap();
    assert_eq!(
        (le.namespace.as_str(), le.name.as_str()),
        ("other", "my.lease")
    );
    let mut flags = MAILGUN.to_vec();
    flags.push("--leader-elect=false");
    assert!(
        resolve(&flags, &pod)
            .unwrap()
            .into_manager()
            .leader_election
            .is_none()
    );
}

#[test]
fn every_invalid_field_is_named() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--mail-recipient", "ops@example.com"],
            "--mail-backend (MAIL_BACKEND): no mail backend configured",
        ),
        (
            &[
                "--mail-backend",
                "mailgun",
                "--mail-recipient",
                "ops@example.com",
            ],
            "--mailgun-domain (MAILGUN_DOMAIN): required",
        ),
        (
            &[
                "--mail-backend",
                "smtp",
                "--mail-recipient",
                "ops@example.com",
            ],
            "--smtp-url (SMTP_URL): required",
        ),
        (
            &["--mailgun-domain", "mg.example.com"],
            "--mail-recipient (MAIL_RECIPIENT): at least one recipient",
        ),
        (
            &[
                "--mailgun-domain",
                "mg.example.com",
                "--mail-recipient",
                "x",
            ],
            "--mail-recipient (MAIL_RECIPIENT): \"x\" is not an e-mail address",
        ),
        (
            &[
                "--mailgun-domain",
                "mg.example.com",
                "--mail-recipient",
                "a@example.com,",
            ],
            "--mail-recipient (MAIL_RECIPIENT): \"\" is not an e-mail address",
        ),
        (
            &[
                "--mailgun-domain",
                "bad domain",
                "--mail-recipient",
                "a@example.com",
            ],
            "--mailgun-domain (MAILGUN_DOMAIN): must be a DNS name",
        ),
        (
            &["--mailgun-base-url", "ftp://x"],
            "--mailgun-base-url (MAILGUN_BASE_URL): scheme",
        ),
        (
            &["--smtp-url", "http://x", "--mail-backend", "smtp"],
            "--smtp-url (SMTP_URL): scheme must be smtp or smtps",
        ),
        (
            &[
                "--smtp-url",
                "smtp://relay.example.com",
                "--mail-backend",
                "smtp",
            ],
            "--mail-from (MAIL_FROM): required for the SMTP backend",
        ),
        (
            &[
                "--smtp-url",
                "smtp://[::1]:25",
                "--mail-backend",
                "smtp",
                "--mail-from",
                "capm@example.com",
            ],
            "--message-id-domain (MESSAGE_ID_DOMAIN): required",
        ),
        (
            &[
                "--mail-from",
                "not an address",
                "--mailgun-domain",
                "mg.example.com",
            ],
            "--mail-from (MAIL_FROM): \"not an address\" is not an e-mail address",
        ),
        (
            &["--message-id-domain", "a b"],
            "--message-id-domain (MESSAGE_ID_DOMAIN): \"a b\" is not a domain",
        ),
        (
            &["--namespace", "Capi"],
            "--namespace (WATCH_NAMESPACE): \"Capi\" is not a namespace name",
        ),
        (
            &["--watch-filter=-x"],
            "--watch-filter (WATCH_FILTER): \"-x\" is not a label value",
        ),
        (
            &["--concurrency", "0"],
            "--concurrency (CONCURRENCY): must be at least 1",
        ),
        (
            &["--metrics-bind-address", "localhost"],
            "--metrics-bind-address (METRICS_BIND_ADDRESS): \"localhost\" is not host:port",
        ),
        (
            &["--diagnostics-address", "localhost"],
            "--diagnostics-address (DIAGNOSTICS_ADDRESS): \"localhost\" is not host:port",
        ),
        (
            &[
                "--diagnostics-address",
                ":1",
                "--metrics-bind-address",
                ":2",
            ],
            "--metrics-bind-address (METRICS_BIND_ADDRESS): deprecated and replaced by --diagnostics-address",
        ),
        (
            &[
                "--metrics-bind-address",
                ":2",
                "--insecure-diagnostics=false",
            ],
            "--metrics-bind-address (METRICS_BIND_ADDRESS): serves plain HTTP",
        ),
        (
            &["--insecure-diagnostics", "--diagnostics-cert-dir", "/d"],
            "--diagnostics-cert-dir (DIAGNOSTICS_CERT_DIR): /d is only used over HTTPS",
        ),
        (
            &["--health-probe-bind-address", ":x"],
            "--health-probe-bind-address (HEALTH_PROBE_BIND_ADDRESS): \":x\" is not host:port",
        ),
        (
            &["--leader-election-namespace", "a_b"],
            "--leader-election-namespace (LEADER_ELECTION_NAMESPACE): \"a_b\" is not a namespace name",
        ),
        (
            &["--leader-election-id", "A"],
            "--leader-election-id (LEADER_ELECTION_ID): \"A\" is not an object name",
        ),
        (
            &["--log-level", "info,[="],
            "--log-level (RUST_LOG): \"info,[=\"",
        ),
        (
            &["--shutdown-timeout", "soon"],
            "--shutdown-timeout (SHUTDOWN_TIMEOUT): \"soon\" is not a duration",
        ),
    ];
    for (extra, expected) in cases {
        let mut flags: Vec<&str> = Vec::new();
        if !extra.iter().any(|f| f.starts_with("--mail")) && !extra.contains(&"--smtp-url") {
            flags.extend(MAILGUN);
        } else if !extra.contains(&"--mail-recipient") && !extra.contains(&"--mailgun-domain") {
            flags.extend(["--mail-recipient", "ops@example.com"]);
        }
        if extra.contains(&"--mailgun-base-url") {
            flags.extend(["--mailgun-domain", "mg.example.com"]);
        }
        flags.extend(extra.iter());
        let err = error(&flags, &with_key);
        assert!(
            err.starts_with(expected),
            "{flags:?}:\n  got      {err}\n  expected {expected}"
        );
    }
    assert_eq!(
        error(MAILGUN, &no_env),
        "--mailgun-api-key-file (MAILGUN_API_KEY_FILE, or MAILGUN_API_KEY): the Mailgun API key is required"
    );
}

#[test]
fn config_file_errors_name_the_file_and_key() {
    let err = error(&["--config", "/nonexistent/capm.yaml"], &no_env);
    assert!(
        err.starts_with("--config (CAPM_CONFIG): /nonexistent/capm.yaml: "),
        "{err}"
    );
    let f = file("mailer: {sendgrid: {}}\n");
    let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
    assert!(err.contains("unknown variant `sendgrid`"), "{err}");
    let f = file("concurency: 3\n");
    let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
    assert!(err.contains("unknown field `concurency`"), "{err}");
    let f = file(
        "mailer: {smtp: {url: 'smtp://h', timeoutSeconds: 0}}\nmailRecipients: [a@example.com]\n",
    );
    let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
    assert!(
        err.starts_with("--config (CAPM_CONFIG): mailer.smtp.timeoutSeconds"),
        "{err}"
    );
}

#[test]
fn timings_come_from_flags_the_file_or_the_defaults() {
    let s = resolve(MAILGUN, &with_key).unwrap();
    let c = &s.manager().controllers;
    assert_eq!(
        (c.backoff_base, c.backoff_max, c.lookup_grace),
        (
            Duration::from_millis(500),
            Duration::from_secs(300),
            Duration::from_secs(10)
        )
    );
    assert_eq!(
        (
            c.delivery_poll_base,
            c.delivery_poll_max,
            c.delivery_retention
        ),
        (
            Duration::from_secs(30),
            Duration::from_secs(1800),
            Duration::from_secs(72 * 3600)
        )
    );
    let f = file("mailgunEventsRetention: 24h\ndeliveryPollMax: 10m\n");
    let mut flags = MAILGUN.to_vec();
    flags.extend(["--config", f.path().to_str().unwrap()]);
    flags.push("--delivery-poll-base=1m");
    let c = resolve(&flags, &with_key)
        .unwrap()
        .into_manager()
        .controllers;
    assert_eq!(
        (
            c.delivery_poll_base,
            c.delivery_poll_max,
            c.delivery_retention
        ),
        (
            Duration::from_secs(60),
            Duration::from_secs(600),
            Duration::from_secs(24 * 3600)
        )
    );
    let f = file("backoffBase: 1s\nbackoffMax: 1m\nlookupGrace: 30s\nleaderElectRetryPeriod: 3s\n");
    let mut flags = MAILGUN.to_vec();
    flags.extend(["--config", f.path().to_str().unwrap(), "--backoff-max=2m"]);
    flags.extend([
        "--leader-elect-lease-duration=1m",
        "--leader-elect-renew-deadline=40s",
    ]);
    let s = resolve(&flags, &with_key).unwrap();
    let c = &s.manager().controllers;
    assert_eq!(
        (c.backoff_base, c.backoff_max, c.lookup_grace),
        (
            Duration::from_secs(1),
            Duration::from_secs(120),
            Duration::from_secs(30)
        )
    );
    let le = s.manager().leader_election.clone().unwrap();
    assert_eq!(
        (le.lease_duration, le.renew_deadline, le.retry_period),
        (
            Duration::from_secs(60),
            Duration::from_secs(40),
            Duration::from_secs(3)
        )
    );

    let cases: &[(&[&str], &str)] = &[
        (
            &["--backoff-base=0s"],
            "--backoff-base (BACKOFF_BASE): must be positive",
        ),
        (
            &["--backoff-base=10m"],
            "--backoff-base (BACKOFF_BASE): must not be longer than --backoff-max (BACKOFF_MAX)",
        ),
        (
            &["--backoff-max=soon"],
            "--backoff-max (BACKOFF_MAX): \"soon\" is not a duration",
        ),
        (
            &["--lookup-grace=0"],
            "--lookup-grace (LOOKUP_GRACE): must be positive",
        ),
        (
            &["--delivery-poll-base=0"],
            "--delivery-poll-base (DELIVERY_POLL_BASE): must be positive",
        ),
        (
            &["--delivery-poll-base=1h", "--delivery-poll-max=10m"],
            "--delivery-poll-base (DELIVERY_POLL_BASE): must be positive and not longer than \
             --delivery-poll-max (DELIVERY_POLL_MAX)",
        ),
        (
            &["--mailgun-events-retention=0"],
            "--mailgun-events-retention (MAILGUN_EVENTS_RETENTION): must be positive",
        ),
        (
            &["--leader-elect-renew-deadline=15s"],
            "--leader-elect-renew-deadline (LEADER_ELECT_RENEW_DEADLINE): must be shorter than \
             --leader-elect-lease-duration (LEADER_ELECT_LEASE_DURATION)",
        ),
        (
            &["--leader-elect-retry-period=10s"],
            "--leader-elect-retry-period (LEADER_ELECT_RETRY_PERIOD): must be positive and \
             shorter than --leader-elect-renew-deadline (LEADER_ELECT_RENEW_DEADLINE)",
        ),
        (
            &["--leader-elect-lease-duration=-5s"],
            "--leader-elect-lease-duration (LEADER_ELECT_LEASE_DURATION): \"-5s\" is not",
        ),
    ];
    for (extra, expected) in cases {
        let mut flags = MAILGUN.to_vec();
        flags.extend(extra.iter());
        let err = error(&flags, &with_key);
        assert!(
            err.starts_with(expected),
            "{flags:?}:\n  got      {err}\n  expected {expected}"
        );
    }
    let f = file("lookupGrace: soon\n");
    let mut flags = MAILGUN.to_vec();
    flags.extend(["--config", f.path().to_str().unwrap()]);
    let err = error(&flags, &with_key);
    assert!(
        err.starts_with("--config (CAPM_CONFIG): ") && err.contains("--lookup-grace"),
        "{err}"
    );
}

#[test]
fn durations() {
    assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
    assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
    assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
    assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
    assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
    assert_eq!(parse_duration("x"), None);
    assert_eq!(parse_duration("5d"), None);
    assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
    assert_eq!(parse_duration("-1s"), None);
    // A default shown from a library's constant reads back as that constant.
    for d in [
        Duration::from_secs(24 * 3600),
        Duration::from_secs(30 * 24 * 3600),
        Duration::from_secs(90),
        Duration::from_millis(500),
        Duration::from_millis(1500),
    ] {
        assert_eq!(parse_duration(&values::duration_text(d)), Some(d), "{d:?}");
    }
    assert_eq!(values::duration_text(Duration::from_secs(24 * 3600)), "24h");
    assert_eq!(values::duration_text(Duration::from_secs(90)), "1m 30s");
}

#[test]
fn the_libraries_defaults_are_the_flags_defaults() {
    let flags = [
        MAILGUN,
        &[
            "--fulfilment-url",
            "https://capm.example.com",
            "--fulfilment-keys-file",
            "/keys",
        ],
    ]
    .concat();
    let settings = resolve(&flags, &with_key).unwrap();
    let tenancy = &settings.manager().controllers.tenancy;
    assert_eq!(
        tenancy.release_timeout,
        capm_controllers::DEFAULT_RELEASE_TIMEOUT
    );
    assert_eq!(
        tenancy.hosts.mailgun,
        capm_mailer::AllowedHosts::default_mailgun()
    );
    assert_eq!(
        settings.into_manager().fulfilment.unwrap().validity,
        capm_api::link_token::DEFAULT_VALIDITY
    );
}

#[test]
fn every_boolean_flag_is_a_switch() {
    use clap::CommandFactory;
    let command = Args::command();
    let switches: Vec<_> = command
        .get_arguments()
        .filter(|a| a.get_value_names() == Some(&["BOOL".into()][..]))
        .map(|a| a.get_id().to_string())
        .collect();
    assert_eq!(
        switches,
        [
            "require_identity_ref",
            "insecure_diagnostics",
            "leader_elect",
            "fulfilment_trust_forwarded_for"
        ]
    );
    for id in &switches {
        let flag = format!("--{}", id.replace('_', "-"));
        for (given, value) in [
            (flag.clone(), true),
            (format!("{flag}=false"), false),
            (format!("{flag}=no"), false),
            (format!("{flag}=on"), true),
        ] {
            let argv = ["capm", &given];
            let matches = flags_only().try_get_matches_from(argv).unwrap();
            assert_eq!(matches.get_one::<bool>(id), Some(&value), "{given}");
        }
        let argv = ["capm", &format!("{flag}=maybe")];
        assert!(flags_only().try_get_matches_from(argv).is_err(), "{flag}");
    }
}

#[test]
fn the_mailgun_events_api_is_logs_unless_a_flag_variable_or_file_says_events() {
    use capm_mailer::MailgunEventsApi;
    let api = |s: &Settings| match &s.manager().mailer {
        MailerConfig::Mailgun(m) => m.events_api,
        MailerConfig::Smtp(_) => panic!("not mailgun"),
    };
    assert_eq!(
        api(&resolve(MAILGUN, &with_key).unwrap()),
        MailgunEventsApi::Logs
    );
    let flags = [MAILGUN, &["--mailgun-events-api", "events"]].concat();
    assert_eq!(
        api(&resolve(&flags, &with_key).unwrap()),
        MailgunEventsApi::Events
    );
    // The file sets it as a flag default or in the mailer section; the flag wins.
    let f = file("mailgunEventsApi: events\n");
    let path = f.path().to_str().unwrap();
    let flags = [MAILGUN, &["--config", path]].concat();
    assert_eq!(
        api(&resolve(&flags, &with_key).unwrap()),
        MailgunEventsApi::Events
    );
    let flags = [MAILGUN, &["--config", path, "--mailgun-events-api=logs"]].concat();
    assert_eq!(
        api(&resolve(&flags, &with_key).unwrap()),
        MailgunEventsApi::Logs
    );
    let f = file(
        "mailer:\n  mailgun: {domain: mg.example.com, apiKey: {env: MAILGUN_API_KEY}, eventsApi: events}\nmailRecipients: [a@example.com]\n",
    );
    let s = resolve(&["--config", f.path().to_str().unwrap()], &with_key).unwrap();
    assert_eq!(api(&s), MailgunEventsApi::Events);
    // A bad value stops start-up naming the field.
    let flags = [MAILGUN, &["--mailgun-events-api", "webhooks"]].concat();
    let err = error(&flags, &with_key);
    assert!(err.contains("--mailgun-events-api"), "{err}");
    let f = file("mailgunEventsApi: webhooks\n");
    let flags = [MAILGUN, &["--config", f.path().to_str().unwrap()]].concat();
    let err = error(&flags, &with_key);
    assert!(
        err.starts_with("--config (CAPM_CONFIG): ") && err.contains("--mailgun-events-api"),
        "{err}"
    );
}

#[test]
fn a_read_key_file_is_the_mailgun_read_key_and_a_bad_one_names_the_flag() {
    let s = resolve(MAILGUN, &with_key).unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!("{:?}", s.manager().mailer)
    };
    assert_eq!(m.read_api_key, None, "reads use the API key by default");
    let key = file("key-topsecret");
    let key_path = key.path().to_str().unwrap();
    let flags = [
        MAILGUN,
        &[
            "--mailgun-api-key-file",
            key_path,
            "--mailgun-read-key-file",
            "/nonexistent/read-key",
        ],
    ]
    .concat();
    let s = resolve(&flags, &with_key).unwrap();
    let MailerConfig::Mailgun(m) = &s.manager().mailer else {
        panic!("{:?}", s.manager().mailer)
    };
    assert_eq!(
        m.read_api_key,
        Some(SecretSource::File("/nonexistent/read-key".into()))
    );
    // Read when the backend is built: an unreadable file stops start-up naming the flag.
    let err = super::mailer::mailer_error(capm_mailer::MailgunMailer::new(m).unwrap_err());
    let text = err.to_string();
    assert!(
        text.starts_with("--mailgun-read-key-file (MAILGUN_READ_KEY_FILE)"),
        "{text}"
    );
    assert!(!text.contains("key-topsecret"));
}

#[test]
fn tenancy_flags_default_to_a_single_team_install_and_bad_values_name_the_flag() {
    let settings = resolve(MAILGUN, &with_key).unwrap();
    assert_eq!(
        settings.manager().controllers.tenancy,
        capm_controllers::Tenancy {
            default_allowed: capm_api::v1beta1::AllowedNamespaces::default(),
            require_identity_ref: false,
            hosts: capm_mailer::AllowedHosts {
                mailgun: vec!["api.mailgun.net".into(), "api.eu.mailgun.net".into()],
                smtp: Vec::new(),
            },
            release_timeout: Duration::from_secs(24 * 3600),
        }
    );
    let flags = [
        MAILGUN,
        &[
            "--default-identity-allowed-namespaces",
            r#"{"list": ["platform"], "selector": {"matchLabels": {"team": "ops"}}}"#,
            "--require-identity-ref",
            "--identity-mailgun-hosts",
            "api.eu.mailgun.net,127.0.0.1:8080,[::1]",
            "--identity-smtp-hosts",
            "SMTP.example.com:587",
            "--release-timeout",
            "2h",
        ],
    ]
    .concat();
    let tenancy = resolve(&flags, &with_key)
        .unwrap()
        .into_manager()
        .controllers
        .tenancy;
    assert_eq!(
        tenancy.default_allowed.list.as_deref(),
        Some(&["platform".to_owned()][..])
    );
    assert!(tenancy.default_allowed.reads_labels());
    assert!(tenancy.require_identity_ref);
    assert_eq!(
        tenancy.hosts.mailgun,
        ["api.eu.mailgun.net", "127.0.0.1:8080", "[::1]"]
    );
    assert_eq!(tenancy.hosts.smtp, ["smtp.example.com:587"]);
    assert_eq!(tenancy.release_timeout, Duration::from_secs(7200));

    for (flag, value, says) in [
        (
            "--default-identity-allowed-namespaces",
            "team-a",
            "--default-identity-allowed-namespaces",
        ),
        (
            "--default-identity-allowed-namespaces",
            r#"{"list": ["Not_A_Namespace"]}"#,
            "is not a namespace name",
        ),
        (
            "--default-identity-allowed-namespaces",
            r#"{"selector": {"matchExpressions": [{"key": "team", "operator": "NotIn"}]}}"#,
            "values are required (not empty) for In and NotIn",
        ),
        (
            "--identity-mailgun-hosts",
            "https://api.mailgun.net",
            "--identity-mailgun-hosts",
        ),
        (
            "--identity-smtp-hosts",
            "relay:0",
            "is not a host, host:port or [IPv6]:port",
        ),
        (
            "--identity-smtp-hosts",
            "[nope]:25",
            "--identity-smtp-hosts",
        ),
        ("--release-timeout", "a day", "--release-timeout"),
        ("--require-identity-ref=maybe", "", "--require-identity-ref"),
    ] {
        let mut flags = MAILGUN.to_vec();
        flags.push(flag);
        if !value.is_empty() {
            flags.push(value);
        }
        let err = error(&flags, &with_key);
        let named = flag.split('=').next().unwrap_or(flag);
        assert!(
            err.contains(named) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
}

const PAGE: &[&str] = &[
    "--mode",
    "fulfilment-page",
    "--fulfilment-url",
    "https://capm.example.com",
    "--fulfilment-keys-file",
    "/keys",
];

#[test]
fn the_mode_is_all_unless_a_flag_its_variable_or_the_file_says_fulfilment_page() {
    assert!(matches!(
        resolve(MAILGUN, &with_key).unwrap().role,
        Role::All(_)
    ));
    assert_eq!(Field::of("mode").to_string(), "--mode (CAPM_MODE)");
    let page = resolve(PAGE, &no_env).unwrap().page_only();
    assert_eq!(page.fulfilment.url, "https://capm.example.com");
    assert_eq!(page.fulfilment.keys_file, Path::new("/keys"));
    assert_eq!(page.bind, "0.0.0.0:8090".parse().unwrap());
    assert_eq!(page.fulfilment.bind, Some(page.bind));
    assert!(page.recipients.is_empty());

    let config = file(
        "mode: fulfilment-page\nfulfilmentUrl: https://capm.example.com\n\
         fulfilmentKeysFile: /keys\nfulfilmentBindAddress: 127.0.0.1:9999\n\
         mailRecipients: [ops@example.com]\n",
    );
    let path = config.path().to_str().unwrap();
    let page = resolve(&["--config", path], &no_env).unwrap().page_only();
    assert_eq!(page.bind, "127.0.0.1:9999".parse().unwrap());
    assert_eq!(page.recipients, ["ops@example.com"]);
    // A flag beats the file.
    assert!(matches!(
        resolve(
            &[&["--config", path, "--mode", "all"], MAILGUN].concat(),
            &with_key
        )
        .unwrap()
        .role,
        Role::All(_)
    ));
    assert!(error(&["--mode", "controllers"], &no_env).contains("controllers"));
}

#[test]
fn a_page_only_process_needs_the_page_settings_each_named() {
    let without = |skip: &str| -> Vec<&str> {
        let mut flags = PAGE.to_vec();
        if let Some(at) = flags.iter().position(|f| *f == skip) {
            flags.drain(at..at + 2);
        }
        flags
    };
    assert_eq!(
        error(&without("--fulfilment-url"), &no_env),
        "--fulfilment-url (FULFILMENT_URL): required with --mode (CAPM_MODE) fulfilment-page: \
         the page's public base URL"
    );
    assert_eq!(
        error(&without("--fulfilment-keys-file"), &no_env),
        "--fulfilment-keys-file (FULFILMENT_KEYS_FILE): required with --mode (CAPM_MODE) \
         fulfilment-page: the links' keys"
    );
    assert_eq!(
        error(
            &[PAGE, &["--fulfilment-bind-address", "0"]].concat(),
            &no_env
        ),
        "--fulfilment-bind-address (FULFILMENT_BIND_ADDRESS): required with --mode (CAPM_MODE) \
         fulfilment-page: the page's address (not 0)"
    );
    // The page's own rules still hold.
    assert!(
        error(
            &[
                &without("--fulfilment-url")[..],
                &["--fulfilment-url", "http://capm.example.com"]
            ]
            .concat(),
            &no_env
        )
        .starts_with("--fulfilment-url (FULFILMENT_URL): \"http://capm.example.com\" is http")
    );
}

#[test]
fn a_page_only_process_refuses_every_mail_setting_naming_it() {
    let refusal = "with --mode (CAPM_MODE) fulfilment-page, which serves only the fulfilment \
                   page and holds no mail credentials";
    for (flag, value, named) in [
        ("--mail-backend", "smtp", "--mail-backend (MAIL_BACKEND)"),
        (
            "--mailgun-domain",
            "mg.example.com",
            "--mailgun-domain (MAILGUN_DOMAIN)",
        ),
        (
            "--mailgun-api-key-file",
            "/key",
            "--mailgun-api-key-file (MAILGUN_API_KEY_FILE)",
        ),
        (
            "--mailgun-read-key-file",
            "/key",
            "--mailgun-read-key-file (MAILGUN_READ_KEY_FILE)",
        ),
        (
            "--mailgun-region",
            "eu",
            "--mailgun-region (MAILGUN_REGION)",
        ),
        (
            "--mailgun-events-api",
            "events",
            "--mailgun-events-api (MAILGUN_EVENTS_API)",
        ),
        (
            "--mailgun-base-url",
            "http://127.0.0.1:9",
            "--mailgun-base-url (MAILGUN_BASE_URL)",
        ),
        ("--smtp-url", "smtp://relay", "--smtp-url (SMTP_URL)"),
        ("--smtp-username", "u", "--smtp-username (SMTP_USERNAME)"),
        (
            "--smtp-password-file",
            "/p",
            "--smtp-password-file (SMTP_PASSWORD_FILE)",
        ),
        ("--smtp-ca-file", "/ca", "--smtp-ca-file (SMTP_CA_FILE)"),
    ] {
        assert_eq!(
            error(&[PAGE, &[flag, value]].concat(), &no_env),
            format!(
                "{named}: is set {refusal}: remove the mail settings from its flags, variables \
                 and config file"
            ),
            "{flag}"
        );
    }
    assert_eq!(
        error(PAGE, &with_key),
        format!(
            "MAILGUN_API_KEY: is set {refusal}: remove the mail settings from its flags, \
             variables and config file"
        )
    );
    let password = |name: &str| (name == SMTP_PASSWORD_ENV).then(|| "hunter2".to_owned());
    let refused = error(PAGE, &password);
    assert!(refused.starts_with("SMTP_PASSWORD: is set "), "{refused}");
    assert!(!refused.contains("hunter2"));
    let config = file("mailer:\n  smtp:\n    url: smtp://relay.example.com\n");
    let refused = error(
        &[PAGE, &["--config", config.path().to_str().unwrap()]].concat(),
        &no_env,
    );
    assert!(
        refused.starts_with(&format!(
            "--config (CAPM_CONFIG): has a `mailer` section {refusal}"
        )),
        "{refused}"
    );
}
