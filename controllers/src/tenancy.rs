//! What the operator lets tenants do (docs/multi-tenancy.md): the namespaces the provider's own
//! configuration serves, whether an `identityRef` is required, the hosts an identity may reach,
//! which Secrets an identity may name, and how long a release may wait. Pure rules; the lookups
//! are `crate::identity`'s.

use std::{net::IpAddr, time::Duration};

use capm_api::{
    names::IDENTITY_SECRET_LABEL,
    v1beta1::{AllowedNamespaces, MailgunClusterIdentity},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;

/// The operator's rules for identities and for the provider's own configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenancy {
    /// The namespaces whose objects may mail through the provider's own configuration (no
    /// `identityRef`), in an identity's shape (`--default-identity-allowed-namespaces`; `{}`:
    /// all, a single team's install).
    pub default_allowed: AllowedNamespaces,
    /// Objects without an `identityRef` are refused (`IdentityRequired`, no mail)
    /// (`--require-identity-ref`).
    pub require_identity_ref: bool,
    /// Hosts (`host` or `host:port`) an identity's Mailgun API URL may name
    /// (`--identity-mailgun-hosts`); `http://` only to a loopback one.
    pub mailgun_hosts: Vec<String>,
    /// Hosts (`host` or `host:port`) an identity's SMTP relay may be (`--identity-smtp-hosts`).
    pub smtp_hosts: Vec<String>,
    /// How long after its deletion an object whose release cannot go out (its identity gone,
    /// not allowed or unusable, its backend failing) gives the release up, so that the deletion
    /// finishes (`--release-timeout`).
    pub release_timeout: Duration,
}

impl Default for Tenancy {
    /// The binary's defaults: everything as a single-team install had it, Mailgun's two API
    /// hosts, no SMTP host, a day for a release.
    fn default() -> Self {
        Self {
            default_allowed: AllowedNamespaces::default(),
            require_identity_ref: false,
            mailgun_hosts: vec!["api.mailgun.net".into(), "api.eu.mailgun.net".into()],
            smtp_hosts: Vec::new(),
            release_timeout: Duration::from_secs(24 * 3600),
        }
    }
}

/// Scheme, host (IPv6 without brackets) and port of `url`, or why it has none.
fn authority(url: &str) -> Result<(&str, &str, Option<&str>), &'static str> {
    let (scheme, rest) = url.split_once("://").ok_or("not a URL")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    if authority.contains('@') {
        return Err("user information in the URL is not allowed");
    }
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']').ok_or("an unclosed IPv6 address")?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        return Err("no host");
    }
    Ok((scheme, host, port))
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Tenancy {
    /// Whether an identity may reach `url` (`smtp`: a relay, else a Mailgun API URL); the
    /// refusal names `field` and the host, never more of the URL.
    ///
    /// # Errors
    /// Why not, for the `IdentityInvalid` condition.
    pub fn check_endpoint(&self, field: &str, url: &str, smtp: bool) -> Result<(), String> {
        let (scheme, host, port) = authority(url).map_err(|why| format!("{field}: {why}"))?;
        let (hosts, flag) = if smtp {
            (&self.smtp_hosts, "--identity-smtp-hosts")
        } else {
            (&self.mailgun_hosts, "--identity-mailgun-hosts")
        };
        let listed = hosts.iter().any(|entry| {
            let (h, p) = match entry.rsplit_once(':').filter(|_| !entry.ends_with(']')) {
                Some((h, p)) if !h.contains(':') || h.starts_with('[') => (h, Some(p)),
                _ => (entry.as_str(), None),
            };
            h.trim_matches(['[', ']']).eq_ignore_ascii_case(host) && (p.is_none() || p == port)
        });
        if !listed {
            return Err(format!(
                "{field}: host {host} is not among the hosts the operator allows identities to \
                 reach ({flag})"
            ));
        }
        if !smtp && scheme != "https" && !(scheme == "http" && is_loopback(host)) {
            return Err(format!(
                "{field}: {scheme}:// is allowed only to a loopback host; use https://"
            ));
        }
        Ok(())
    }
}

