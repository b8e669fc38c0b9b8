//! The pages the handlers answer with: the form (with its problems) and "already recorded".

use bytes::Bytes;
use capm_api::link_token;
use http::{Response, StatusCode};
use http_body_util::Full;

use super::{
    ADDRESS_ROWS, Page, html,
    target::{Form, Target},
};

impl Page {
    pub(super) async fn already(
        &self,
        target: &Target,
        values: &[(String, String)],
    ) -> Response<Full<Bytes>> {
        let asked = target.summary(&self.client).await;
        self.answer(StatusCode::OK, html::already(values, &asked))
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
        };
        let title = match target {
            Target::Cluster(_) => "A cluster was requested",
            Target::Machine(_) => "A machine was requested",
        };
        self.answer(status, html::page(title, &summary.then(&body)))
    }
}
