//! The fulfilment page: `GET /fulfil/<token>` shows what was asked and a form; `POST` records
//! what the human built by patching the object as the provider. The token is the capability
//! (`capm_api::fulfil`); the object itself says whether it is already fulfilled, so a link is
//! single-use without any state here but the rate limits. docs/fulfilment.md has the threat
//! model.
//!
//! Every refusal writes nothing: a forged, altered, expired or revoked link, an object deleted
//! or recreated since the mail, a form not sent from its page (the form token binds the link to
//! the browser's `SameSite=Strict` cookie), a value the API's own rules refuse, a burst past
//! the rate limits. Bodies and time are bounded by the server's [`crate::server::Limits`].

mod html;
mod limiter;
mod target;

use std::{
    collections::HashMap,
    future::Future,
    net::IpAddr,
    pin::Pin,
    sync::Arc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use capm_api::{
    fulfil::{self, Claims, FulfilError, KeyRing, Keys},
    records::{Which, read_records},
    v1beta1::MailgunClusterIdentity,
};
use capm_controllers::{EventType, Events};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};
use http_body_util::Full;
use kube::{Api, Client};
use prometheus::{IntCounterVec, Opts, Registry};
use tracing::{info, warn};

use crate::server::{Peer, Req};
pub use limiter::Limiter;
use target::{Form, Target};

/// The Event recorded on the object when the page fulfils it.
pub const EVENT_REASON: &str = "FulfilledThroughLink";
/// The browser cookie the form token is bound to.
const COOKIE: &str = "capm_fulfil";
/// Address rows on the machine form.
const ADDRESS_ROWS: usize = 4;
/// How often the key file is looked at.
pub const KEY_RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// How much of the client's `User-Agent` the Event keeps.
const MAX_AGENT_BYTES: usize = 200;
/// The key file is read up to this size (a Secret holds at most 1 MiB; a key line is ~45 bytes).
const MAX_KEY_FILE_BYTES: u64 = 64 * 1024;
/// Patches tried when the object changes under one (each after reading and checking it again).
const PATCH_ATTEMPTS: u32 = 4;
/// The pause before the next attempt, times the attempts so far.
const CONFLICT_PAUSE: Duration = Duration::from_millis(250);
/// The page's field manager for its patches.
const FIELD_MANAGER: &str = "cluster-api-provider-mailgun-fulfilment";

/// The key list's file, and what was last read from it.
#[derive(Debug)]
pub struct KeyFile {
    path: std::path::PathBuf,
    last: Option<Vec<u8>>,
}

impl KeyFile {
    /// The key list in `path`, not read yet.
    pub fn new(path: std::path::PathBuf) -> Self {
        Self { path, last: None }
    }

    /// The key list, if the file changed since the last call (the first call always reads).
    ///
    /// # Errors
    /// The file cannot be read, or holds no usable key list (the error names no key); the
    /// next call reads it again.
    pub fn load(&mut self) -> anyhow::Result<Option<Keys>> {
        let path = self.path.display();
        let mut bytes = Vec::new();
        std::fs::File::open(&self.path)
            .and_then(|f| {
                std::io::Read::read_to_end(
                    &mut std::io::Read::take(f, MAX_KEY_FILE_BYTES + 1),
                    &mut bytes,
                )
            })
            .map_err(|e| anyhow::anyhow!("reading {path}: {e}"))?;
        if bytes.len() as u64 > MAX_KEY_FILE_BYTES {
            anyhow::bail!("{path} is larger than {MAX_KEY_FILE_BYTES} bytes");
        }
        if self.last.as_ref() == Some(&bytes) {
            return Ok(None);
        }
        let keys = Keys::parse(&String::from_utf8_lossy(&bytes))
            .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
        self.last = Some(bytes);
        Ok(Some(keys))
    }
}

