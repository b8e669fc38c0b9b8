//! Performs the steps [`super::decide`] chooses: the writes ([`writes`]), the lookup and the
//! send ([`send`]), through the identity the mail belongs to ([`route`]).

mod route;
mod send;
mod writes;

use std::time::Duration;

use capm_api::names::reasons;
use capm_mailer::MessageId;
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt};
use serde_json::json;
use tracing::{debug, info, warn};

pub(crate) use self::writes::patch_metadata;
use self::{
    route::{recorded_route, route_for_new},
    send::send,
    writes::{record_sent, write_intent},
};
use super::{
    Which,
    decide::{Facts, IntentFacts, Step, Withheld, decide, foreign_wait},
    records::{IntentState, Sent, read_records},
};
use crate::{
    context::{Ctx, ReconcileError},
    events::EventType,
    identity::Wanted,
    kinds::{MailText, Mailed},
    ledger::Attempt,
};

/// The object's metadata as this pass last wrote or read it.
pub(crate) struct Tracked {
    pub(crate) resource_version: Option<String>,
    pub(crate) annotations: std::collections::BTreeMap<String, String>,
    pub(crate) finalizers: Vec<String>,
}

impl Tracked {
    /// `obj` as the pass found it, with its `annotations`.
    pub(crate) fn of(
        obj: &impl ResourceExt,
        annotations: std::collections::BTreeMap<String, String>,
    ) -> Self {
        Self {
            resource_version: obj.resource_version(),
            annotations,
            finalizers: obj.finalizers().to_vec(),
        }
    }

    pub(crate) fn has_finalizer(&self, finalizer: &str) -> bool {
        self.finalizers.iter().any(|f| f == finalizer)
    }
}

/// What [`ensure_sent`] established.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) message_id: String,
    /// When the backend accepted it, when known.
    pub(crate) at: Option<Timestamp>,
    /// The identity it went through; `None` for the provider's own configuration.
    pub(crate) identity: Option<String>,
}

/// Whether the owner allows a new request: checked in the cache by the caller and once more
/// against the API server right before the intent is written.
pub(crate) struct OwnerCheck {
    /// The cached owner is being deleted.
    pub(crate) deleting_in_cache: bool,
    /// The owner's name and UID from our ownerReference, for the live check.
    pub(crate) name: String,
    pub(crate) uid: String,
}

