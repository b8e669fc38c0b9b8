//! The fulfilment page's HTML: plain, without JavaScript, every input labelled, from askama
//! templates (`cmd/templates/fulfil/`) that escape every value by default; text from the object
//! is also cleaned (controls, bidirectional overrides) as everywhere else. A rendered fragment
//! is an [`Html`], which only these templates make, so one can be put into another unescaped.

use askama::Template;

/// The page's only style sheet; the Content-Security-Policy allows exactly it (by hash).
pub const CSS: &str = "body{font-family:system-ui,sans-serif;max-width:44rem;margin:2rem auto;\
padding:0 1rem;line-height:1.5;color:#1b1b1b}h1{font-size:1.5rem}dl{display:grid;\
grid-template-columns:max-content 1fr;gap:.25rem 1rem}dt{font-weight:600}dd{margin:0}\
label{display:block;font-weight:600;margin-top:1rem}input,select,textarea{font:inherit;padding:.3rem;\
width:100%;box-sizing:border-box}fieldset{margin-top:1rem}button{font:inherit;margin-top:1.5rem;\
padding:.5rem 1.5rem}.problem{color:#a00000;font-weight:600}.note{color:#444}\
.refused{border-left:4px solid #a00000;padding-left:1rem}.done{border-left:4px solid #006b21;\
padding-left:1rem}";

/// The longest text shown from one field of the object.
const MAX_SHOWN_BYTES: usize = 4096;

/// HTML rendered from one of this module's templates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Html(String);

impl Html {
    fn render(template: &impl Template) -> Self {
        // The templates only format strings: rendering cannot fail.
        Self(template.render().unwrap_or_default())
    }

    /// `self` followed by `next`.
    pub fn then(mut self, next: &Html) -> Self {
        self.0.push_str(&next.0);
        self
    }
}

impl std::fmt::Display for Html {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Html> for String {
    fn from(html: Html) -> Self {
        html.0
    }
}

/// Text from the object: cleaned (controls, bidirectional overrides), one line, for a template
/// to escape.
pub fn shown(text: &str) -> String {
    capm_mailer::text::clean(text, MAX_SHOWN_BYTES)
}

#[derive(Template)]
#[template(path = "fulfil/page.html")]
struct PageTemplate<'a> {
    title: &'a str,
    css: &'a str,
    body: &'a Html,
}

/// A whole page.
pub fn page(title: &str, body: &Html) -> String {
    Html::render(&PageTemplate {
        title,
        css: CSS,
        body,
    })
    .into()
}

/// What was asked, as the mail said it.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// `MailgunCluster` / `MailgunMachine` / `MailgunRemediation`.
    pub kind: String,
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Priority.
    pub priority: String,
    /// The request's text.
    pub request: String,
    /// Who asked (empty for a repair request: a MachineHealthCheck asked).
    pub requester: String,
    /// When the request was mailed (RFC 3339), or created.
    pub when: String,
    /// Kind-specific rows (Cluster, Machine, failure domain, bootstrap data).
    pub extra: Vec<(&'static str, String)>,
}

#[derive(Template)]
#[template(path = "fulfil/summary.html")]
struct SummaryTemplate {
    rows: Vec<(&'static str, Vec<String>)>,
}

/// The request as a definition list.
pub fn summary(s: &Summary) -> Html {
    let one = |text: &str| vec![shown(text)];
    let mut rows = vec![
        ("Kind", one(&s.kind)),
        ("Name", one(&s.name)),
        ("Namespace", one(&s.namespace)),
        ("Priority", one(&s.priority)),
        ("Request", s.request.lines().take(100).map(shown).collect()),
    ];
    // A repair request has no requester: a MachineHealthCheck asked.
    if !s.requester.is_empty() {
        rows.push(("Requested by", one(&s.requester)));
    }
    rows.push(("Requested at", one(&s.when)));
    rows.extend(s.extra.iter().map(|(k, v)| (*k, one(v))));
    Html::render(&SummaryTemplate { rows })
}

#[derive(Template)]
#[template(path = "fulfil/values.html")]
struct ValuesTemplate {
    rows: Vec<(String, String)>,
}

/// A list of recorded values (label, value).
pub fn values(rows: &[(String, String)]) -> Html {
    let rows = rows.iter().map(|(k, v)| (shown(k), shown(v))).collect();
    Html::render(&ValuesTemplate { rows })
}

/// One form field: its name, label, hint, current value and problem.
#[derive(Template)]
#[template(path = "fulfil/field.html")]
pub struct Field<'a> {
    /// The form field's name (and the input's id).
    pub name: &'a str,
    /// The label.
    pub label: &'a str,
    /// A hint below the label.
    pub hint: &'a str,
    /// The value to show.
    pub value: &'a str,
    /// What is wrong with it, if anything.
    pub problem: Option<&'a str>,
    /// `text` or `number`.
    pub input_type: &'a str,
    /// Required in the form.
    pub required: bool,
}

