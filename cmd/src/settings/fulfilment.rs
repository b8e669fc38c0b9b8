//! The fulfilment link and page settings (`--fulfilment-*`).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use super::{SettingsError, invalid, values::bind_address};

/// The fulfilment links (in the request mails) and the page (docs/fulfilment.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fulfilment {
    /// The page's public base URL, without a trailing `/`.
    pub url: String,
    /// `https` public URL: the page's cookie is `Secure`.
    pub secure: bool,
    /// The key list's file.
    pub keys_file: PathBuf,
    /// Where the page listens; `None`: not served by this process.
    pub bind: Option<SocketAddr>,
    /// How long a link is valid after its mail.
    pub validity: Duration,
    /// The client address is the last `X-Forwarded-For` entry.
    pub trust_forwarded_for: bool,
}

/// The settings, checked; `None` without a URL.
pub(super) fn resolve(
    url: Option<String>,
    keys_file: Option<PathBuf>,
    bind: &str,
    validity: Duration,
    trust_forwarded_for: bool,
) -> Result<Option<Fulfilment>, SettingsError> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        if keys_file.is_some() {
            return Err(invalid(
                field!(fulfilment_keys_file),
                format!("is used only with {}", field!(fulfilment_url)),
            ));
        }
        return Ok(None);
    };
    let uri: http::Uri = url.parse().map_err(|_| bad_url(&url))?;
    let secure = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err(bad_url(&url)),
    };
    // The page answers at /fulfil/ of its host: a path would need rewriting in front of it.
    let bare = matches!(uri.path(), "" | "/");
    if uri.authority().is_none_or(|a| a.host().is_empty()) || uri.query().is_some() || !bare {
        return Err(bad_url(&url));
    }
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
    Ok(Some(Fulfilment {
        url: url.trim_end_matches('/').to_owned(),
        secure,
        keys_file,
        bind: bind_address(field!(fulfilment_bind_address), bind)?,
        validity,
        trust_forwarded_for,
    }))
}

fn bad_url(url: &str) -> SettingsError {
    invalid(
        field!(fulfilment_url),
        format!(
            "{url:?} is not an http(s) URL with a host and nothing after it (no path, no query)"
        ),
    )
}
