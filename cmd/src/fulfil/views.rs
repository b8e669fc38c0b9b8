//! The pages the handlers answer with: the form (with its problems), "recorded" and "already
//! recorded", for what was built and for a repair request's answer alike.

use bytes::Bytes;
use capm_api::{link_token, v1beta1::AnswerResult};
use http::{Response, StatusCode};
use http_body_util::Full;

use super::{
    ADDRESS_ROWS, Answer, Outcome, Page, html,
    target::{Form, Target},
};

impl Page {
    /// The "already recorded" page of `target` (what was built, or a repair request's answer),
    /// counted by its kind.
    pub(super) async fn already(&self, target: &Target, values: &[(String, String)]) -> Answer {
        let asked = target.summary(&self.client).await;
        let (outcome, title) = if target.is_repair() {
            (Outcome::AlreadyAnswered, "Already answered")
        } else {
            (Outcome::Already, "Already fulfilled")
        };
        self.answer_with(
            outcome,
            StatusCode::OK,
            html::already(title, values, &asked),
        )
    }

    /// What the page answers once the values are recorded on `target`.
    pub(super) fn recorded(&self, target: &Target, values: &[(String, String)]) -> Answer {
        let name = html::shown(target.meta().name.as_deref().unwrap_or_default());
        let kind = target.kind().as_str();
        let (outcome, sentence) = match target {
            Target::Remediation(r) => (
                Outcome::Answered,
                match r.spec.answer.as_ref().map(|a| a.result) {
                    Some(AnswerResult::CannotRepair) => format!(
                        "Answer recorded. Thank you: the Machine {name} is handed back to its owner, which replaces it."
                    ),
                    _ => format!(
                        "Answer recorded. Thank you: the Machine {name} is watched until its health check passes."
                    ),
                },
            ),
            _ => (
                Outcome::Fulfilled,
                format!("Recorded. Thank you: the {kind} {name} is marked provisioned shortly."),
            ),
        };
        self.answer_with(outcome, StatusCode::OK, html::recorded(&sentence, values))
    }

    pub(super) async fn form_page(
        &self,
        target: &Target,
        token: &str,
        cookie: &str,
        form: &Form,
        status: StatusCode,
    ) -> Response<Full<Bytes>> {
        let form_token = self.keys.current().form_token(token, cookie);
        let action = format!("{}{token}", link_token::PATH_PREFIX);
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
            Target::Remediation(_) => html::answer_form(&html::AnswerForm {
                action: &action,
                form_token: &form_token,
                result: &form.result,
                result_problem: problem("result"),
                message: &form.message,
                message_problem: problem("message"),
                problem: general,
            }),
        };
        let title = match target {
            Target::Cluster(_) => "A cluster was requested",
            Target::Machine(_) => "A machine was requested",
            Target::Remediation(_) => "A machine needs repair",
        };
        self.answer(status, html::page(title, &summary.then(&body)))
    }
}
