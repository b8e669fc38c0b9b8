//! The hosts a backend built from somebody else's configuration (a tenant's identity) may reach:
//! an operator's allow-list, checked before any secret is read or any connection is made.

use url::{Host, Url};

use crate::MailgunRegion;

/// Hosts (`host`, `host:port`, `[IPv6]` or `[IPv6]:port`) a Mailgun API URL and an SMTP relay
/// may name. `http://` is allowed only to a loopback host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts {
    /// Hosts of Mailgun API URLs.
    pub mailgun: Vec<String>,
    /// Hosts of SMTP relays.
    pub smtp: Vec<String>,
}

impl AllowedHosts {
    /// The default list of Mailgun API hosts: the hosts of Mailgun's public regions
    /// ([`MailgunRegion::ALL`]), what an operator who lists none allows.
    #[must_use]
    pub fn default_mailgun() -> Vec<String> {
        MailgunRegion::ALL
            .iter()
            .map(|region| region.host().to_owned())
            .collect()
    }
}

/// The host and port of one allow-list entry; `None` when it is not one.
#[must_use]
pub fn parse_host_entry(entry: &str) -> Option<(Host, Option<u16>)> {
    let url = Url::parse(&format!("x://{}", entry.trim())).ok()?;
    let plain = url.username().is_empty()
        && url.password().is_none()
        && url.path().is_empty()
        && url.query().is_none()
        && url.fragment().is_none();
    let host = url.host()?.to_owned();
    (plain && !matches!(&host, Host::Domain(d) if d.is_empty())).then(|| (host, url.port()))
}

fn is_loopback(host: &Host<&str>) -> bool {
    match host {
        Host::Domain(d) => d.eq_ignore_ascii_case("localhost"),
        Host::Ipv4(ip) => ip.is_loopback(),
        Host::Ipv6(ip) => ip.is_loopback(),
    }
}

impl AllowedHosts {
    /// Whether `url` (`smtp`: a relay, else a Mailgun API URL) is on the list; the refusal
    /// begins with `field` and names the host and the list's flag, never more of the URL.
    ///
    /// # Errors
    /// Why not.
    pub fn check(&self, field: &str, url: &str, smtp: bool) -> Result<(), String> {
        let url = Url::parse(url).map_err(|e| format!("{field}: not a URL ({e})"))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(format!(
                "{field}: user information in the URL is not allowed"
            ));
        }
        let host = url.host().ok_or_else(|| format!("{field}: no host"))?;
        let (list, flag) = if smtp {
            (&self.smtp, "--identity-smtp-hosts")
        } else {
            (&self.mailgun, "--identity-mailgun-hosts")
        };
        let port = url.port_or_known_default();
        let entries: Vec<_> = list.iter().filter_map(|e| parse_host_entry(e)).collect();
        let listed = entries.iter().any(|(h, p)| {
            h.to_string().eq_ignore_ascii_case(&host.to_string()) && (p.is_none() || *p == port)
        });
        if !listed {
            // A list that names ports refuses a host and port, so the refusal names both.
            let endpoint = match port {
                Some(port) if entries.iter().any(|(_, p)| p.is_some()) => format!("{host}:{port}"),
                _ => host.to_string(),
            };
            return Err(format!(
                "{field}: host {endpoint} is not among the hosts the operator allows identities \
                 to reach ({flag})"
            ));
        }
        let scheme = url.scheme();
        if !smtp && scheme != "https" && !(scheme == "http" && is_loopback(&host)) {
            return Err(format!(
                "{field}: {scheme}:// is allowed only to a loopback host; use https://"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> AllowedHosts {
        AllowedHosts {
            mailgun: vec![
                "api.mailgun.net".into(),
                "127.0.0.1:8080".into(),
                "[::1]".into(),
            ],
            smtp: vec!["smtp.example.com".into()],
        }
    }

    #[test]
    fn the_default_mailgun_hosts_are_the_regions_hosts() {
        assert_eq!(
            AllowedHosts::default_mailgun(),
            ["api.mailgun.net", "api.eu.mailgun.net"]
        );
        for api in crate::MailgunEventsApi::ALL {
            let name = serde_json::to_value(api).unwrap_or_default();
            assert_eq!(name, api.name(), "{api:?}");
        }
        for region in MailgunRegion::ALL {
            let name = serde_json::to_value(region).unwrap_or_default();
            assert_eq!(name, region.name(), "{region:?}");
            let url = format!("{}/v3", region.base_url());
            assert_eq!(
                AllowedHosts {
                    mailgun: AllowedHosts::default_mailgun(),
                    smtp: Vec::new(),
                }
                .check("spec.x", &url, false),
                Ok(())
            );
        }
    }

    #[test]
    fn entries_are_hosts_with_an_optional_port() {
        for entry in [
            "a.example",
            "A.example:25",
            "10.0.0.1",
            "[::1]:8080",
            "localhost",
        ] {
            assert!(parse_host_entry(entry).is_some(), "{entry}");
        }
        for entry in [
            "",
            ":25",
            "a:b",
            "a:0x",
            "https://a",
            "a/b",
            "u@a",
            "a?b",
            "[::1",
            "a:70000",
        ] {
            assert!(parse_host_entry(entry).is_none(), "{entry}");
        }
    }

    #[test]
    fn endpoints_on_the_allow_list_only_and_http_only_to_loopback() {
        let t = hosts();
        let ok = |url: &str, smtp| t.check("spec.x", url, smtp);
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
            // The Mailgun list names a port: the refusal names the URL's.
            (
                "https://api.eu.mailgun.net",
                false,
                "host api.eu.mailgun.net:443 is not among",
            ),
            ("https://10.0.0.1", false, "host 10.0.0.1:443 is not among"),
            (
                "http://127.0.0.1:8081",
                false,
                "host 127.0.0.1:8081 is not among",
            ),
            ("http://[::2]:9", false, "host [::2]:9 is not among"),
            // The SMTP list names none: the host alone.
            (
                "smtp://relay.example.com:587",
                true,
                "host relay.example.com is not among",
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
            ("not a url", false, "not a URL"),
        ] {
            let error = ok(url, smtp).expect_err(url);
            assert!(
                error.starts_with("spec.x: ") && error.contains(says),
                "{url}: {error}"
            );
        }
        // Listed but not loopback: https only.
        let listed = AllowedHosts {
            mailgun: vec!["proxy.internal".into()],
            smtp: Vec::new(),
        };
        let error = listed
            .check("spec.mailgun.baseURL", "http://proxy.internal", false)
            .unwrap_err();
        assert!(
            error.contains("http:// is allowed only to a loopback host"),
            "{error}"
        );
    }
}
