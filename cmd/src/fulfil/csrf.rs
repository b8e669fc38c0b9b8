//! Cross-site request forgery defences: a POST must come from the page itself (its `Origin`,
//! `Sec-Fetch-Site`) and carry the form token bound to the page's `SameSite=Strict` cookie.

use axum_extra::extract::cookie::{Cookie, CookieJar};
use http::{HeaderMap, header};

/// The browser cookie the form token is bound to.
pub(super) const COOKIE: &str = "capm_fulfil";

/// Whether a POST's headers allow it to come from the page itself (`origin`, normalised as
/// browsers send it). `Origin` when sent must be the page's (`null`, from a sandboxed frame, a
/// `data:` page or a redirect across sites, is refused); `Sec-Fetch-Site` when sent must be
/// `same-origin` (or `none`: the user's own action). Without either (an old browser, curl), the
/// form token decides alone.
pub(super) fn same_origin(headers: &HeaderMap, origin: &str) -> bool {
    let origin_ok = headers
        .get(header::ORIGIN)
        .is_none_or(|o| o.as_bytes() == origin.as_bytes());
    let site_ok = headers
        .get("sec-fetch-site")
        .is_none_or(|s| matches!(s.as_bytes(), b"same-origin" | b"none"));
    origin_ok && site_ok
}

/// The cookie's value, if it is one this page set.
pub(super) fn cookie(jar: &CookieJar) -> Option<String> {
    jar.iter()
        .filter(|c| c.name() == COOKIE)
        .map(Cookie::value)
        .find(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
}

pub(super) fn new_cookie() -> String {
    rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn a_post_from_another_site_or_a_null_origin_is_refused() {
        let origin = "https://capm.example.com";
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (name, value) in pairs {
                h.insert(*name, HeaderValue::from_static(value));
            }
            h
        };
        for accepted in [
            headers(&[]),
            headers(&[("origin", origin)]),
            headers(&[("origin", origin), ("sec-fetch-site", "same-origin")]),
            headers(&[("sec-fetch-site", "none")]),
        ] {
            assert!(same_origin(&accepted, origin), "{accepted:?}");
        }
        for refused in [
            headers(&[("origin", "null")]),
            headers(&[("origin", "https://evil.example.com")]),
            headers(&[("origin", "https://CAPM.example.com:443")]),
            headers(&[("origin", origin), ("sec-fetch-site", "cross-site")]),
            headers(&[("origin", origin), ("sec-fetch-site", "same-site")]),
            headers(&[("sec-fetch-site", "cross-site")]),
        ] {
            assert!(!same_origin(&refused, origin), "{refused:?}");
        }
    }

    #[test]
    fn only_a_cookie_this_page_sets_is_read() {
        let mut headers = HeaderMap::new();
        let good = new_cookie();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("other=1; {COOKIE}=short; {COOKIE}={good}")).unwrap(),
        );
        assert_eq!(cookie(&CookieJar::from_headers(&headers)), Some(good));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("capm_fulfil=<script>"),
        );
        assert_eq!(cookie(&CookieJar::from_headers(&headers)), None);
    }
}
