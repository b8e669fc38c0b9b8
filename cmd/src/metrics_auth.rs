//! `/metrics` authentication and authorization, the Cluster API way: the diagnostics endpoint
//! over HTTPS, only for callers the API server vouches for.
//!
//! Each request needs `Authorization: Bearer <token>`. The token goes to the API server in a
//! `TokenReview` (who is this?), then the user in a `SubjectAccessReview` for the request's
//! verb (`get` for GET and HEAD) on the non-resource URL (the request path), as
//! controller-runtime's `filters.WithAuthenticationAndAuthorization` does. No token, or one
//! the API server does not accept: 401. A user without the permission: 403. The API server
//! not answering: 500 (not cached).
//!
//! Answers are cached per token, verb and path, so a scrape every few seconds costs the API
//! server two requests a minute rather than two per scrape: allowed for [`ALLOWED_TTL`],
//! refused for [`REFUSED_TTL`] (short, so a newly granted permission works soon). The cache
//! keys are SHA-256 digests: the process keeps no token after the request.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use axum::{
    Router,
    extract::{Request, State},
    middleware::Next,
    response::Response,
};
use http::{HeaderMap, Method, StatusCode, header};
use k8s_openapi::api::{
    authentication::v1::{TokenReview, TokenReviewSpec},
    authorization::v1::{NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec},
};
use kube::api::{Api, PostParams};
use tracing::{debug, warn};

use crate::server::text;

/// How long an allowed token + verb + path is trusted without asking again.
pub const ALLOWED_TTL: Duration = Duration::from_secs(60);
/// How long a refusal (401 or 403) is remembered.
pub const REFUSED_TTL: Duration = Duration::from_secs(10);
/// Cached answers at most; beyond, expired ones are dropped, then all.
const MAX_ENTRIES: usize = 4096;

/// What the API server said about one token, verb and path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Allowed,
    /// The token is not valid.
    Unauthenticated,
    /// The user may not; the user name (never the token) for the log.
    Forbidden(String),
}

type Key = [u8; 32];

/// Authenticates and authorizes diagnostics requests through the API server.
pub struct Authorizer {
    client: kube::Client,
    cache: Mutex<HashMap<Key, (Instant, Verdict)>>,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authorizer").finish_non_exhaustive()
    }
}

fn key(token: &str, verb: &str, path: &str) -> Key {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for part in [token, verb, path] {
        ctx.update(&(part.len() as u64).to_be_bytes());
        ctx.update(part.as_bytes());
    }
    let mut out = [0; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// The `Bearer` token of a request, if it has one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The Kubernetes verb for an HTTP method on a non-resource URL: the method in lower case, as
/// the API server and controller-runtime have it.
fn verb(method: &Method) -> String {
    method.as_str().to_ascii_lowercase()
}

fn unauthorized() -> Response {
    let mut response = text(StatusCode::UNAUTHORIZED, "Unauthorized\n");
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

impl Authorizer {
    /// Asks the API server through `client`, which needs `create` on `tokenreviews` and
    /// `subjectaccessreviews` (what the `system:auth-delegator` ClusterRole grants).
    pub fn new(client: kube::Client) -> Self {
        Self {
            client,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn cached(&self, key: &Key) -> Option<Verdict> {
        let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache
            .get(key)
            .filter(|(expires, _)| *expires > Instant::now())
            .map(|(_, verdict)| verdict.clone())
    }

    fn remember(&self, key: Key, verdict: &Verdict) {
        let ttl = match verdict {
            Verdict::Allowed => ALLOWED_TTL,
            Verdict::Unauthenticated | Verdict::Forbidden(_) => REFUSED_TTL,
        };
        let now = Instant::now();
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.len() >= MAX_ENTRIES {
            cache.retain(|_, (expires, _)| *expires > now);
            if cache.len() >= MAX_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(key, (now + ttl, verdict.clone()));
    }

    async fn review(&self, token: &str, verb: &str, path: &str) -> Result<Verdict, kube::Error> {
        let review = Api::<TokenReview>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &TokenReview {
                    spec: TokenReviewSpec {
                        token: token.to_owned(),
                        audiences: None,
                    },
                    ..TokenReview::default()
                },
            )
            .await?;
        let Some(status) = review.status else {
            return Ok(Verdict::Unauthenticated);
        };
        let (true, Some(user)) = (status.authenticated == Some(true), status.user) else {
            return Ok(Verdict::Unauthenticated);
        };
        let name = user.username.clone().unwrap_or_default();
        let access = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: user.username,
                        groups: user.groups,
                        uid: user.uid,
                        extra: user.extra,
                        non_resource_attributes: Some(NonResourceAttributes {
                            path: Some(path.to_owned()),
                            verb: Some(verb.to_owned()),
                        }),
                        resource_attributes: None,
                    },
                    ..SubjectAccessReview::default()
                },
            )
            .await?;
        Ok(match access.status {
            Some(status) if status.allowed => Verdict::Allowed,
            _ => Verdict::Forbidden(name),
        })
    }

    /// `Ok` when the request may proceed, else the response to send.
    async fn check(&self, req: &http::request::Parts) -> Result<(), Response> {
        let Some(token) = bearer(&req.headers) else {
            return Err(unauthorized());
        };
        let verb = verb(&req.method);
        let path = req.uri.path();
        let key = key(token, &verb, path);
        let verdict = match self.cached(&key) {
            Some(verdict) => verdict,
            None => match self.review(token, &verb, path).await {
                Ok(verdict) => {
                    self.remember(key, &verdict);
                    verdict
                }
                Err(e) => {
                    warn!(error = %e, "Could not review a diagnostics request with the API server");
                    return Err(text(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "Authorization failed: the API server did not answer\n",
                    ));
                }
            },
        };
        match verdict {
            Verdict::Allowed => Ok(()),
            Verdict::Unauthenticated => Err(unauthorized()),
            Verdict::Forbidden(user) => {
                debug!(%user, %verb, %path, "Diagnostics request forbidden");
                Err(text(
                    StatusCode::FORBIDDEN,
                    format!("Forbidden: user {user:?} may not {verb} {path}\n"),
                ))
            }
        }
    }
}

/// `routes`, for requests that `authorizer` lets through (every path: an unknown one is a 404
/// only to a caller the API server vouches for).
pub fn secured(authorizer: Arc<Authorizer>, routes: Router) -> Router {
    routes.layer(axum::middleware::from_fn_with_state(authorizer, authorize))
}

async fn authorize(
    State(authorizer): State<Arc<Authorizer>>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    match authorizer.check(&parts).await {
        Ok(()) => next.run(Request::from_parts(parts, body)).await,
        Err(response) => response,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_separate_token_verb_and_path() {
        assert_ne!(key("ab", "c", "/d"), key("a", "bc", "/d"));
        assert_ne!(key("t", "get", "/metrics"), key("t", "get", "/metricsx"));
        assert_eq!(key("t", "get", "/metrics"), key("t", "get", "/metrics"));
    }

    #[test]
    fn verbs_follow_the_api_server() {
        assert_eq!(verb(&Method::GET), "get");
        assert_eq!(verb(&Method::HEAD), "head");
        assert_eq!(verb(&Method::POST), "post");
    }
}
