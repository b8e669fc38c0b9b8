//! The fulfilment page: `GET /fulfil/<token>` shows what was asked and a form; `POST` records
//! what the human built by patching the object as the provider. The token is the capability
//! (`capm_api::link_token`); the object itself says whether it is already fulfilled, so a link is
//! single-use without any state here but the rate limits. docs/fulfilment.md has the threat
//! model.
//!
//! Every refusal writes nothing: a forged, altered, expired or revoked link, an object deleted
//! or recreated since the mail, a form not sent from its page (the form token binds the link to
//! the browser's `SameSite=Strict` cookie), a value the API's own rules refuse, a burst past
//! the rate limits. Bodies and time are bounded by the server's [`crate::server::Limits`].

mod client_address;
mod csrf;
mod html;
mod keys;
mod limiter;
mod record;
mod target;
mod views;

use std::{
    collections::HashMap,
    future::Future,
    net::IpAddr,
    pin::Pin,
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use capm_api::link_token::{self, Claims, FulfilError, KeyRing};
use capm_controllers::Events;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::Full;
use kube::Client;
use prometheus::{IntCounterVec, Opts, Registry};
use tracing::{info, warn};

use crate::server::{Peer, Req};
use client_address::forwarded_client;
use csrf::{COOKIE, cookie, new_cookie, same_origin};
pub use keys::{KEY_RELOAD_INTERVAL, KeyFile, reload_keys};
pub use limiter::Limiter;
use target::{Form, Target};

/// Address rows on the machine form.
const ADDRESS_ROWS: usize = 4;
/// Patches tried when the object changes under one (each after reading and checking it again).
const PATCH_ATTEMPTS: u32 = 4;
/// The pause before the next attempt, times the attempts so far.
const CONFLICT_PAUSE: Duration = Duration::from_millis(250);
/// The page's field manager for its patches.
const FIELD_MANAGER: &str = "cluster-api-provider-mailgun-fulfilment";

/// What the page needs.
pub struct Page {
    client: Client,
    keys: KeyRing,
    /// `scheme://host[:port]` of the public URL: a POST from another origin is refused.
    origin: String,
    secure_cookie: bool,
    /// The proxies whose `X-Forwarded-For` is read.
    trusted_proxies: Vec<ipnet::IpNet>,
    /// The provider's own recipients (mails without a `MailgunClusterIdentity`).
    recipients: Vec<String>,
    events: Events,
    limiter: Limiter,
    requests: IntCounterVec,
    csp: String,
}

/// The answer of the page's handler.
pub type PageFuture = Pin<Box<dyn Future<Output = Response<Full<Bytes>>> + Send>>;

/// What the page answers, counted in `capm_fulfilment_requests_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Form,
    Invalid,
    Fulfilled,
    Already,
    Refused(&'static str),
    Error,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Self::Form => "form",
            Self::Invalid => "invalid_values",
            Self::Fulfilled => "fulfilled",
            Self::Already => "already_fulfilled",
            Self::Refused(reason) => reason,
            Self::Error => "error",
        }
    }
}

impl Page {
    /// The page for the public `url`, its counters registered in `registry`.
    ///
    /// # Errors
    /// When the counters are already registered.
    pub fn new(
        client: Client,
        keys: KeyRing,
        settings: &crate::settings::Fulfilment,
        recipients: Vec<String>,
        events: Events,
        registry: &Registry,
    ) -> anyhow::Result<Self> {
        let requests = IntCounterVec::new(
            Opts::new(
                "capm_fulfilment_requests_total",
                "Requests to the fulfilment page, by what it answered",
            ),
            &["result"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        let origin = settings
            .url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| Some(format!("{}://{}", u.scheme_str()?, u.authority()?)))
            .unwrap_or_default();
        let css_hash = {
            use base64::Engine as _;
            let digest = ring::digest::digest(&ring::digest::SHA256, html::CSS.as_bytes());
            base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
        };
        Ok(Self {
            events,
            client,
            keys,
            origin,
            secure_cookie: settings.secure,
            trusted_proxies: settings.trusted_proxies.clone(),
            recipients,
            limiter: Limiter::default(),
            requests,
            csp: format!(
                "default-src 'none'; style-src 'sha256-{css_hash}'; form-action 'self'; \
                 frame-ancestors 'none'; base-uri 'none'"
            ),
        })
    }

    /// The server's handler.
    pub fn handler(self: Arc<Self>) -> impl Fn(Req) -> PageFuture + Send + Sync + Clone + 'static {
        move |req| {
            let page = Arc::clone(&self);
            Box::pin(async move { page.handle(req).await })
        }
    }

