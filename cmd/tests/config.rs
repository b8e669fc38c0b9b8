//! The binary refuses bad configuration before touching any cluster, names the field, and never
//! prints a secret. No cluster needed.

use std::process::{Command, Output};

/// The provider binary: `$CAPM_PROVIDER_BIN` when set (a copy that a concurrent build in a shared
/// target directory cannot replace mid-run, as the end-to-end tests read it), else this build's.
fn bin() -> std::ffi::OsString {
    std::env::var_os("CAPM_PROVIDER_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cluster-api-provider-mailgun").into())
}
const SECRET: &str = "key-4f9c1d8e7b6a5-topsecret";

fn run(env: &[(&str, &str)], args: &[&str]) -> Output {
    Command::new(bin())
        .env_clear()
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stderr(output: &Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!text.contains(SECRET), "a secret leaked:\n{text}");
    text
}

#[test]
fn bad_recipient_is_named() {
    let out = run(
        &[
            ("MAILGUN_DOMAIN", "mg.example.com"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "x"),
            ("RUST_LOG", "trace"),
        ],
        &[],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(r#"--mail-recipient (MAIL_RECIPIENT): "x" is not an e-mail address"#),
        "{text}"
    );
    assert_eq!(text.lines().count(), 1, "one line: {text}");
}

#[test]
fn missing_domain_is_named() {
    let out = run(
        &[
            ("MAIL_BACKEND", "mailgun"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
        &[],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("--mailgun-domain (MAILGUN_DOMAIN): required for the mailgun backend"),
        "{text}"
    );
}

#[test]
fn unknown_backend_is_named() {
    let out = run(
        &[
            ("MAIL_BACKEND", "sendgrid"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
        &[],
    );
    let text = stderr(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("sendgrid") && text.contains("--mail-backend"),
        "{text}"
    );
}

#[test]
fn missing_api_key_is_named() {
    let out = run(
        &[
            ("MAILGUN_DOMAIN", "mg.example.com"),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
        &[],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("MAILGUN_API_KEY"), "{text}");
}

/// A valid configuration gets as far as the cluster; whatever fails there, debug logs and the
/// error line do not contain the key.
#[test]
fn secret_stays_out_of_logs_and_errors_past_validation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(
        &[
            ("MAILGUN_DOMAIN", "mg.example.com"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "ops@example.com"),
            ("RUST_LOG", "trace"),
            ("LOG_FORMAT", "json"),
        ],
        &[
            "--kubeconfig",
            dir.path().join("missing").to_str().expect("utf-8"),
            "--webhook-port=0",
            "--diagnostics-address=0",
            "--health-probe-bind-address=0",
        ],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("--kubeconfig"), "{text}");
}

#[test]
fn webhook_without_certificates_fails_naming_the_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(
        &[
            ("MAILGUN_DOMAIN", "mg.example.com"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
        &["--webhook-cert-dir", dir.path().to_str().expect("utf-8")],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("--webhook-cert-dir (WEBHOOK_CERT_DIR)") && text.contains("tls.crt"),
        "{text}"
    );
}

#[test]
fn diagnostics_without_certificates_fail_naming_the_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = run(
        &[
            ("MAILGUN_DOMAIN", "mg.example.com"),
            ("MAILGUN_API_KEY", SECRET),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
        &[
            "--webhook-port=0",
            "--diagnostics-cert-dir",
            dir.path().to_str().expect("utf-8"),
        ],
    );
    let text = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("--diagnostics-cert-dir (DIAGNOSTICS_CERT_DIR)") && text.contains("tls.crt"),
        "{text}"
    );
}

#[test]
fn help_documents_every_variable() {
    let out = run(&[], &["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for var in [
        "MAIL_RECIPIENT",
        "MAIL_FROM",
        "MAILGUN_DOMAIN",
        "MAILGUN_API_KEY",
        "SMTP_URL",
        "LEADER_ELECT",
        "WEBHOOK_CERT_DIR",
        "DIAGNOSTICS_ADDRESS",
        "INSECURE_DIAGNOSTICS",
        "CAPM_MODE",
        "fulfilment-page",
        "default: :8443",
    ] {
        assert!(help.contains(var), "{var} missing from --help:\n{help}");
    }
}
