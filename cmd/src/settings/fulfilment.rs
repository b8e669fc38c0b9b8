//! The fulfilment link and page settings (`--fulfilment-*`).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::LazyLock,
    time::Duration,
};

use capm_api::link_token;
use ipnet::IpNet;

use super::{
    SettingsError, invalid,
    values::{bind_address, duration, duration_text},
};

/// `--fulfilment-link-validity`'s default, as the flag shows it.
static LINK_VALIDITY: LazyLock<String> =
    LazyLock::new(|| duration_text(link_token::DEFAULT_VALIDITY));

/// The fulfilment flags.
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Public base URL of the fulfilment page, scheme and host only (e.g.
    /// `https://capm.example.com`, served through an Ingress with TLS; `http` only on a
    /// loopback host): request mails then carry a link to a page where the human records
    /// what they built without cluster credentials (needs --fulfilment-keys-file) [default: no
    /// link, no page].
    #[arg(long, env = "FULFILMENT_URL", value_name = "URL")]
    pub fulfilment_url: Option<String>,

    /// File listing the fulfilment links' keys, one base64 key of at least 32 bytes per line,
    /// newest first (it signs; all are accepted); re-read when it changes.
    #[arg(long, env = "FULFILMENT_KEYS_FILE", value_name = "FILE")]
    pub fulfilment_keys_file: Option<PathBuf>,

    /// Address of the fulfilment page (plain HTTP; TLS at the Ingress), with --fulfilment-url;
    /// `0`: links in the mails, the page served elsewhere.
    #[arg(
        long,
        env = "FULFILMENT_BIND_ADDRESS",
        value_name = "ADDR",
        default_value = ":8090"
    )]
    pub fulfilment_bind_address: String,

    /// How long a fulfilment link is valid after its request mail (at most 2160h, 90 days).
    #[arg(long, env = "FULFILMENT_LINK_VALIDITY", value_name = "DURATION", default_value = LINK_VALIDITY.as_str(), value_parser = duration)]
    pub fulfilment_link_validity: Duration,

    /// Replaced by --fulfilment-trusted-proxies: `true` stops the provider at start-up saying so
    /// (it made any client able to choose its address).
    #[arg(long, env = "FULFILMENT_TRUST_FORWARDED_FOR", default_value_t = false)]
    pub fulfilment_trust_forwarded_for: bool,

    /// The proxies in front of the fulfilment page (comma-separated CIDRs or addresses, e.g. the
    /// Ingress controller's Pod network): when the peer is one of them, the client address is
    /// the X-Forwarded-For entry read right to left past the trusted hops [default: none, the
    /// peer].
    #[arg(long, env = "FULFILMENT_TRUSTED_PROXIES", value_name = "CIDRS")]
    pub fulfilment_trusted_proxies: Option<String>,
}

/// The fulfilment links (in the request mails) and the page (docs/fulfilment.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fulfilment {
    /// The page's public base URL, normalised: lower-case scheme and host, no default port, no
    /// trailing `/` (it is also the Origin the page's own form is posted from).
    pub url: String,
    /// `https` public URL: the page's cookie is `Secure`.
    pub secure: bool,
    /// The key list's file.
    pub keys_file: PathBuf,
    /// Where the page listens; `None`: not served by this process.
    pub bind: Option<SocketAddr>,
    /// How long a link is valid after its mail.
    pub validity: Duration,
    /// The proxies whose `X-Forwarded-For` is read (`--fulfilment-trusted-proxies`).
    pub trusted_proxies: Vec<IpNet>,
}