    async fn handle(&self, req: Req) -> Response<Full<Bytes>> {
        let Some(token) = req.uri().path().strip_prefix(link_token::PATH_PREFIX) else {
            return crate::server::text(StatusCode::NOT_FOUND, "not found\n");
        };
        let token = token.to_owned();
        let address = self.client_address(&req);
        let post = req.method() == Method::POST;
        let (outcome, mut response) =
            if !post && req.method() != Method::GET && req.method() != Method::HEAD {
                let mut r = self.answer(
                    StatusCode::METHOD_NOT_ALLOWED,
                    html::refusal("Use the link or the form."),
                );
                r.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
                (Outcome::Refused("method"), r)
            } else if let Err(wait) = self.limiter.allow_address(address, post) {
                (Outcome::Refused("rate_limited"), self.too_many(wait))
            } else if post {
                self.submit(&token, req, address).await
            } else {
                self.show(&token, req.headers()).await
            };
        self.requests.with_label_values(&[outcome.label()]).inc();
        if let Outcome::Refused(reason) = outcome {
            info!(reason, client = %address, "Fulfilment page refused a request");
        }
        let headers = response.headers_mut();
        for (name, value) in [
            (header::CACHE_CONTROL, "no-store"),
            (header::REFERRER_POLICY, "same-origin"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::X_FRAME_OPTIONS, "DENY"),
        ] {
            headers.insert(name, HeaderValue::from_static(value));
        }
        if let Ok(csp) = HeaderValue::from_str(&self.csp) {
            headers.insert(header::CONTENT_SECURITY_POLICY, csp);
        }
        response
    }

    /// The client's address: the peer, or through `--fulfilment-trusted-proxies`
    /// [`forwarded_client`].
    fn client_address(&self, req: &Req) -> IpAddr {
        let peer = req
            .extensions()
            .get::<Peer>()
            .map_or(IpAddr::from([0, 0, 0, 0]), |p| p.0.ip());
        forwarded_client(peer, req.headers(), &self.trusted_proxies)
    }

