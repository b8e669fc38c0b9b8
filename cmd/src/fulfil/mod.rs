//! The fulfilment page: `GET /fulfil/<token>` shows what was asked and a form; `POST` records
//! what the human built (or, for a repair request, the answer: repaired or cannot repair) by
//! patching the object as the provider. The token is the capability
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
mod routes;
mod target;
mod views;

use std::{collections::HashMap, sync::Arc, time::Duration};

use axum::{
    Extension, Form as PostedForm, Router,
    extract::{State, rejection::FormRejection},
    response::IntoResponse,
};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use bytes::Bytes;
use capm_api::link_token::{self, Claims, FulfilError, KeyRing};
use capm_controllers::Events;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use kube::Client;
use prometheus::{IntCounterVec, Opts, Registry};
use tracing::{info, warn};

use csrf::{COOKIE, cookie, new_cookie, same_origin};
pub use keys::{KeyFile, KeyReload};
pub use limiter::Limiter;
use routes::{Answer, ClientAddress, Link};
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

/// What the page answers, counted in `capm_fulfilment_requests_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Form,
    Invalid,
    Fulfilled,
    Already,
    Answered,
    AlreadyAnswered,
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
            Self::Answered => "answered",
            Self::AlreadyAnswered => "already_answered",
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

    /// The page's routes, for the server.
    pub fn router(self: Arc<Self>) -> Router {
        routes::router(self)
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

    fn answer_with(&self, outcome: Outcome, status: StatusCode, body: String) -> Answer {
        Answer(outcome, self.answer(status, body))
    }

    /// 429, with the seconds until the next attempt is allowed.
    fn too_many(&self, wait: Duration) -> Answer {
        let mut r = self.answer(
            StatusCode::TOO_MANY_REQUESTS,
            html::refusal("Too many attempts for now; try again in a few minutes."),
        );
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        Answer(Outcome::Refused("rate_limited"), r)
    }

    fn refused(&self, reason: &'static str, status: StatusCode, message: &str) -> Answer {
        self.answer_with(Outcome::Refused(reason), status, html::refusal(message))
    }

    /// Finds the object of an opened link, still the one it was made for.
    async fn resolve(&self, claims: &Claims) -> Result<Target, Answer> {
        let target = match Target::get(&self.client, claims).await {
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
                return Err(Answer(
                    Outcome::Error,
                    self.answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        html::notice(
                            "Try again shortly",
                            "The request could not be read just now. Nothing was recorded.",
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
        if let Some(message) = target.closed() {
            return Err(self.refused("closed", StatusCode::GONE, message));
        }
        Ok(target)
    }

    /// `GET /fulfil/{token}`: the form, and the cookie its token is bound to.
    async fn show(State(page): State<Arc<Self>>, jar: CookieJar, link: Link) -> impl IntoResponse {
        let target = match page.resolve(&link.claims).await {
            Ok(target) => target,
            Err(answer) => return (jar, answer),
        };
        if let Some(values) = target.fulfilment() {
            return (jar, page.already(&target, &values).await);
        }
        let cookie = cookie(&jar).unwrap_or_else(new_cookie);
        let response = page
            .form_page(
                &target,
                &link.token,
                &cookie,
                &Form::default(),
                StatusCode::OK,
            )
            .await;
        let cookie = Cookie::build((COOKIE, cookie))
            .path(link_token::PATH_PREFIX)
            .http_only(true)
            .same_site(SameSite::Strict)
            .secure(page.secure_cookie);
        (jar.add(cookie), Answer(Outcome::Form, response))
    }

    /// `POST /fulfil/{token}`: the values, from the page's own form, recorded on the object.
    async fn submit(
        State(page): State<Arc<Self>>,
        Extension(ClientAddress(address)): Extension<ClientAddress>,
        headers: HeaderMap,
        jar: CookieJar,
        link: Link,
        fields: Result<PostedForm<HashMap<String, String>>, FormRejection>,
    ) -> Answer {
        page.record_values(address, &headers, &jar, link, fields)
            .await
    }

    async fn record_values(
        &self,
        address: std::net::IpAddr,
        headers: &HeaderMap,
        jar: &CookieJar,
        link: Link,
        fields: Result<PostedForm<HashMap<String, String>>, FormRejection>,
    ) -> Answer {
        let Link { token, claims } = link;
        let fields = match fields {
            Ok(PostedForm(fields)) => fields,
            Err(FormRejection::InvalidFormContentType(_)) => {
                return self.refused(
                    "not_a_form",
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "Send the values with the page's form.",
                );
            }
            Err(_) => {
                return self.refused(
                    "not_a_form",
                    StatusCode::BAD_REQUEST,
                    "Send the values with the page's form.",
                );
            }
        };
        let origin_ok = same_origin(headers, &self.origin);
        let cookie = cookie(jar);
        let page_token_ok = match (&cookie, fields.get("form-token")) {
            (Some(cookie), Some(form)) => {
                self.keys.current().check_form_token(&token, cookie, form)
            }
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
        let (target, result) = loop {
            attempt += 1;
            let target = match self.resolve(&claims).await {
                Ok(target) => target,
                Err(answer) => return answer,
            };
            // Counted once the link opened, by its object: made-up links fill no table.
            if attempt == 1
                && let Err(wait) = self.limiter.allow_link(&claims.uid)
            {
                return self.too_many(wait);
            }
            if let Some(values) = target.fulfilment() {
                return self.already(&target, &values).await;
            }
            let patch = match target.apply(&form) {
                Ok(patch) => patch,
                Err(problems) => {
                    let response = self
                        .form_page(
                            &target,
                            &token,
                            &cookie,
                            &form.with(problems),
                            StatusCode::UNPROCESSABLE_ENTITY,
                        )
                        .await;
                    return Answer(Outcome::Invalid, response);
                }
            };
            match target.patch(&self.client, &claims, patch).await {
                Err(kube::Error::Api(e)) if e.code == 409 && attempt < PATCH_ATTEMPTS => {
                    tokio::time::sleep(CONFLICT_PAUSE * attempt).await;
                }
                result => break (target, result),
            }
        };
        match result {
            Ok(updated) => {
                let values = updated.fulfilment().unwrap_or_default();
                self.record(&updated, &values, address, headers).await;
                self.recorded(&updated, &values)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let problem = "The request kept changing while the values were recorded; check them and send them again.";
                let form = form.with(vec![(None, problem.to_owned())]);
                Answer(
                    Outcome::Invalid,
                    self.form_page(&target, &token, &cookie, &form, StatusCode::CONFLICT)
                        .await,
                )
            }
            Err(kube::Error::Api(e)) if e.code == 422 || e.code == 400 => {
                // Recorded meanwhile (a second answer meets the set-once rule): the page says
                // so, as for any use after the first.
                if let Ok(now) = self.resolve(&claims).await
                    && let Some(values) = now.fulfilment()
                {
                    return self.already(&now, &values).await;
                }
                let problem = format!("The API server refused the values: {}", e.message);
                let form = form.with(vec![(None, problem)]);
                Answer(
                    Outcome::Invalid,
                    self.form_page(
                        &target,
                        &token,
                        &cookie,
                        &form,
                        StatusCode::UNPROCESSABLE_ENTITY,
                    )
                    .await,
                )
            }
            Err(e) => {
                warn!(error = %e, "Fulfilment page: the patch failed");
                Answer(
                    Outcome::Error,
                    self.answer(
                        StatusCode::SERVICE_UNAVAILABLE,
                        html::notice(
                            "Try again shortly",
                            "The values could not be recorded just now. Nothing was recorded; send the form again in a moment.",
                        ),
                    ),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use capm_api::link_token::{Keys, Kind};
    use http::Method;

    use super::*;

    const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";

    /// The log of the requests a fake API server answered.
    type Log = Arc<std::sync::Mutex<Vec<String>>>;

    /// A fake API server: `answer` gives each request's (status code, JSON body) from its
    /// method, path, query (`?...` or empty) and JSON body. Returns the page's client.
    fn fake_server(
        mut answer: impl FnMut(&Method, &str, &str, &serde_json::Value) -> (u16, serde_json::Value)
        + Send
        + 'static,
    ) -> Client {
        use http::Request;
        use kube::client::Body;
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        tokio::spawn(async move {
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
                let (code, answer) = answer(&method, &path, &query, &body);
                let response = Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(Body::from(serde_json::to_vec(&answer).unwrap()))
                    .unwrap();
                respond.send_response(response);
            }
        });
        Client::new(service, "default")
    }

    /// The API server's refusal: a `Status` of `code` and `reason`.
    fn failure(code: u16, reason: &str) -> (u16, serde_json::Value) {
        let status = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "reason": reason, "code": code, "message": "refused",
        });
        (code, status)
    }

    /// A fake API server holding one MailgunCluster: `conflicts` PATCHes answer 409 (after
    /// each, the object moves on a version, as when the controller writes meanwhile), the next
    /// one applies. Returns the page's client and the log of requests (`METHOD path rv`).
    /// With `identity`, the request went through the MailgunClusterIdentity `team-a-mail`.
    fn fake_api(conflicts: usize, identity: bool) -> (Client, Log) {
        let log = Log::default();
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
        let mut left = conflicts;
        let client = fake_server(move |method, path, query, body| {
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
            match *method {
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
                Method::GET if path.contains("/mailgunclusteridentities/") => {
                    failure(403, "Forbidden")
                }
                Method::GET => (200, object.clone()),
                Method::PATCH if left > 0 => {
                    left -= 1;
                    let next = version(&object) + 1;
                    object["metadata"]["resourceVersion"] = next.to_string().into();
                    failure(409, "Conflict")
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
                _ => (201, body.clone()),
            }
        });
        (client, log)
    }

    /// The page's answer to the form for the MailgunCluster `team-a/c` sent from its page.
    async fn submit_form(client: Client) -> (StatusCode, String) {
        let claims = Claims::new(
            Kind::MailgunCluster,
            "team-a",
            "c",
            "u-1",
            "<mailguncluster.u-1@mg.example.com>",
            u64::MAX / 2,
        );
        submit(client, &claims, "host=api.example.com&port=6443").await
    }

    /// The page's answer to `fields` posted from its page for the link of `claims`.
    async fn submit(client: Client, claims: &Claims, fields: &str) -> (StatusCode, String) {
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
        let token = keys.current().seal(claims).unwrap();
        let cookie = new_cookie();
        let form = format!(
            "{fields}&form-token={}",
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
            .insert(axum::extract::ConnectInfo(std::net::SocketAddr::from((
                [192, 0, 2, 1],
                40000,
            ))));
        let response =
            tower::ServiceExt::oneshot(Arc::new(page).router(), req.map(axum::body::Body::new))
                .await
                .unwrap();
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

    /// What a fake API server answers a PATCH of the remediation: `Apply` it, refuse it with
    /// 409 after someone else answered (`CannotRepair`, the version moved on), or refuse it with
    /// 422 as the set-once rule would, the other answer already stored.
    #[derive(Clone, Copy)]
    enum OnPatch {
        Apply,
        AnsweredMeanwhile,
        SetOnceRefusal,
    }

    /// A fake API server holding one MailgunRemediation `team-a/m-0` (UID `u-1`, its repair
    /// mail recorded) whose Machine `m-0` is unhealthy. Returns the page's client and the log.
    fn fake_remediation_api(on_patch: OnPatch) -> (Client, Log) {
        let log = Log::default();
        let seen = Arc::clone(&log);
        let record = serde_json::json!({
            "messageId": "<mailgunremediation.u-1@mg.example.com>", "state": "sent",
            "backendId": "<x@mg.example.com>",
        });
        let mut object = serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
            "metadata": {
                "name": "m-0", "namespace": "team-a", "uid": "u-1", "resourceVersion": "1",
                "labels": { "cluster.x-k8s.io/cluster-name": "c" },
                "annotations": { capm_api::names::MAIL_ANNOTATION: record.to_string() },
                "ownerReferences": [{
                    "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "name": "m-0",
                    "uid": "machine-uid",
                }],
            },
            "spec": { "priority": "Urgent", "request": "Power-cycle it <please>." },
            "status": { "phase": "WaitingForAnswer" },
        });
        let machine = serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": { "name": "m-0", "namespace": "team-a", "uid": "machine-uid" },
            "spec": { "clusterName": "c", "providerID": "dc://rack4/slot12" },
            "status": {
                "nodeRef": { "name": "node-12" },
                "conditions": [{
                    "type": "HealthCheckSucceeded", "status": "False",
                    "reason": "UnhealthyNode", "message": "Condition Ready on Node is reporting status False for more than 5m0s",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }],
            },
        });
        let mut patched = false;
        let client = fake_server(move |method, path, _, body| {
            seen.lock().unwrap().push(format!(
                "{method} {path} {} {}",
                body["spec"]["answer"], body["reason"]
            ));
            match *method {
                Method::GET if path.ends_with("/machines/m-0") => (200, machine.clone()),
                Method::GET if path.contains("mailgunclusteridentities") => {
                    failure(403, "Forbidden")
                }
                Method::GET => (200, object.clone()),
                Method::PATCH if !patched && !matches!(on_patch, OnPatch::Apply) => {
                    patched = true;
                    object["spec"]["answer"] =
                        serde_json::json!({"result": "CannotRepair", "message": "gone"});
                    object["metadata"]["resourceVersion"] = "2".into();
                    match on_patch {
                        OnPatch::SetOnceRefusal => failure(422, "Invalid"),
                        _ => failure(409, "Conflict"),
                    }
                }
                Method::PATCH => {
                    object["spec"]["answer"] = body["spec"]["answer"].clone();
                    (200, object.clone())
                }
                _ => (201, body.clone()),
            }
        });
        (client, log)
    }

    fn repair_claims(kind: Kind) -> Claims {
        Claims::new(
            kind,
            "team-a",
            "m-0",
            "u-1",
            "<mailgunremediation.u-1@mg.example.com>",
            u64::MAX / 2,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_repair_link_records_the_answer_once() {
        let (client, log) = fake_remediation_api(OnPatch::Apply);
        let claims = repair_claims(Kind::MailgunRemediation);
        let (status, body) = submit(
            client,
            &claims,
            "result=Repaired&message=Replaced+the+PSU.%0D%0ABack+up.",
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        assert!(
            body.contains("Answer recorded")
                && body.contains("watched until its health check passes"),
            "{body}"
        );
        assert!(body.contains("Replaced the PSU."), "{body}");
        let log = log.lock().unwrap().clone();
        let path = "/apis/infrastructure.cluster.x-k8s.io/v1beta1/namespaces/team-a/mailgunremediations/m-0";
        assert!(
            log.iter().any(|l| l
                == &format!(
                    "PATCH {path} {} null",
                    serde_json::json!({"result": "Repaired", "message": "Replaced the PSU.\nBack up."})
                )),
            "the answer, its line break a LF: {log:?}"
        );
        assert!(
            log.iter().any(|l| l
                .starts_with("POST /apis/events.k8s.io/v1/namespaces/team-a/events")
                && l.ends_with("\"AnsweredThroughLink\"")),
            "{log:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_second_answer_shows_already_answered_never_an_error() {
        for on_patch in [OnPatch::AnsweredMeanwhile, OnPatch::SetOnceRefusal] {
            let (client, log) = fake_remediation_api(on_patch);
            let claims = repair_claims(Kind::MailgunRemediation);
            let (status, body) = submit(client, &claims, "result=Repaired").await;
            assert_eq!(status, StatusCode::OK, "{body}");
            assert!(body.contains("Already answered"), "{body}");
            assert!(
                body.contains("Cannot repair") && body.contains("gone"),
                "{body}"
            );
            // What happened, read from the Machine; the request's text escaped.
            for want in [
                "<dt>Machine</dt><dd>m-0</dd>",
                "<dt>Cluster</dt><dd>c</dd>",
                "<dt>Node</dt><dd>node-12</dd>",
                "<dt>Provider ID</dt><dd>dc://rack4/slot12</dd>",
                "UnhealthyNode: Condition Ready on Node is reporting status False",
                "<dt>Phase</dt><dd>WaitingForAnswer</dd>",
                "Power-cycle it &#60;please&#62;.",
            ] {
                assert!(body.contains(want), "{want:?} not in {body}");
            }
            assert!(!body.contains("Requested by"), "{body}");
            let log = log.lock().unwrap().clone();
            assert_eq!(
                log.iter().filter(|l| l.starts_with("PATCH")).count(),
                1,
                "{log:?}"
            );
            assert!(
                !log.iter().any(|l| l.starts_with("POST")),
                "no Event: {log:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_repair_form_is_judged_and_a_link_of_another_kind_answers_nothing() {
        let (client, log) = fake_remediation_api(OnPatch::Apply);
        let claims = repair_claims(Kind::MailgunRemediation);
        let (status, body) = submit(client.clone(), &claims, "result=Maybe").await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(body.contains("Choose repaired or cannot repair."), "{body}");
        assert!(
            body.contains("<h1>A machine needs repair</h1>")
                && body.contains("<select id=\"result\" name=\"result\"")
                && body.contains("<dt>Node</dt><dd>node-12</dd>"),
            "{body}"
        );
        let long = "x".repeat(capm_api::limits::MAX_ANSWER_MESSAGE_LENGTH as usize + 1);
        let (status, body) = submit(
            client.clone(),
            &claims,
            &format!("result=CannotRepair&message={long}"),
        )
        .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
        assert!(body.contains("spec.answer.message"), "{body}");
        // A machine's link sealed for the same namespace, name and UID: it reads a
        // MailgunMachine, never the remediation.
        let (status, body) = submit(
            client,
            &repair_claims(Kind::MailgunMachine),
            "result=Repaired",
        )
        .await;
        assert_ne!(status, StatusCode::OK, "{body}");
        let log = log.lock().unwrap().clone();
        assert!(!log.iter().any(|l| l.starts_with("PATCH")), "{log:?}");
        assert!(
            log.iter().any(|l| l.contains("/mailgunmachines/m-0")),
            "{log:?}"
        );
    }
}
