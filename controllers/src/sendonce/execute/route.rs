//! Which identity's backend a mail goes through.

use capm_api::names::reasons;
use tracing::info;

use super::Tracked;
use crate::{
    context::{Ctx, ReconcileError},
    identity::{Access, IdentityError, Route, Wanted},
    kinds::Mailed,
    sendonce::{Which, records::read_records},
};

/// The route of the identity the object wants now (`wanted`).
pub(super) async fn current_route(
    ctx: &Ctx,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    let name = wanted.clone().map_err(IdentityError::from)?;
    Ok(ctx
        .identities
        .route(name.as_deref(), namespace, Access::New)
        .await?)
}

/// The route of the identity a record names (`None`: the provider's own configuration), even
/// if the namespace lost access to it since: the same conversation. When that identity is gone,
/// the one the object wants now (which must allow the namespace): the mail must still go out (a
/// release) or be settled (a lookup) somewhere, and the recorded one can no longer say anything.
pub(super) async fn recorded_route(
    ctx: &Ctx,
    recorded: Option<&str>,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    match ctx
        .identities
        .route(recorded, namespace, Access::Recorded)
        .await
    {
        Err(IdentityError::Unusable { reason, .. })
            if reason == reasons::IDENTITY_NOT_FOUND && recorded.is_some() =>
        {
            info!(
                identity = recorded,
                "The identity a mail's record names is gone; using the object's current one"
            );
            current_route(ctx, wanted, namespace).await
        }
        other => Ok(other?),
    }
}

/// The route of a new intent of `which`: the object's current identity for the request; for a
/// follow-up (the release, a reminder), the identity the request went through (or the current one
/// when that is gone): the same conversation.
pub(super) async fn route_for_new<K: Mailed>(
    ctx: &Ctx,
    tracked: &Tracked,
    which: Which,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    if let Some(first) = which.follows() {
        let request = read_records(&tracked.annotations, K::KIND, first);
        if request.intent.is_some() || request.sent.is_some() {
            let recorded = request
                .sent
                .and_then(|s| s.identity)
                .or_else(|| request.intent.and_then(|i| i.identity));
            return recorded_route(ctx, recorded.as_deref(), wanted, namespace).await;
        }
    }
    current_route(ctx, wanted, namespace).await
}