/// Whether the Secret `meta` is claimed for `identity`: labelled with its name
/// ([`IDENTITY_SECRET_LABEL`]; the provider watches only labelled Secrets), and owned by no other
/// identity (an ownerReference to this one, by its UID, is welcome: `clusterctl move`).
///
/// # Errors
/// Why not, for the `IdentityInvalid` condition (naming the Secret, never a value).
pub fn check_claim(meta: &ObjectMeta, identity: &MailgunClusterIdentity) -> Result<(), String> {
    let (name, uid) = (
        identity.meta().name.as_deref(),
        identity.meta().uid.as_deref(),
    );
    let secret = meta.name.as_deref().unwrap_or_default();
    let owners = meta.owner_references.iter().flatten().filter(|o| {
        o.kind == MailgunClusterIdentity::kind(&())
            && o.api_version.split('/').next() == Some(capm_api::GROUP)
    });
    let foreign = owners
        .into_iter()
        .any(|o| Some(o.name.as_str()) != name || Some(o.uid.as_str()) != uid);
    let label = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(IDENTITY_SECRET_LABEL));
    if foreign || label.is_some_and(|l| Some(l.as_str()) != name) {
        return Err(format!("Secret {secret} is claimed by another identity"));
    }
    if label.is_some() {
        Ok(())
    } else {
        Err(format!(
            "Secret {secret} is not claimed for this identity (label {IDENTITY_SECRET_LABEL}=<identity>)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use capm_api::v1beta1::MailgunClusterIdentitySpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn tenancy() -> Tenancy {
        Tenancy {
            mailgun_hosts: vec![
                "api.mailgun.net".into(),
                "127.0.0.1:8080".into(),
                "[::1]".into(),
            ],
            smtp_hosts: vec!["smtp.example.com".into()],
            ..Tenancy::default()
        }
    }

    #[test]
    fn endpoints_on_the_allow_list_only_and_http_only_to_loopback() {
        let t = tenancy();
        let ok = |url: &str, smtp| t.check_endpoint("spec.x", url, smtp);
        for (url, smtp) in [
            ("https://api.mailgun.net", false),
            ("https://API.mailgun.net:443/v3", false),
            ("http://127.0.0.1:8080/", false),
            ("http://[::1]:9/x", false),
            ("smtp://smtp.example.com:587", true),
            ("smtps://smtp.example.com", true),
        ] {
            assert_eq!(ok(url, smtp), Ok(()), "{url}");
        }
        for (url, smtp, says) in [
            (
                "https://api.eu.mailgun.net",
                false,
                "host api.eu.mailgun.net is not among",
            ),
            ("https://10.0.0.1", false, "host 10.0.0.1 is not among"),
            (
                "http://127.0.0.1:8081",
                false,
                "host 127.0.0.1 is not among",
            ),
            (
                "http://169.254.169.254/latest",
                false,
                "host 169.254.169.254",
            ),
            (
                "https://api.mailgun.net@evil.example",
                false,
                "user information",
            ),
            (
                "https://evil.example#@api.mailgun.net",
                false,
                "host evil.example",
            ),
            ("smtp://api.mailgun.net", true, "--identity-smtp-hosts"),
            (
                "https://smtp.example.com",
                false,
                "--identity-mailgun-hosts",
            ),
        ] {
            let error = ok(url, smtp).expect_err(url);
            assert!(
                error.starts_with("spec.x: ") && error.contains(says),
                "{url}: {error}"
            );
        }
        // Listed but not loopback: https only.
        let listed = Tenancy {
            mailgun_hosts: vec!["proxy.internal".into()],
            ..Tenancy::default()
        };
        let error = listed
            .check_endpoint("spec.mailgun.baseURL", "http://proxy.internal", false)
            .unwrap_err();
        assert!(
            error.contains("http:// is allowed only to a loopback host"),
            "{error}"
        );
    }

    fn identity(name: &str, uid: &str) -> MailgunClusterIdentity {
        let mut i = MailgunClusterIdentity::new(
            name,
            MailgunClusterIdentitySpec {
                mailgun: None,
                smtp: None,
                from: None,
                recipients: vec!["a@b.co".into()],
                allowed_namespaces: None,
            },
        );
        i.metadata.uid = Some(uid.into());
        i
    }

    fn secret(label: Option<&str>, owner: Option<(&str, &str)>) -> ObjectMeta {
        ObjectMeta {
            name: Some("key".into()),
            labels: label
                .map(|l| BTreeMap::from([(IDENTITY_SECRET_LABEL.to_owned(), l.to_owned())])),
            owner_references: owner.map(|(name, uid)| {
                vec![OwnerReference {
                    api_version: format!("{}/v1beta1", capm_api::GROUP),
                    kind: "MailgunClusterIdentity".into(),
                    name: name.into(),
                    uid: uid.into(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn secrets_claimed_by_label_and_never_by_another() {
        let a = identity("team-a", "uid-a");
        for (meta, ok) in [
            (secret(Some("team-a"), None), true),
            // Owned alone is not claimed: only labelled Secrets are watched.
            (secret(None, Some(("team-a", "uid-a"))), false),
            (secret(Some("team-a"), Some(("team-a", "uid-a"))), true),
            (secret(None, None), false),
            (secret(Some("team-b"), None), false),
            (secret(None, Some(("team-b", "uid-b"))), false),
            // An identity of the same name re-created: the old one's claim is not its.
            (secret(None, Some(("team-a", "uid-old"))), false),
            (secret(Some("team-a"), Some(("team-b", "uid-b"))), false),
        ] {
            let got = check_claim(&meta, &a);
            assert_eq!(got.is_ok(), ok, "{meta:?}: {got:?}");
            if let Err(why) = got {
                assert!(why.starts_with("Secret key is "), "{why}");
            }
        }
    }
}
