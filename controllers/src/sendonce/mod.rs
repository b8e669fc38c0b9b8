//! "Send exactly one mail", crash-safely and across leader changes, per mail (the request, and
//! the release sent during deletion): an intent written before the send in one write guarded by
//! `resourceVersion` (the fence between two processes that both believe they lead), the send only
//! while [`crate::Leadership::may_act`], then the sent record in the same annotation
//! ([`records`]). An intent without a sent record is waited on (another holder may still be
//! sending), looked up, or sent again under the **same** Message-Id. The protocol step by step,
//! and what it cannot close: docs/how-it-works.md.
//!
//! `decide::decide` is the whole decision as a pure function; `execute` performs it.

pub(crate) mod decide;
pub(crate) mod execute;

pub(crate) use capm_api::records::{self, Which};

#[cfg(test)]
mod tests {
    use capm_api::records::{MAX_MESSAGE_ID_BYTES, parse_record};
    use capm_mailer::{MAX_MESSAGE_ID_LEN, MessageId};

    /// The records (in `capm_api`, which has no mailer) believe a backend id exactly when the
    /// mailer could have sent it.
    #[test]
    fn records_and_the_mailer_agree_on_message_ids() {
        assert_eq!(MAX_MESSAGE_ID_BYTES, MAX_MESSAGE_ID_LEN);
        let ours = "<mailguncluster.u-1@mg.example.com>";
        let long = format!(
            "<{}@{}>",
            "a".repeat(200),
            "b".repeat(MAX_MESSAGE_ID_LEN - 203)
        );
        let too_long = format!(
            "<{}@{}>",
            "a".repeat(200),
            "b".repeat(MAX_MESSAGE_ID_LEN - 202)
        );
        for backend_id in [
            "<20261128.1@mg.example.com>",
            "<a.b!#$%&'*+-/=?^_`{|}~@c.d>",
            long.as_str(),
            too_long.as_str(),
            "<a..b@c>",
            "<.a@b>",
            "<a@b.>",
            "<a b@c>",
            "<a@b@c>",
            "<@b>",
            "<a\"b@c>",
            "a@b",
            "<a@b",
        ] {
            let record = serde_json::json!({
                "messageId": ours, "state": "sent", "backendId": backend_id,
            });
            let believed =
                parse_record(&record.to_string(), "MailgunCluster", super::Which::Request);
            assert_eq!(
                believed.is_ok(),
                MessageId::parse(backend_id).is_ok(),
                "{backend_id}: {believed:?}"
            );
        }
    }
}