/// An address row: its index, the chosen type, the address, its problem.
pub struct AddressRow<'a> {
    /// 0-based.
    pub index: usize,
    /// `InternalIP`, ...
    pub type_: &'a str,
    /// The address.
    pub address: &'a str,
    /// What is wrong, if anything.
    pub problem: Option<&'a str>,
}

/// The address types Cluster API knows.
pub const ADDRESS_TYPES: &[&str] = &[
    "InternalIP",
    "ExternalIP",
    "Hostname",
    "InternalDNS",
    "ExternalDNS",
];

/// An address row as the form template shows it.
struct RenderedRow {
    index: usize,
    number: usize,
    /// Each type and its `selected` attribute (empty or ` selected`).
    options: Vec<(&'static str, &'static str)>,
    field: Html,
}

#[derive(Template)]
#[template(path = "fulfil/form.html")]
struct FormTemplate<'a> {
    action: &'a str,
    form_token: &'a str,
    fields: Vec<Html>,
    addresses: Vec<RenderedRow>,
    problem: Option<&'a str>,
}

/// An option's `selected` attribute: ` selected` for the chosen one, else empty.
fn selected(chosen: bool) -> &'static str {
    if chosen { " selected" } else { "" }
}

/// The form: hidden form token, the fields, address rows, one problem for the whole form.
pub fn form(
    action: &str,
    form_token: &str,
    fields: &[Field<'_>],
    addresses: &[AddressRow<'_>],
    problem: Option<&str>,
) -> Html {
    let addresses = addresses
        .iter()
        .map(|row| RenderedRow {
            index: row.index,
            number: row.index + 1,
            options: ADDRESS_TYPES
                .iter()
                .map(|t| (*t, selected(*t == row.type_)))
                .collect(),
            field: Html::render(&Field {
                name: &format!("address-{}", row.index),
                label: "Address",
                hint: "Leave empty if the machine has no further address.",
                value: row.address,
                problem: row.problem,
                input_type: "text",
                required: false,
            }),
        })
        .collect();
    Html::render(&FormTemplate {
        action,
        form_token,
        fields: fields.iter().map(Html::render).collect(),
        addresses,
        problem,
    })
}

/// The answer to a repair request: its choices (the option's value, its label) and the limit of
/// its message.
const ANSWERS: &[(&str, &str)] = &[
    ("Repaired", "Repaired: the machine works again"),
    ("CannotRepair", "Cannot repair: replace the machine"),
];

/// A repair request's answer form as the handler fills it.
pub struct AnswerForm<'a> {
    /// Where it posts.
    pub action: &'a str,
    /// The form token.
    pub form_token: &'a str,
    /// The chosen result (`Repaired`, `CannotRepair`, or empty).
    pub result: &'a str,
    /// What is wrong with the result.
    pub result_problem: Option<&'a str>,
    /// The message.
    pub message: &'a str,
    /// What is wrong with the message.
    pub message_problem: Option<&'a str>,
    /// One problem for the whole form.
    pub problem: Option<&'a str>,
}

#[derive(Template)]
#[template(path = "fulfil/answer.html")]
struct AnswerTemplate<'a> {
    action: &'a str,
    form_token: &'a str,
    /// Each answer's value, label and `selected` attribute (empty or ` selected`).
    options: Vec<(&'static str, &'static str, &'static str)>,
    result_problem: Option<&'a str>,
    message: &'a str,
    message_problem: Option<&'a str>,
    max_message: u32,
    problem: Option<&'a str>,
}

/// The answer form: hidden form token, the result (a choice of two) and a message.
pub fn answer_form(form: &AnswerForm<'_>) -> Html {
    Html::render(&AnswerTemplate {
        action: form.action,
        form_token: form.form_token,
        options: ANSWERS
            .iter()
            .map(|(value, label)| (*value, *label, selected(*value == form.result)))
            .collect(),
        result_problem: form.result_problem,
        message: form.message,
        message_problem: form.message_problem,
        max_message: capm_api::limits::MAX_ANSWER_MESSAGE_LENGTH,
        problem: form.problem,
    })
}

#[derive(Template)]
#[template(path = "fulfil/refusal.html")]
struct RefusalTemplate<'a> {
    message: &'a str,
}