    fn answer(&self, status: StatusCode, body: String) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        response
    }

    /// 429, with the seconds until the next attempt is allowed.
    fn too_many(&self, wait: Duration) -> Response<Full<Bytes>> {
        let mut r = self.answer(
            StatusCode::TOO_MANY_REQUESTS,
            html::refusal("Too many attempts for now; try again in a few minutes."),
        );
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        r
    }

    fn refused(&self, reason: &'static str, status: StatusCode, message: &str) -> Answered {
        (
            Outcome::Refused(reason),
            self.answer(status, html::refusal(message)),
        )
    }

    /// Opens the token and finds its object, still the one it was made for.
    async fn resolve(&self, token: &str) -> Result<(Claims, Target), Answered> {
        let claims = match self.keys.current().open(token, SystemTime::now()) {
            Ok(claims) => claims,
            Err(FulfilError::Expired { .. }) => {
                return Err(self.refused("expired", StatusCode::GONE, "This link has expired."));
            }
            Err(_) => {
                return Err(self.refused(
                    "invalid",
                    StatusCode::FORBIDDEN,
                    "This link is not valid: it was altered, or it was revoked.",
                ));
            }
        };
        let target = match Target::get(&self.client, &claims).await {
            Ok(Some(target)) => target,
            Ok(None) => {
                return Err(self.refused(
                    "gone",
                    StatusCode::GONE,
                    "What this link asks for is no longer requested.",
                ));
            }
            Err(e) => {
                warn!(error = %e, "Fulfilment page: reading the object failed");
                return Err((
                    Outcome::Error,
                    self.answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        html::page(
                            "Try again shortly",
                            "<p>The request could not be read just now. Nothing was recorded.</p>\n",
                        ),
                    ),
                ));
            }
        };
        if let Err(mismatch) = claims.check_object(target.meta()) {
            let message = if mismatch == FulfilError::Revoked {
                "This link was revoked."
            } else {
                "What this link asks for is no longer requested: the object was replaced."
            };
            return Err(self.refused(mismatch.metric_label(), StatusCode::GONE, message));
        }
        if target.meta().deletion_timestamp.is_some() {
            return Err(self.refused(
                "deleting",
                StatusCode::GONE,
                "What this link asks for is no longer needed.",
            ));
        }
        Ok((claims, target))
    }

    async fn show(&self, token: &str, headers: &HeaderMap) -> Answered {
        let (_, target) = match self.resolve(token).await {
            Ok(found) => found,
            Err(answered) => return answered,
        };
        if let Some(values) = target.fulfilment() {
            return (Outcome::Already, self.already(&target, &values).await);
        }
        let cookie = cookie(headers).unwrap_or_else(new_cookie);
        let mut response = self
            .form_page(&target, token, &cookie, &Form::default(), StatusCode::OK)
            .await;
        let secure = if self.secure_cookie { "; Secure" } else { "" };
        let set = format!(
            "{COOKIE}={cookie}; Path={}; HttpOnly; SameSite=Strict{secure}",
            link_token::PATH_PREFIX
        );
        if let Ok(value) = HeaderValue::from_str(&set) {
            response.headers_mut().insert(header::SET_COOKIE, value);
        }
        (Outcome::Form, response)
    }

    async fn submit(&self, token: &str, req: Req, address: IpAddr) -> Answered {
        let headers = req.headers().clone();
        let form_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
        if !form_type {
            return self.refused(
                "not_a_form",
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "Send the values with the page's form.",
            );
        }
        let body = http_body_util::BodyExt::collect(req.into_body())
            .await
            .map(http_body_util::Collected::to_bytes)
            .unwrap_or_default();
        let fields: HashMap<String, String> = form_urlencoded::parse(&body).into_owned().collect();
        let origin_ok = same_origin(&headers, &self.origin);
        let cookie = cookie(&headers);
        let page_token_ok = match (&cookie, fields.get("form-token")) {
            (Some(cookie), Some(form)) => self.keys.current().check_form_token(token, cookie, form),
            _ => false,
        };
        if !origin_ok || !page_token_ok {
            let origin = headers.get(header::ORIGIN).and_then(|o| o.to_str().ok());
            let fetch_site = headers.get("sec-fetch-site").and_then(|o| o.to_str().ok());
            info!(
                client = %address,
                origin,
                fetch_site,
                expected = self.origin,
                page_token_ok,
                cookie = cookie.is_some(),
                "Fulfilment form refused: not from its page"
            );
            return self.refused(
                if origin_ok {
                    "no_page_token"
                } else {
                    "cross_origin"
                },
                StatusCode::FORBIDDEN,
                "This form was not sent from its page. Open the link from the mail again.",
            );
        }
        let cookie = cookie.unwrap_or_default();
        let form = Form::from_fields(&fields);
        // The patch carries the object's resourceVersion, so every check holds at the write. A
        // conflict (the controller records the request's send right after the mail goes out, so
        // a quick human meets one) reads the object again and checks it all again.
        let mut attempt = 0;
        let (claims, target, result) = loop {
            attempt += 1;
            let (claims, target) = match self.resolve(token).await {
                Ok(found) => found,
                Err(answered) => return answered,
            };
            // Counted once the link opened, by its object: made-up links fill no table.
            if attempt == 1
                && let Err(wait) = self.limiter.allow_link(&claims.uid)
            {
                return (Outcome::Refused("rate_limited"), self.too_many(wait));
            }
            if let Some(values) = target.fulfilment() {
                return (Outcome::Already, self.already(&target, &values).await);
            }
            let patch = match target.apply(&form) {
                Ok(patch) => patch,
                Err(problems) => {
                    let response = self
                        .form_page(
                            &target,
                            token,
                            &cookie,
                            &form.with(problems),
                            StatusCode::UNPROCESSABLE_ENTITY,
                        )
                        .await;
                    return (Outcome::Invalid, response);
                }
            };
            match target.patch(&self.client, &claims, patch).await {
                Err(kube::Error::Api(e)) if e.code == 409 && attempt < PATCH_ATTEMPTS => {
                    tokio::time::sleep(CONFLICT_PAUSE * attempt).await;
                }
                result => break (claims, target, result),
            }
        };
        match result {
            Ok(updated) => {
                let values = updated.fulfilment().unwrap_or_default();
                self.record(&updated, &values, address, &headers).await;
                let body = format!(
                    "<div class=\"done\" role=\"status\">\n<p>Recorded. Thank you: the {} {} is \
                     marked provisioned shortly.</p>\n</div>\n{}",
                    html::escape(claims.kind.as_str()),
                    html::shown(&claims.name),
                    html::values(&values)
                );
                (
                    Outcome::Fulfilled,
                    self.answer(StatusCode::OK, html::page("Recorded", &body)),
                )
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let problem = "The request kept changing while the values were recorded; check them and send them again.";
                let form = form.with(vec![(None, problem.to_owned())]);
                (
                    Outcome::Invalid,
                    self.form_page(&target, token, &cookie, &form, StatusCode::CONFLICT)
                        .await,
                )
            }
            Err(kube::Error::Api(e)) if e.code == 422 || e.code == 400 => {
                let problem = format!("The API server refused the values: {}", e.message);
                let form = form.with(vec![(None, problem)]);
                (
                    Outcome::Invalid,
                    self.form_page(
                        &target,
                        token,
                        &cookie,
                        &form,
                        StatusCode::UNPROCESSABLE_ENTITY,
                    )
                    .await,
                )
            }
            Err(e) => {
                warn!(error = %e, "Fulfilment page: the patch failed");
                (
                    Outcome::Error,
                    self.answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        html::page(
                            "Try again shortly",
                            "<p>The values could not be recorded just now. Nothing was recorded; send the form again in a moment.</p>\n",
                        ),
                    ),
                )
            }
        }
    }
}