/// Looks at `file` every `interval` ([`KEY_RELOAD_INTERVAL`]) and puts a changed, usable key
/// list in `ring` (a Secret's keys rotate without a restart). A broken file keeps the keys in
/// use (logged once until it changes).
pub async fn reload_keys(mut file: KeyFile, ring: KeyRing, interval: Duration) {
    let mut failing = false;
    loop {
        tokio::time::sleep(interval).await;
        match file.load() {
            Ok(Some(keys)) => {
                info!(keys = keys.len(), "Fulfilment keys reloaded");
                ring.replace(keys);
                failing = false;
            }
            Ok(None) => failing = false,
            Err(e) if !failing => {
                warn!(error = %e, "Fulfilment keys not reloaded; the previous ones stay");
                failing = true;
            }
            Err(_) => {}
        }
    }
}

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
        instance: String,
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
            events: Events::new(client.clone(), FIELD_MANAGER, instance),
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
        let Some(token) = req.uri().path().strip_prefix(fulfil::PATH_PREFIX) else {
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
            fulfil::PATH_PREFIX
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

    /// The Event saying who fulfilled the object: the mail's recipients (the link's holders),
    /// the client's address and user agent.
    async fn record(
        &self,
        target: &Target,
        values: &[(String, String)],
        address: IpAddr,
        headers: &HeaderMap,
    ) {
        let recipients = self.recipients_of(target).await;
        // The client's own text: cleaned and cut short, so that it never crowds out the rest.
        let agent = headers
            .get(header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .map_or_else(
                || "none".to_owned(),
                |a| capm_mailer::text::clean(a, MAX_AGENT_BYTES),
            );
        let set = values
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        // The address first: a long recipient list or value is cut from the end, never it.
        let note = format!(
            "From {address}: {set} recorded through the fulfilment link mailed to {recipients} \
             (user agent: {agent})"
        );
        info!(
            client = %address,
            kind = target.kind().as_str(),
            namespace = target.meta().namespace.as_deref().unwrap_or_default(),
            name = target.meta().name.as_deref().unwrap_or_default(),
            uid = target.meta().uid.as_deref().unwrap_or_default(),
            values = set,
            recipients,
            user_agent = agent,
            "Fulfilled through a link"
        );
        if let Err(e) = self
            .events
            .publish(&target.object_ref(), EventType::Normal, EVENT_REASON, &note)
            .await
        {
            warn!(error = %e, "Fulfilment page: recording the Event failed");
        }
    }

    /// Who the request mail went to: its identity's recipients, else the provider's.
    async fn recipients_of(&self, target: &Target) -> String {
        let empty = Default::default();
        let annotations = target.meta().annotations.as_ref().unwrap_or(&empty);
        let records = read_records(annotations, target.kind().as_str(), Which::Request);
        let identity = records
            .sent
            .and_then(|s| s.identity)
            .or(records.intent.and_then(|i| i.identity));
        let recipients = match identity {
            None => self.recipients.clone(),
            Some(name) => self
                .identity_recipients(&name)
                .await
                .unwrap_or_else(|| vec![format!("the recipients of identity {name}")]),
        };
        recipients.join(", ")
    }

    /// The recipients of the identity `name`, read with a `list` of that one name: the role
    /// grants `list` on identities (the controllers watch them), never `get`, so a `get` would
    /// only be denied (and show as a denial in the audit log).
    async fn identity_recipients(&self, name: &str) -> Option<Vec<String>> {
        let api = Api::<MailgunClusterIdentity>::all(self.client.clone());
        let one = kube::api::ListParams::default().fields(&format!("metadata.name={name}"));
        let listed = api.list(&one).await.ok()?;
        listed.items.into_iter().next().map(|i| i.spec.recipients)
    }

    async fn already(&self, target: &Target, values: &[(String, String)]) -> Response<Full<Bytes>> {
        let body = format!(
            "<div class=\"done\" role=\"status\">\n<p>Already recorded: nothing more to do.</p>\n</div>\n{}{}",
            html::values(values),
            html::summary(&target.summary(&self.client).await)
        );
        self.answer(StatusCode::OK, html::page("Already fulfilled", &body))
    }

    async fn form_page(
        &self,
        target: &Target,
        token: &str,
        cookie: &str,
        form: &Form,
        status: StatusCode,
    ) -> Response<Full<Bytes>> {
        let form_token = self.keys.current().form_token(token, cookie);
        let action = format!("{}{token}", fulfil::PATH_PREFIX);
        let problem = |name: &str| {
            form.problems
                .iter()
                .find(|(n, _)| n.as_deref() == Some(name))
                .map(|(_, p)| p.as_str())
        };
        let general = form
            .problems
            .iter()
            .filter(|(n, _)| n.is_none())
            .map(|(_, p)| p.as_str())
            .next();
        let general = general.or_else(|| {
            (!form.problems.is_empty()).then_some("Some values need another look (below).")
        });
        let summary = html::summary(&target.summary(&self.client).await);
        let body = match target {
            Target::Cluster(_) => {
                let fields = [
                    html::Field {
                        name: "host",
                        label: "Control plane host",
                        hint: "The DNS name or IP address of the cluster's API server endpoint (letters, digits, '.', ':' and '-').",
                        value: &form.host,
                        problem: problem("host"),
                        input_type: "text",
                        required: true,
                    },
                    html::Field {
                        name: "port",
                        label: "Control plane port",
                        hint: "The TCP port of the endpoint, 1 to 65535 (usually 6443).",
                        value: &form.port,
                        problem: problem("port"),
                        input_type: "number",
                        required: true,
                    },
                ];
                html::form(&action, &form_token, &fields, &[], general)
            }
            Target::Machine(_) => {
                let fields = [html::Field {
                    name: "provider-id",
                    label: "Provider ID",
                    hint: "How the machine is known to the cluster: <scheme>://<id>, e.g. datacentre://rack4/slot12.",
                    value: &form.provider_id,
                    problem: problem("provider-id"),
                    input_type: "text",
                    required: true,
                }];
                let names: Vec<String> =
                    (0..ADDRESS_ROWS).map(|i| format!("address-{i}")).collect();
                let rows: Vec<_> = (0..ADDRESS_ROWS)
                    .map(|i| {
                        let (type_, address) = form
                            .addresses
                            .get(i)
                            .map_or(("InternalIP", ""), |(t, a)| (t.as_str(), a.as_str()));
                        html::AddressRow {
                            index: i,
                            type_,
                            address,
                            problem: problem(&names[i]),
                        }
                    })
                    .collect();
                html::form(&action, &form_token, &fields, &rows, general)
            }
        };
        let title = match target {
            Target::Cluster(_) => "A cluster was requested",
            Target::Machine(_) => "A machine was requested",
        };
        self.answer(status, html::page(title, &format!("{summary}{body}")))
    }
}

type Answered = (Outcome, Response<Full<Bytes>>);

/// The client behind `peer`: `peer` itself unless it is one of the `trusted` proxies; then the
/// `X-Forwarded-For` entries (all the header's lines, in order) read right to left, each
/// trusted hop skipped, up to the first entry that is not a trusted proxy. An entry that is
/// not an address ends the walk at the last trusted hop (whoever wrote it chose it). Only what
/// trusted proxies appended is believed, whatever a client sent before them.
fn forwarded_client(peer: IpAddr, headers: &HeaderMap, trusted: &[ipnet::IpNet]) -> IpAddr {
    let is_trusted = |address: IpAddr| {
        let address = address.to_canonical();
        trusted.iter().any(|net| net.contains(&address))
    };
    if !is_trusted(peer) {
        return peer;
    }
    let entries = headers
        .get_all("x-forwarded-for")
        .iter()
        .rev()
        .flat_map(|line| line.to_str().unwrap_or("").rsplit(','));
    let mut client = peer;
    for entry in entries {
        let Some(hop) = parse_hop(entry.trim()) else {
            return client;
        };
        client = hop;
        if !is_trusted(hop) {
            return hop;
        }
    }
    client
}

/// An `X-Forwarded-For` entry: an address, possibly with a port (`[::1]:80`, `1.2.3.4:5`).
fn parse_hop(entry: &str) -> Option<IpAddr> {
    entry
        .parse()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
}

/// Whether a POST's headers allow it to come from the page itself (`origin`, normalised as
/// browsers send it). `Origin` when sent must be the page's (`null`, from a sandboxed frame, a
/// `data:` page or a redirect across sites, is refused); `Sec-Fetch-Site` when sent must be
/// `same-origin` (or `none`: the user's own action). Without either (an old browser, curl), the
/// form token decides alone.
fn same_origin(headers: &HeaderMap, origin: &str) -> bool {
    let origin_ok = headers
        .get(header::ORIGIN)
        .is_none_or(|o| o.as_bytes() == origin.as_bytes());
    let site_ok = headers
        .get("sec-fetch-site")
        .is_none_or(|s| matches!(s.as_bytes(), b"same-origin" | b"none"));
    origin_ok && site_ok
}

/// The cookie's value, if it is one this page set.
fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().strip_prefix(COOKIE)?.strip_prefix('='))
        .find(|v| v.len() == 32 && v.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
}