/// The settings, checked; `None` without a URL.
pub(super) fn resolve(flags: Flags) -> Result<Option<Fulfilment>, SettingsError> {
    let Flags {
        fulfilment_url: url,
        fulfilment_keys_file: keys_file,
        fulfilment_bind_address: bind,
        fulfilment_link_validity: validity,
        fulfilment_trust_forwarded_for: trust_forwarded_for,
        fulfilment_trusted_proxies: trusted_proxies,
    } = flags;
    if trust_forwarded_for {
        return Err(invalid(
            field!(fulfilment_trust_forwarded_for),
            format!(
                "was replaced by {}: list the proxies in front of the page (CIDRs); \
                 X-Forwarded-For is then read only from them, right to left past them",
                field!(fulfilment_trusted_proxies)
            ),
        ));
    }
    let trusted_proxies = parse_proxies(trusted_proxies.as_deref().unwrap_or_default())?;
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        if keys_file.is_some() {
            return Err(invalid(
                field!(fulfilment_keys_file),
                format!("is used only with {}", field!(fulfilment_url)),
            ));
        }
        return Ok(None);
    };
    let (url, secure) = normalise(&url)?;
    let Some(keys_file) = keys_file else {
        return Err(invalid(
            field!(fulfilment_keys_file),
            format!("is required with {}", field!(fulfilment_url)),
        ));
    };
    if validity.is_zero() {
        return Err(invalid(
            field!(fulfilment_link_validity),
            "must be positive",
        ));
    }
    if validity > link_token::MAX_VALIDITY {
        return Err(invalid(
            field!(fulfilment_link_validity),
            format!(
                "{}h is above the cap of {}h ({} days): a link is a bearer credential",
                validity.as_secs().div_ceil(3600),
                link_token::MAX_VALIDITY.as_secs() / 3600,
                link_token::MAX_VALIDITY.as_secs() / (24 * 3600)
            ),
        ));
    }
    Ok(Some(Fulfilment {
        url,
        secure,
        keys_file,
        bind: bind_address(field!(fulfilment_bind_address), &bind)?,
        validity,
        trusted_proxies,
    }))
}

/// `url` normalised as a browser serialises its origin (scheme and host in lower case, the
/// default port dropped), and whether it is `https`. `http` only for a loopback host; no
/// userinfo, path, query or fragment.
fn normalise(url: &str) -> Result<(String, bool), SettingsError> {
    // `http::Uri` first: the URL standard's parser would read `https:///p` as host `p`.
    let uri: http::Uri = url.parse().map_err(|_| bad_url(url))?;
    if uri.authority().is_none_or(|a| a.host().is_empty()) {
        return Err(bad_url(url));
    }
    let parsed = url::Url::parse(url).map_err(|_| bad_url(url))?;
    let secure = match parsed.scheme() {
        "https" => true,
        "http" => false,
        _ => return Err(bad_url(url)),
    };
    // The page answers at /fulfil/ of its host: a path would need rewriting in front of it.
    if parsed.host().is_none()
        || !matches!(parsed.path(), "" | "/")
        || parsed.query().is_some()
        || parsed.fragment().is_some()
    {
        return Err(bad_url(url));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(invalid(
            field!(fulfilment_url),
            format!(
                "{:?} carries a user name or password: the URL goes into every request mail",
                redact(url)
            ),
        ));
    }
    let loopback = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        Some(url::Host::Domain(name)) => name == "localhost",
        None => false,
    };
    if !secure && !loopback {
        return Err(invalid(
            field!(fulfilment_url),
            format!(
                "{url:?} is http: the link is a bearer credential, so the public URL must be \
                 https (TLS at the Ingress); http is accepted only for a loopback host"
            ),
        ));
    }
    Ok((parsed.origin().ascii_serialization(), secure))
}

/// The comma-separated CIDRs (or single addresses) of `--fulfilment-trusted-proxies`.
fn parse_proxies(list: &str) -> Result<Vec<IpNet>, SettingsError> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<IpNet>()
                .map(|net| net.trunc())
                .or_else(|_| p.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| {
                    invalid(
                        field!(fulfilment_trusted_proxies),
                        format!("{p:?} is not a CIDR (10.0.0.0/8, fd00::/8) or an address"),
                    )
                })
        })
        .collect()
}

/// `url` without what could be a password.
fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://…@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

fn bad_url(url: &str) -> SettingsError {
    invalid(
        field!(fulfilment_url),
        format!(
            "{:?} is not an http(s) URL with a host and nothing after it (no path, no query)",
            redact(url)
        ),
    )
}