type Answered = (Outcome, Response<Full<Bytes>>);

#[cfg(test)]
mod tests {
    use capm_api::link_token::{Keys, Kind};

    use super::*;

    const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";

    /// A fake API server holding one MailgunCluster: `conflicts` PATCHes answer 409 (after
    /// each, the object moves on a version, as when the controller writes meanwhile), the next
    /// one applies. Returns the page's client and the log of requests (`METHOD path rv`).
    /// With `identity`, the request went through the MailgunClusterIdentity `team-a-mail`.
    fn fake_api(conflicts: usize, identity: bool) -> (Client, Arc<std::sync::Mutex<Vec<String>>>) {
        use http::Request;
        use kube::client::Body;
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&log);
        let mut record = serde_json::json!({
            "messageId": "<mailguncluster.u-1@mg.example.com>", "state": "sent",
            "backendId": "<x@mg.example.com>",
        });
        if identity {
            record["identity"] = "team-a-mail".into();
        }
        let mut object = serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster",
            "metadata": {
                "name": "c", "namespace": "team-a", "uid": "u-1", "resourceVersion": "1",
                "annotations": { capm_api::names::MAIL_ANNOTATION: record.to_string() },
            },
            "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": "dev@example.com" },
        });
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        tokio::spawn(async move {
            let mut left = conflicts;
            while let Some((request, respond)) = handle.next_request().await {
                let (method, path) = (request.method().clone(), request.uri().path().to_owned());
                let query = request
                    .uri()
                    .query()
                    .map(|q| format!("?{q}"))
                    .unwrap_or_default();
                let body: serde_json::Value =
                    serde_json::from_slice(&request.into_body().collect_bytes().await.unwrap())
                        .unwrap_or_default();
                let rv = body["metadata"]["resourceVersion"].as_str().unwrap_or("-");
                let note = body["note"].as_str().unwrap_or_default();
                seen.lock()
                    .unwrap()
                    .push(format!("{method} {path}{query} {rv} {note}"));
                let version = |o: &serde_json::Value| {
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .parse::<u32>()
                        .unwrap()
                };
                let (code, answer) = match method {
                    Method::GET if path.ends_with("/mailgunclusteridentities") => {
                        let list = serde_json::json!({
                            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                            "kind": "MailgunClusterIdentityList", "metadata": {},
                            "items": [{
                                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                                "kind": "MailgunClusterIdentity",
                                "metadata": { "name": "team-a-mail" },
                                "spec": {
                                    "mailgun": { "domain": "mg.example.com", "apiKeySecretRef": { "name": "k", "key": "k" } },
                                    "recipients": ["team-a-builders@example.com"],
                                    "allowedNamespaces": {},
                                },
                            }],
                        });
                        (200, list)
                    }
                    Method::GET if path.contains("/mailgunclusteridentities/") => (
                        403,
                        serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden", "code": 403}),
                    ),
                    Method::GET => (200, object.clone()),
                    Method::PATCH if left > 0 => {
                        left -= 1;
                        let next = version(&object) + 1;
                        object["metadata"]["resourceVersion"] = next.to_string().into();
                        let status = serde_json::json!({
                            "kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "Conflict", "code": 409, "message": "the object has been modified",
                        });
                        (409, status)
                    }
                    Method::PATCH => {
                        assert_eq!(
                            rv, object["metadata"]["resourceVersion"],
                            "a patch on the version read"
                        );
                        object["spec"]["controlPlaneEndpoint"] =
                            body["spec"]["controlPlaneEndpoint"].clone();
                        (200, object.clone())
                    }
                    _ => (201, body),
                };
                let response = Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                    .unwrap();
                respond.send_response(response);
            }
        });
        (Client::new(service, "default"), log)
    }

    /// The page's answer to the form for the MailgunCluster `team-a/c` sent from its page.
    async fn submit_form(client: Client) -> (StatusCode, String) {
        let keys = KeyRing::new(Keys::parse(KEY_A).unwrap());
        let settings = crate::settings::Fulfilment {
            url: "https://capm.example.com".into(),
            secure: true,
            keys_file: "unused".into(),
            bind: None,
            validity: link_token::DEFAULT_VALIDITY,
            trusted_proxies: Vec::new(),
        };
        let page = Page::new(
            client.clone(),
            keys.clone(),
            &settings,
            vec!["ops@example.com".into()],
            Events::new(client, "test", "test"),
            &Registry::new(),
        )
        .unwrap();
        let claims = Claims::new(
            Kind::MailgunCluster,
            "team-a",
            "c",
            "u-1",
            "<mailguncluster.u-1@mg.example.com>",
            u64::MAX / 2,
        );
        let token = keys.current().seal(&claims).unwrap();
        let cookie = new_cookie();
        let form = format!(
            "host=api.example.com&port=6443&form-token={}",
            keys.current().form_token(&token, &cookie)
        );
        let mut req = http::Request::builder()
            .method(Method::POST)
            .uri(format!("{}{token}", link_token::PATH_PREFIX))
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(header::ORIGIN, "https://capm.example.com")
            .header(header::COOKIE, format!("{COOKIE}={cookie}"))
            .body(Full::new(Bytes::from(form)))
            .unwrap();
        req.extensions_mut()
            .insert(Peer(std::net::SocketAddr::from(([192, 0, 2, 1], 40000))));
        let response = page.handle(req).await;
        let status = response.status();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap()
            .to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test(start_paused = true)]
    async fn a_conflict_reads_checks_and_patches_again() {
        let (client, log) = fake_api(2, false);
        let (status, body) = submit_form(client).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(body.contains("Recorded"), "{body}");
        let log = log.lock().unwrap().clone();
        let path =
            "/apis/infrastructure.cluster.x-k8s.io/v1beta1/namespaces/team-a/mailgunclusters/c";
        let writes: Vec<_> = log.iter().filter(|l| l.starts_with("PATCH")).collect();
        assert_eq!(
            writes,
            [1, 2, 3]
                .map(|v| format!("PATCH {path}?&fieldManager={FIELD_MANAGER} {v} "))
                .iter()
                .collect::<Vec<_>>(),
            "each attempt on the version it read: {log:?}"
        );
        assert_eq!(
            log.iter().filter(|l| l.starts_with("GET")).count(),
            3,
            "{log:?}"
        );
        assert!(
            log.iter()
                .any(|l| l.starts_with("POST /apis/events.k8s.io/v1/namespaces/team-a/events")),
            "{log:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_that_keeps_conflicting_records_nothing() {
        let (client, log) = fake_api(usize::MAX, false);
        let (status, body) = submit_form(client).await;
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert!(body.contains("kept changing"), "{body}");
        let log = log.lock().unwrap().clone();
        let patches = log.iter().filter(|l| l.starts_with("PATCH")).count();
        assert_eq!(patches, PATCH_ATTEMPTS as usize, "{log:?}");
        assert!(
            !log.iter().any(|l| l.starts_with("POST")),
            "no Event: {log:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_event_names_the_recipients_of_the_request_identity() {
        let (client, log) = fake_api(0, true);
        let (status, body) = submit_form(client).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let log = log.lock().unwrap().clone();
        let identities = "/apis/infrastructure.cluster.x-k8s.io/v1beta1/mailgunclusteridentities";
        assert!(
            log.iter()
                .any(|l| l.starts_with(&format!("GET {identities}?"))
                    && l.contains("fieldSelector=metadata.name%3Dteam-a-mail")),
            "a one-name list: {log:?}"
        );
        assert!(
            !log.iter().any(|l| l.contains(&format!("{identities}/"))),
            "no get: {log:?}"
        );
        let event = log
            .iter()
            .find(|l| l.starts_with("POST"))
            .expect("an Event");
        assert!(
            event.contains("From 192.0.2.1: Control plane endpoint")
                && event.contains("mailed to team-a-builders@example.com (user agent"),
            "{event}"
        );
    }
}