/// A refusal: what happened, and that nothing was written.
pub fn refusal(message: &str) -> String {
    page(
        "This link cannot be used",
        &Html::render(&RefusalTemplate { message }),
    )
}

#[derive(Template)]
#[template(path = "fulfil/notice.html")]
struct NoticeTemplate<'a> {
    message: &'a str,
}

/// A page of one sentence.
pub fn notice(title: &str, message: &str) -> String {
    page(title, &Html::render(&NoticeTemplate { message }))
}

#[derive(Template)]
#[template(path = "fulfil/recorded.html")]
struct RecordedTemplate<'a> {
    sentence: &'a str,
    values: Html,
}

/// What the page answers once the values are recorded: `sentence` (what happens next, its
/// object's name already [`shown`]) and the values.
pub fn recorded(sentence: &str, rows: &[(String, String)]) -> String {
    let body = Html::render(&RecordedTemplate {
        sentence,
        values: values(rows),
    });
    page("Recorded", &body)
}

#[derive(Template)]
#[template(path = "fulfil/already.html")]
struct AlreadyTemplate {
    values: Html,
    summary: Html,
}

/// What the page answers, under `title`, for an object already fulfilled (or answered).
pub fn already(title: &str, rows: &[(String, String)], asked: &Summary) -> String {
    let body = Html::render(&AlreadyTemplate {
        values: values(rows),
        summary: summary(asked),
    });
    page(title, &body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_escaped_and_cleaned() {
        let v = values(&[("k".into(), r#"<a href="x">'&'</a>"#.into())]).to_string();
        assert!(!v.contains("<a href"), "{v}");
        assert!(
            v.contains("&#60;a href=&#34;x&#34;&#62;&#39;&#38;&#39;&#60;/a&#62;"),
            "{v}"
        );
        let s = summary(&Summary {
            request: "line one\n<script>alert(1)</script>\u{202e}txt.exe".into(),
            ..Summary::default()
        });
        let s = s.to_string();
        assert!(s.contains("line one<br>&#60;script&#62;"), "{s}");
        assert!(!s.contains('\u{202e}') && !s.contains("<script"), "{s}");
    }

    #[test]
    fn every_input_has_a_label_and_problems_are_announced() {
        let f = form(
            "/fulfil/t",
            "ft\"",
            &[Field {
                name: "host",
                label: "Host",
                hint: "h",
                value: "\"><b>",
                problem: Some("bad"),
                input_type: "text",
                required: true,
            }],
            &[AddressRow {
                index: 0,
                type_: "ExternalIP",
                address: "",
                problem: None,
            }],
            None,
        )
        .to_string();
        for id in ["host", "address-type-0", "address-0"] {
            assert!(f.contains(&format!("<label for=\"{id}\">")), "{id}: {f}");
            assert!(f.contains(&format!("id=\"{id}\"")), "{id}: {f}");
        }
        assert!(f.contains("aria-invalid=\"true\""));
        assert!(f.contains("value=\"&#34;&#62;&#60;b&#62;\""), "{f}");
        assert!(f.contains("value=\"ft&#34;\""), "{f}");
        assert!(f.contains("<option value=\"ExternalIP\" selected>"));
        assert!(!refusal("<script>").contains("<script"));
    }

    #[test]
    fn the_answer_form_labels_both_fields_and_escapes_the_message() {
        let f = answer_form(&AnswerForm {
            action: "/fulfil/t",
            form_token: "ft",
            result: "CannotRepair",
            result_problem: None,
            message: "</textarea><script>x</script>",
            message_problem: Some("too long"),
            problem: None,
        })
        .to_string();
        for id in ["result", "message"] {
            assert!(f.contains(&format!("<label for=\"{id}\">")), "{id}: {f}");
            assert!(f.contains(&format!("id=\"{id}\"")), "{id}: {f}");
        }
        assert!(
            f.contains("<option value=\"CannotRepair\" selected>"),
            "{f}"
        );
        assert!(f.contains("<option value=\"Repaired\">"), "{f}");
        assert!(
            !f.contains("<script>") && f.contains("&#60;/textarea&#62;"),
            "{f}"
        );
        assert!(f.contains("maxlength=\"1024\""), "{f}");
        assert!(f.contains("aria-invalid=\"true\""), "{f}");
        assert!(f.contains("name=\"form-token\" value=\"ft\""), "{f}");
    }
}