/// How long before `now` the time `at` was (zero for a time in the future).
pub(crate) fn age(now: Timestamp, at: Timestamp) -> Duration {
    let ms = now.as_millisecond().saturating_sub(at.as_millisecond());
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// Sends one of the object's mails at most once, crash-safely (see the module docs of
/// [`super`]). Returns what is known of the accepted mail; an `Err` leaves the records in a state
/// the next call continues from.
pub(crate) async fn ensure_sent<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    text: &MailText,
    owner: Option<&OwnerCheck>,
    wanted: &Wanted,
) -> Result<Outcome, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    let namespace = obj.namespace().unwrap_or_default();
    let generation = obj.meta().generation.unwrap_or_default();
    let attempt = Attempt::of(obj.meta());
    let refused_at = ctx.ledger.refused_at(&uid, which);
    let leadership = &ctx.leadership;
    let mut lookup = None;
    // Each step either returns or changes the facts; a few rounds always suffice.
    for _ in 0..6 {
        let found = read_records(&tracked.annotations, K::KIND, which);
        let now = Timestamp::now();
        // Only an unsent intent in state `sending` of another writer can make us wait; only
        // then is its first sight remembered (not for every object ever mailed).
        let intent_facts = found.intent.as_ref().map(|i| IntentFacts {
            state: i.state,
            foreign_wait: if found.sent.is_some()
                || i.state != IntentState::Sending
                || i.writer.as_deref() == Some(leadership.identity())
            {
                Duration::ZERO
            } else {
                foreign_wait(
                    i.writer.as_deref(),
                    leadership.identity(),
                    i.at.map(|at| age(now, at)),
                    ctx.ledger.first_seen_ago(&uid, which),
                    leadership.handover(),
                )
            },
        });
        let facts = Facts {
            sent: found.sent.is_some(),
            intent: intent_facts,
            leading: leadership.may_act(),
            owner_deleting: owner.is_some_and(|o| o.deleting_in_cache),
            has_finalizer: tracked.has_finalizer(K::FINALIZER),
            permanently_refused: refused_at == Some(attempt),
            backoff_left: ctx.ledger.backoff_left(&uid),
            lookup: lookup.clone(),
            not_found_for: ctx.ledger.not_found_for(&uid, which),
            lookup_grace: ctx.config.lookup_grace,
        };
        let id = found
            .intent
            .as_ref()
            .map(|i| i.message_id.clone())
            .unwrap_or_else(|| which.message_id(K::KIND, &uid, &ctx.config.message_id_domain));
        let step = decide(&facts);
        debug!(mail = which.label(), ?step, "Send-once step");
        match step {
            Step::Done => {
                let sent = found.sent.as_ref();
                return Ok(Outcome {
                    message_id: sent.and_then(|s| s.message_id.clone()).unwrap_or(id),
                    at: sent.and_then(|s| s.at),
                    identity: sent.and_then(|s| s.identity.clone()),
                });
            }
            Step::Withhold(why) => return Err(withheld::<K>(ctx, why)),
            Step::WriteIntent => {
                if let Some(owner) = owner
                    && !owner_alive::<K>(ctx, obj, owner).await?
                {
                    return Err(withheld::<K>(ctx, Withheld::OwnerDeleting));
                }
                // The identity is settled before the intent: a problem with it shows with no
                // record written.
                let route = route_for_new::<K>(ctx, tracked, which, wanted, &namespace).await?;
                write_intent(obj, ctx, tracked, which, &id, &route).await?;
                crate::failpoint::hit("after-intent");
                return send(obj, ctx, tracked, which, text, &id, true, &route).await;
            }
            Step::EnsureFinalizer => {
                let mut finalizers = tracked.finalizers.clone();
                finalizers.push(K::FINALIZER.to_owned());
                patch_metadata(
                    obj,
                    ctx,
                    tracked,
                    json!({ "resourceVersion": tracked.resource_version, "finalizers": finalizers }),
                    "adding the finalizer under an existing intent",
                )
                .await?;
            }
            Step::Rearm => {
                if refused_at.is_some_and(|r| r.generation == generation) {
                    let note = format!("Retrying the refused {} mail once", which.label());
                    ctx.publish(obj, EventType::Normal, reasons::MAIL_RETRIED, note)
                        .await;
                }
                let route = route_for_new::<K>(ctx, tracked, which, wanted, &namespace).await?;
                write_intent(obj, ctx, tracked, which, &id, &route).await?;
                return send(obj, ctx, tracked, which, text, &id, true, &route).await;
            }
            Step::AwaitHandover(wait) => {
                ctx.metrics
                    .withheld
                    .with_label_values(&[K::CONTROLLER, "handover"])
                    .inc();
                return Err(ReconcileError::AwaitingHandover(wait));
            }
            Step::Lookup => {
                let message_id = MessageId::parse(&id).map_err(ReconcileError::Message)?;
                // Asked of the backend the pending attempt went through.
                let recorded = found.intent.as_ref().and_then(|i| i.identity.as_deref());
                let route = recorded_route(ctx, recorded, wanted, &namespace).await?;
                lookup = Some(
                    route
                        .mailer
                        .lookup(&message_id)
                        .await
                        .map_err(ReconcileError::Mail)?,
                );
            }
            Step::RecordFound => {
                info!(%id, "The backend already accepted the pending mail");
                ctx.ledger.clear_mail(&uid, which);
                let identity = found.intent.as_ref().and_then(|i| i.identity.clone());
                let sent = Sent {
                    message_id: Some(id.clone()),
                    backend_id: id.clone(),
                    at: None,
                    identity: identity.clone(),
                };
                record_sent(obj, ctx, tracked, which, &sent).await?;
                return Ok(Outcome {
                    message_id: id,
                    at: None,
                    identity,
                });
            }
            Step::StartLookupGrace(wait) => {
                ctx.ledger.start_not_found(&uid, which);
                return Err(ReconcileError::AwaitingLookup(wait));
            }
            Step::AwaitLookupGrace(wait) => return Err(ReconcileError::AwaitingLookup(wait)),
            Step::Resend => {
                ctx.metrics
                    .resends
                    .with_label_values(&[K::CONTROLLER])
                    .inc();
                warn!(%id, "Sending again with the same Message-Id: the earlier outcome is unknown");
                // Through the backend of the attempt whose outcome is unknown.
                let recorded = found.intent.as_ref().and_then(|i| i.identity.as_deref());
                let route = recorded_route(ctx, recorded, wanted, &namespace).await?;
                return send(obj, ctx, tracked, which, text, &id, false, &route).await;
            }
        }
    }
    Err(ReconcileError::Conflict("deciding the next send-once step"))
}

pub(super) fn withheld<K: Mailed>(ctx: &Ctx, why: Withheld) -> ReconcileError {
    let label = match why {
        Withheld::NotLeading => "not_leading",
        Withheld::OwnerDeleting => "owner_deleting",
        Withheld::PermanentlyRefused => "permanently_refused",
        Withheld::Backoff(_) => "backoff",
    };
    ctx.metrics
        .withheld
        .with_label_values(&[K::CONTROLLER, label])
        .inc();
    ReconcileError::Withheld(why)
}

/// Asks the API server (not the cache) whether the owner still exists, is the one our
/// ownerReference names, and is not being deleted.
async fn owner_alive<K: Mailed>(
    ctx: &Ctx,
    obj: &K,
    owner: &OwnerCheck,
) -> Result<bool, ReconcileError> {
    let api: Api<K::Owner> =
        Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let live = api
        .get_metadata_opt(&owner.name)
        .await
        .map_err(ReconcileError::kube("reading the owner before the request"))?;
    Ok(live.is_some_and(|o| {
        o.metadata.uid.as_deref() == Some(owner.uid.as_str())
            && o.metadata.deletion_timestamp.is_none()
    }))
}