fn new_cookie() -> String {
    rand::random::<[u8; 16]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use capm_api::fulfil::Kind;

    use super::*;

    const KEY_A: &str = "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=";
    const KEY_B: &str = "QkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkI=";

    #[tokio::test]
    async fn a_rotated_key_file_is_used_and_a_broken_one_ignored() {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), KEY_A).unwrap();
        let mut keys = KeyFile::new(file.path().to_owned());
        let ring = KeyRing::new(keys.load().unwrap().unwrap());
        assert!(keys.load().unwrap().is_none(), "unchanged");
        let task = tokio::spawn(reload_keys(keys, ring.clone(), Duration::from_millis(20)));
        let claims = Claims::new(Kind::MailgunCluster, "ns", "c", "u", "<m@d>", u64::MAX);
        let old = ring.current().seal(&claims).unwrap();
        std::fs::write(file.path(), format!("{KEY_B}\n{KEY_A}\n")).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while ring.current().len() != 2 {
            assert!(std::time::Instant::now() < deadline, "not reloaded");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_ne!(ring.current().seal(&claims).unwrap(), old);
        assert!(ring.current().open(&old, SystemTime::now()).is_ok());
        // A broken file keeps the keys in use.
        std::fs::write(file.path(), "not a key").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ring.current().len(), 2);
        task.abort();
        let broken = KeyFile::new(file.path().to_owned())
            .load()
            .unwrap_err()
            .to_string();
        assert!(broken.contains("line 1"), "{broken}");
        assert!(
            !broken.contains(KEY_A) && !broken.contains("not a key"),
            "{broken}"
        );
    }

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
            validity: fulfil::DEFAULT_VALIDITY,
            trusted_proxies: Vec::new(),
        };
        let page = Page::new(
            client,
            keys.clone(),
            &settings,
            vec!["ops@example.com".into()],
            "test".into(),
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
            .uri(format!("{}{token}", fulfil::PATH_PREFIX))
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

    #[test]
    fn x_forwarded_for_is_read_right_to_left_from_trusted_proxies_only() {
        let trusted: Vec<ipnet::IpNet> =
            vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
        let xff = |lines: &[&'static str]| {
            let mut h = HeaderMap::new();
            for line in lines {
                h.append("x-forwarded-for", HeaderValue::from_static(line));
            }
            h
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let (proxy, stranger) = (ip("10.1.2.3"), ip("203.0.113.9"));
        // A peer that is no trusted proxy is the client, whatever it says.
        assert_eq!(
            forwarded_client(stranger, &xff(&["198.51.100.1"]), &trusted),
            stranger
        );
        assert_eq!(
            forwarded_client(stranger, &xff(&["198.51.100.1"]), &[]),
            stranger
        );
        // Through the proxy: the entry it appended, not what the client put before it.
        assert_eq!(
            forwarded_client(proxy, &xff(&["1.1.1.1, 198.51.100.7"]), &trusted),
            ip("198.51.100.7")
        );
        // Two trusted hops (a load balancer, then the Ingress), over two header lines.
        assert_eq!(
            forwarded_client(
                proxy,
                &xff(&["6.6.6.6, 198.51.100.7", "10.9.9.9"]),
                &trusted
            ),
            ip("198.51.100.7")
        );
        assert_eq!(
            forwarded_client(
                ip("::ffff:10.0.0.1"),
                &xff(&["[2001:db8::1]:4711"]),
                &trusted
            ),
            ip("2001:db8::1")
        );
        // Nothing, or garbage, past the trusted hops: the last trusted hop.
        assert_eq!(forwarded_client(proxy, &xff(&[]), &trusted), proxy);
        assert_eq!(
            forwarded_client(proxy, &xff(&["198.51.100.7, junk, 10.2.2.2"]), &trusted),
            ip("10.2.2.2")
        );
    }

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
        assert_eq!(cookie(&headers), Some(good));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("capm_fulfil=<script>"),
        );
        assert_eq!(cookie(&headers), None);
    }
}
