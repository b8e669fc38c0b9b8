//! Performs the steps [`super::decide`] chooses: the writes, the lookup and the send.

use std::time::Duration;

use capm_api::names::reasons;
use capm_mailer::{ErrorKind, MailError, Message, MessageId};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, ResourceExt, api::Patch};
use serde_json::json;
use tracing::{debug, info, warn};

use super::{
    Which,
    decide::{Facts, IntentFacts, Step, Withheld, decide, foreign_wait},
    records::{self, Intent, IntentState, RecordError, Sent},
};
use crate::{
    context::{Ctx, ReconcileError},
    events::EventType,
    identity::{IdentityError, Route, Wanted},
    kinds::{InfraKind, MailText},
};

/// The route of the identity the object wants now (`wanted`).
async fn current_route(
    ctx: &Ctx,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    let name = ctx.identities.wanted(wanted, namespace).await?;
    Ok(ctx.identities.route(name.as_deref(), namespace).await?)
}

/// The route of the identity a record names (`None`: the provider's own configuration). When
/// that identity is gone, the one the object wants now: the mail must still go out (a release)
/// or be settled (a lookup) somewhere, and the recorded one can no longer say anything.
async fn recorded_route(
    ctx: &Ctx,
    recorded: Option<&str>,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    match ctx.identities.route(recorded, namespace).await {
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

/// The route of a new intent of `which`: the object's current identity for the request; for the
/// release, the identity the request went through (or the current one when that is gone).
async fn route_for_new<K: InfraKind>(
    ctx: &Ctx,
    tracked: &Tracked,
    which: Which,
    wanted: &Wanted,
    namespace: &str,
) -> Result<Route, ReconcileError> {
    if which == Which::Deletion {
        let request = read_records(&tracked.annotations, K::KIND, Which::Request);
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

/// The object's metadata as this pass last wrote or read it.
pub(crate) struct Tracked {
    pub(crate) resource_version: Option<String>,
    pub(crate) annotations: std::collections::BTreeMap<String, String>,
    pub(crate) finalizers: Vec<String>,
}

impl Tracked {
    /// `obj` as the pass found it, with its `annotations` (the cache keeps them beside it).
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

/// One mail's durable records as found, each either believed or ignored with the reason.
pub(crate) struct Records {
    pub(crate) intent: Option<Intent>,
    pub(crate) sent: Option<Sent>,
    /// Annotations present but not believed: key and reason.
    pub(crate) ignored: Vec<(&'static str, RecordError)>,
}

/// Reads one mail's records from `annotations`: its one record, or release 0.1's intent and
/// sent annotations when there is no record we believe.
pub(crate) fn read_records(
    annotations: &std::collections::BTreeMap<String, String>,
    kind: &str,
    which: Which,
) -> Records {
    let mut ignored = Vec::new();
    if let Some(value) = annotations.get(which.record_key()) {
        match records::parse_record(value, kind, which) {
            Ok((intent, sent)) => {
                return Records {
                    intent: Some(intent),
                    sent,
                    ignored,
                };
            }
            Err(e) => ignored.push((which.record_key(), e)),
        }
    }
    let intent = annotations.get(which.intent_key()).and_then(|v| {
        match records::parse_intent(v, kind, which) {
            Ok(i) => Some(i),
            Err(e) => {
                ignored.push((which.intent_key(), e));
                None
            }
        }
    });
    let sent = annotations.get(which.sent_key()).and_then(|v| {
        match records::parse_sent(v, intent.as_ref()) {
            Ok(s) => Some(s),
            Err(e) => {
                ignored.push((which.sent_key(), e));
                None
            }
        }
    });
    Records {
        intent,
        sent,
        ignored,
    }
}

/// The annotations of one write of a mail's record: the record, and removal of release 0.1's
/// annotations for that mail where the object still has them.
fn record_patch(tracked: &Tracked, which: Which, value: String) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    annotations.insert(which.record_key().to_owned(), value.into());
    for legacy in [which.intent_key(), which.sent_key()] {
        if tracked.annotations.contains_key(legacy) {
            annotations.insert(legacy.to_owned(), serde_json::Value::Null);
        }
    }
    serde_json::Value::Object(annotations)
}

/// What [`ensure_sent`] established.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// Our Message-Id.
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

fn age(now: Timestamp, at: Timestamp) -> Duration {
    let ms = now.as_millisecond().saturating_sub(at.as_millisecond());
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// Sends one of the object's mails at most once, crash-safely (see the module docs of
/// [`super`]). Returns what is known of the accepted mail; an `Err` leaves the records in a state
/// the next call continues from.
pub(crate) async fn ensure_sent<K: InfraKind>(
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
                    ctx.memory.first_seen_ago(&uid, which),
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
            permanently_refused: ctx.memory.permanently_refused(&uid, which, generation),
            backoff_left: ctx.memory.backoff_left(&uid),
            lookup: lookup.clone(),
            not_found_for: ctx.memory.not_found_for(&uid, which),
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
                let sent = found.sent.unwrap_or_else(|| Sent {
                    message_id: None,
                    backend_id: id.clone(),
                    at: None,
                    identity: None,
                });
                return Ok(Outcome {
                    message_id: sent.message_id.unwrap_or(id),
                    at: sent.at,
                    identity: sent.identity,
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
                write_intent(obj, ctx, tracked, which, &id, None, &route).await?;
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
                let route = route_for_new::<K>(ctx, tracked, which, wanted, &namespace).await?;
                write_intent(obj, ctx, tracked, which, &id, Some(generation), &route).await?;
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
                ctx.memory.clear_mail(&uid, which);
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
                ctx.memory.start_not_found(&uid, which);
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

fn withheld<K: InfraKind>(ctx: &Ctx, why: Withheld) -> ReconcileError {
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
async fn owner_alive<K: InfraKind>(
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

/// Writes a fresh intent (`sending`, this process, now) with our finalizer, replacing whatever
/// record the mail had, in one write guarded by `resourceVersion`: the fence
/// between two processes that both believe they lead. `rearm` carries the generation when an
/// earlier, refused intent is re-armed (for the log only).
async fn write_intent<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    id: &str,
    rearm: Option<i64>,
    route: &Route,
) -> Result<(), ReconcileError> {
    let intent = Intent {
        message_id: id.to_owned(),
        writer: Some(ctx.leadership.identity().to_owned()),
        at: Some(Timestamp::now()),
        state: IntentState::Sending,
        identity: route.identity.clone(),
    };
    let mut metadata = json!({
        "resourceVersion": tracked.resource_version,
        "annotations": record_patch(tracked, which, records::intent_value(&intent)),
    });
    if !tracked.has_finalizer(K::FINALIZER) {
        let mut finalizers = tracked.finalizers.clone();
        finalizers.push(K::FINALIZER.to_owned());
        metadata["finalizers"] = json!(finalizers);
    }
    if let Some(generation) = rearm {
        debug!(generation, "Re-arming a refused intent");
    }
    patch_metadata(obj, ctx, tracked, metadata, "recording the mail intent").await
}

/// Merge-patches our object's metadata (guarded by `resourceVersion` when `metadata` carries
/// one) and adopts what the API server wrote.
pub(crate) async fn patch_metadata<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    metadata: serde_json::Value,
    what: &'static str,
) -> Result<(), ReconcileError> {
    ctx.ensure_leading()?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let written = api
        .patch(
            &obj.name_any(),
            &crate::context::patch_params(),
            &Patch::Merge(json!({ "metadata": metadata })),
        )
        .await
        .map_err(ReconcileError::from_write(what))?;
    adopt(ctx, tracked, &written);
    Ok(())
}

/// Sends, right after checking that this process still leads. `fresh`: this attempt follows
/// an intent this pass wrote or re-armed, so a refusal proves nothing was ever accepted.
#[allow(clippy::too_many_arguments)]
async fn send<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    text: &MailText,
    id: &str,
    fresh: bool,
    route: &Route,
) -> Result<Outcome, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    let message = build_message(obj, route, text, id, which)?;
    if !ctx.leadership.may_act() {
        return Err(withheld::<K>(ctx, Withheld::NotLeading));
    }
    match route.mailer.send(&message).await {
        Ok(receipt) => {
            ctx.memory.clear_mail(&uid, which);
            crate::failpoint::hit("after-send");
            let sent = Sent {
                message_id: Some(id.to_owned()),
                backend_id: receipt.message_id.clone(),
                at: Some(Timestamp::now()),
                identity: route.identity.clone(),
            };
            match record_sent(obj, ctx, tracked, which, &sent).await {
                Ok(()) => {}
                Err(ReconcileError::Kube {
                    source: kube::Error::Api(s),
                    ..
                }) if s.code == 404 => {
                    return Err(vanished_after_send(obj, ctx, which, route).await);
                }
                Err(e) => return Err(e),
            }
            let reason = match which {
                Which::Request => reasons::MAIL_SENT,
                Which::Deletion => reasons::DELETION_MAIL_SENT,
            };
            publish(
                ctx,
                obj,
                EventType::Normal,
                reason,
                format!("mailed {} as {}", which.label(), receipt.message_id),
            )
            .await;
            Ok(Outcome {
                message_id: id.to_owned(),
                at: sent.at,
                identity: sent.identity,
            })
        }
        Err(MailError::Abandoned { backend, reason }) => {
            // Frozen or cut off mid-send: the backend has nothing whole, and the intent stays
            // `sending` for the replica that leads now (it waits out the hand-over, then looks
            // the mail up or sends it). Nothing else may be written from here.
            ctx.metrics.abandoned.with_label_values(&[backend]).inc();
            info!(which = which.label(), %reason, "Abandoned the send before its commit point");
            Err(ReconcileError::Withheld(Withheld::NotLeading))
        }
        Err(error) => {
            match error.kind() {
                ErrorKind::UnknownOutcome | ErrorKind::Abandoned => {}
                ErrorKind::Permanent | ErrorKind::Retryable => {
                    if fresh {
                        mark_refused(obj, ctx, tracked, which).await;
                    }
                    if error.kind() == ErrorKind::Permanent {
                        ctx.memory.mark_permanently_refused(
                            &uid,
                            which,
                            obj.meta().generation.unwrap_or_default(),
                        );
                    }
                }
            }
            publish(
                ctx,
                obj,
                EventType::Warning,
                reasons::MAIL_FAILED,
                format!("{} mail: {error}", which.label()),
            )
            .await;
            Err(ReconcileError::Mail(error))
        }
    }
}

/// Records in the intent that the attempt just made was refused before anything was accepted,
/// so deletion knows no release is owed. Best effort: when it cannot be written the intent
/// stays `sending` ("may have gone out"), which errs on the side of a release.
async fn mark_refused<K: InfraKind>(obj: &K, ctx: &Ctx, tracked: &mut Tracked, which: Which) {
    let Some(mut intent) = read_records(&tracked.annotations, K::KIND, which).intent else {
        return;
    };
    intent.state = IntentState::Refused;
    let metadata = json!({
        "resourceVersion": tracked.resource_version,
        "annotations": record_patch(tracked, which, records::intent_value(&intent)),
    });
    if let Err(error) = patch_metadata(obj, ctx, tracked, metadata, "recording the refusal").await {
        debug!(%error, "Could not record the refusal; the intent stays 'sending'");
    }
}

/// The request went out but the object is gone: Cluster API deleted it while (or just after)
/// the intent and finalizer were written, and the API server's delete decision predated our
/// finalizer. Nobody will ever reconcile it again, so the release goes out now (the request was
/// for infrastructure nobody will use). Nothing can be recorded: counted in
/// `capm_mail_orphan_releases_total`.
async fn vanished_after_send<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    which: Which,
    route: &Route,
) -> ReconcileError {
    if which == Which::Request {
        let uid = obj.uid().unwrap_or_default();
        let id = Which::Deletion.message_id(K::KIND, &uid, &ctx.config.message_id_domain);
        let text = obj.deletion_mail();
        info!("The object vanished right after its request went out; sending its release");
        let mut delay = Duration::from_millis(500);
        for attempt in 1..=4 {
            if !ctx.leadership.may_act() {
                break;
            }
            let result = match build_message(obj, route, &text, &id, Which::Deletion) {
                Ok(message) => route.mailer.send(&message).await,
                Err(_) => break,
            };
            match result {
                Ok(_) => {
                    ctx.metrics
                        .orphan_releases
                        .with_label_values(&[K::CONTROLLER])
                        .inc();
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Retryable && attempt < 4 => {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(MailError::Abandoned { backend, reason }) => {
                    ctx.metrics.abandoned.with_label_values(&[backend]).inc();
                    info!(%reason, "Abandoned the release of a vanished object before its commit point");
                    break;
                }
                Err(e) => {
                    warn!(error = %e, "The release of a vanished object could not be sent");
                    break;
                }
            }
        }
    }
    ReconcileError::Gone
}

async fn record_sent<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    sent: &Sent,
) -> Result<(), ReconcileError> {
    // No resourceVersion precondition: a concurrent change (Cluster API adding a label, a human
    // fulfilling) must not make us lose the record. Replacing the intent is safe without one:
    // every record of this mail names the same Message-Id, and that mail was accepted.
    let message_id = sent.message_id.as_deref().unwrap_or(&sent.backend_id);
    let metadata = json!({
        "annotations": record_patch(tracked, which, records::sent_value(message_id, sent)),
    });
    patch_metadata(obj, ctx, tracked, metadata, "recording the mail as sent").await
}

pub(crate) fn adopt<K: InfraKind>(ctx: &Ctx, tracked: &mut Tracked, written: &K) {
    tracked.resource_version = written.resource_version();
    tracked.annotations = written.annotations().clone();
    tracked.finalizers = written.finalizers().to_vec();
    ctx.memory.expect_version(
        &written.uid().unwrap_or_default(),
        written.resource_version().as_deref(),
    );
}

fn build_message<K: InfraKind>(
    obj: &K,
    route: &Route,
    text: &MailText,
    id: &str,
    which: Which,
) -> Result<Message, ReconcileError> {
    // From: the sending side (its domain is the one the backend signs for, so the mail passes
    // DMARC); the requester, whose domain would not, gets the replies.
    let mut builder = Message::builder()
        .from(&route.from)
        .reply_to(obj.requester())
        .subject(&text.subject)
        .text(&text.body)
        .message_id(id)
        .tag(format!("{}-{}", K::CONTROLLER, which.label()))
        .variable("namespace", obj.namespace().unwrap_or_default())
        .variable("name", obj.name_any())
        .variable("priority", obj.priority().as_str());
    for to in &route.recipients {
        builder = builder.to(to);
    }
    builder.build().map_err(ReconcileError::Message)
}

pub(crate) async fn publish<K: InfraKind>(
    ctx: &Ctx,
    obj: &K,
    type_: EventType,
    reason: &'static str,
    note: String,
) {
    if let Err(e) = ctx
        .events
        .publish(&obj.object_ref(&()), type_, reason, note)
        .await
    {
        warn!(error = %e, "Could not record an event");
    }
}
