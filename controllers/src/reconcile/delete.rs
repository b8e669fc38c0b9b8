//! `reconcile_delete`: the release mail, then our finalizer.

use capm_api::names::{RETRY_ANNOTATION, reasons};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::controller::Action;
use serde_json::json;
use tracing::{debug, info, warn};

use super::{Pass, Report};
use crate::{
    context::{Ctx, ReconcileError},
    events::EventType,
    identity::IdentityError,
    kinds::InfraKind,
    sendonce::{
        Which,
        decide::{Release, Withheld, release_needed},
        execute::{Tracked, ensure_sent, patch_metadata},
        records::{IntentState, read_records},
    },
};

/// The object is going: its request released once (when it went out, or may have), then our
/// finalizer removed.
pub(super) async fn reconcile_delete<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
) -> Result<Pass, ReconcileError> {
    let mut tracked = Tracked::of(obj, report.annotations.clone());
    // A request that went out, or may have (outcome unknown), is released. One that was never
    // attempted, or whose every attempt was refused (recorded durably in the intent), is not:
    // nothing reached the human.
    let request = read_records(&tracked.annotations, K::KIND, Which::Request);
    let release = release_needed(
        request.sent.is_some(),
        request.intent.as_ref().map(|i| i.state),
    );
    if release == Release::Needed {
        let text = obj.deletion_mail();
        let wanted = obj.wanted_identity(&ctx.capi);
        if let Err(error) = ensure_sent(
            obj,
            ctx,
            &mut tracked,
            Which::Deletion,
            &text,
            None,
            &wanted,
        )
        .await
        {
            if let Some((reason, why)) = abandon(obj, ctx, &error) {
                warn!(%why, "Giving up the release mail; the deletion goes on");
                ctx.metrics
                    .releases_abandoned
                    .with_label_values(&[reason])
                    .inc();
                let note = format!(
                    "the release mail could not go out for {:?} after the deletion and was given up: {why}",
                    ctx.config.tenancy.release_timeout
                );
                ctx.publish(obj, EventType::Warning, reasons::RELEASE_ABANDONED, note)
                    .await;
                return remove_finalizer(obj, ctx, &mut tracked).await;
            }
            let message = match &error {
                ReconcileError::Withheld(Withheld::PermanentlyRefused) => {
                    format!(
                        "the release mail was refused permanently; not retried automatically \
                     (a new value of {RETRY_ANNOTATION} retries once; remove the finalizer to give up)"
                    )
                }
                other => other.to_string(),
            };
            report.block(reasons::DELETING, message);
            return match error {
                ReconcileError::Withheld(Withheld::PermanentlyRefused) => Ok(Pass::wait()),
                other => Err(other),
            };
        }
    } else if request
        .intent
        .is_some_and(|i| i.state == IntentState::Refused)
    {
        debug!("The request was never accepted: no release mail");
    }
    remove_finalizer(obj, ctx, &mut tracked).await
}

/// Why the release is given up: it could not go out (its identity cannot be used, its backend
/// fails) and the object was deleted longer than `--release-timeout` ago, with
/// `capm_release_abandoned_total`'s reason.
fn abandon<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    error: &ReconcileError,
) -> Option<(&'static str, String)> {
    let deleted = obj.meta().deletion_timestamp.as_ref()?.0;
    let waited = Timestamp::now().duration_since(deleted);
    let timeout = SignedDuration::try_from(ctx.config.tenancy.release_timeout).ok()?;
    let reason = match error {
        ReconcileError::Identity(IdentityError::Unusable { .. }) => "identity",
        ReconcileError::Mail(_) => "mail",
        _ => return None,
    };
    (waited >= timeout).then(|| (reason, error.to_string()))
}

async fn remove_finalizer<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
) -> Result<Pass, ReconcileError> {
    let mut remaining = tracked.finalizers.clone();
    remaining.retain(|f| f != K::FINALIZER);
    let metadata = json!({ "resourceVersion": tracked.resource_version, "finalizers": remaining });
    match patch_metadata(obj, ctx, tracked, metadata, "removing the finalizer").await {
        Ok(()) => info!("Finalizer removed"),
        Err(e) if e.is_not_found() => debug!("Already gone"),
        Err(e) => return Err(e),
    }
    Ok(Pass {
        action: Action::await_change(),
        gone: true,
    })
}
