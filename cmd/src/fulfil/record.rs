//! What a use of a link leaves behind: a log line and an Event on the object, the client's
//! address first, naming the mail's recipients (the link's holders).

use std::net::IpAddr;

use capm_api::{
    records::{Which, read_records},
    v1beta1::MailgunClusterIdentity,
};
use capm_controllers::EventType;
use http::{HeaderMap, header};
use kube::Api;
use tracing::{info, warn};

use super::{Page, target::Target};

/// The Event recorded on the object when the page fulfils it.
pub const EVENT_REASON: &str = "FulfilledThroughLink";
/// The Event recorded on a `MailgunRemediation` when the page records its answer.
pub const ANSWER_EVENT_REASON: &str = "AnsweredThroughLink";
/// How much of the client's `User-Agent` the Event keeps.
const MAX_AGENT_BYTES: usize = 200;

impl Page {
    /// The Event saying who fulfilled the object: the mail's recipients (the link's holders),
    /// the client's address and user agent.
    pub(super) async fn record(
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
            .publish(
                &target.object_ref(),
                EventType::Normal,
                if target.is_repair() {
                    ANSWER_EVENT_REASON
                } else {
                    EVENT_REASON
                },
                &note,
            )
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
            // A page-only process may not be told the provider's recipients.
            None if self.recipients.is_empty() => vec!["the provider's recipients".to_owned()],
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
}
