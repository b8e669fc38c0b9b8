//! The page's edge: its route, the [`Link`] extractor that opens the token once and hands its
//! claims on, the gate every request passes (the client's address, its rate limit, the answer
//! counted and a refusal logged), and the security headers as tower-http layers.

use std::{net::IpAddr, net::SocketAddr, sync::Arc, time::SystemTime};

use axum::{
    Router,
    extract::{ConnectInfo, FromRequestParts, Path, Request, State},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::get,
};
use bytes::Bytes;
use capm_api::link_token::{Claims, FulfilError, PATH_PREFIX};
use http::{HeaderValue, Method, StatusCode, header, request::Parts};
use http_body_util::Full;
use tower_http::set_header::SetResponseHeaderLayer;
use tracing::info;

use super::{Outcome, Page, client_address::forwarded_client, html};

/// A page's answer and what it was, for `capm_fulfilment_requests_total{result}`.
pub(super) struct Answer(pub(super) Outcome, pub(super) Response<Full<Bytes>>);

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let Self(outcome, response) = self;
        let mut response = response.into_response();
        response.extensions_mut().insert(outcome);
        response
    }
}

/// The client's address (the peer, or through the trusted proxies), set by the gate.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClientAddress(pub(super) IpAddr);

/// A link that opened: its token (for the form's action and token) and its claims.
pub(super) struct Link {
    pub(super) token: String,
    pub(super) claims: Claims,
}

impl FromRequestParts<Arc<Page>> for Link {
    type Rejection = Answer;

    async fn from_request_parts(parts: &mut Parts, page: &Arc<Page>) -> Result<Self, Answer> {
        let Ok(Path(token)) = Path::<String>::from_request_parts(parts, page).await else {
            return Err(page.refused("invalid", StatusCode::FORBIDDEN, INVALID));
        };
        match page.keys.current().open(&token, SystemTime::now()) {
            Ok(claims) => Ok(Self { token, claims }),
            Err(FulfilError::Expired { .. }) => {
                Err(page.refused("expired", StatusCode::GONE, "This link has expired."))
            }
            Err(_) => Err(page.refused("invalid", StatusCode::FORBIDDEN, INVALID)),
        }
    }
}

const INVALID: &str = "This link is not valid: it was altered, or it was revoked.";

/// The page's router: `GET`/`HEAD` (the form) and `POST` (the values) at `/fulfil/{token}`.
pub(super) fn router(page: Arc<Page>) -> Router {
    let headers = [
        (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("same-origin"),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
    ];
    let csp = HeaderValue::from_str(&page.csp).ok();
    let mut router = Router::new()
        .route(
            &format!("{PATH_PREFIX}{{token}}"),
            get(Page::show).post(Page::submit).fallback(wrong_method),
        )
        .route_layer(axum::middleware::from_fn_with_state(page.clone(), gate))
        .fallback(crate::server::not_found)
        .with_state(page);
    for (name, value) in headers {
        router = router.layer(SetResponseHeaderLayer::overriding(name, value));
    }
    if let Some(csp) = csp {
        router = router.layer(SetResponseHeaderLayer::overriding(
            header::CONTENT_SECURITY_POLICY,
            csp,
        ));
    }
    router
}

async fn wrong_method(State(page): State<Arc<Page>>) -> Answer {
    let Answer(outcome, mut response) = page.answer_with(
        Outcome::Refused("method"),
        StatusCode::METHOD_NOT_ALLOWED,
        html::refusal("Use the link or the form."),
    );
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
    Answer(outcome, response)
}

/// Every request of the page's route: the client's address found, its rate limit checked
/// (methods the page takes), the answer counted and a refusal logged.
async fn gate(State(page): State<Arc<Page>>, mut req: Request, next: Next) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::from([0, 0, 0, 0]), |p| p.0.ip());
    let address = forwarded_client(peer, req.headers(), &page.trusted_proxies);
    req.extensions_mut().insert(ClientAddress(address));
    let method = req.method().clone();
    let takes = [Method::GET, Method::HEAD, Method::POST].contains(&method);
    let limited = takes
        .then(|| {
            page.limiter
                .allow_address(address, method == Method::POST)
                .err()
        })
        .flatten();
    let response = match limited {
        Some(wait) => page.too_many(wait).into_response(),
        None => next.run(req).await,
    };
    let outcome = response
        .extensions()
        .get::<Outcome>()
        .copied()
        .unwrap_or(Outcome::Error);
    page.requests.with_label_values(&[outcome.label()]).inc();
    if let Outcome::Refused(reason) = outcome {
        info!(reason, client = %address, "Fulfilment page refused a request");
    }
    response
}
