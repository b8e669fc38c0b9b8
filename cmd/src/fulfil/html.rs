//! The fulfilment page's HTML: plain, without JavaScript, every input labelled, every value
//! from outside escaped (and, for text from the object, cleaned as everywhere else).

use std::fmt::Write as _;

/// The page's only style sheet; the Content-Security-Policy allows exactly it (by hash).
pub const CSS: &str = "body{font-family:system-ui,sans-serif;max-width:44rem;margin:2rem auto;\
padding:0 1rem;line-height:1.5;color:#1b1b1b}h1{font-size:1.5rem}dl{display:grid;\
grid-template-columns:max-content 1fr;gap:.25rem 1rem}dt{font-weight:600}dd{margin:0}\
label{display:block;font-weight:600;margin-top:1rem}input,select{font:inherit;padding:.3rem;\
width:100%;box-sizing:border-box}fieldset{margin-top:1rem}button{font:inherit;margin-top:1.5rem;\
padding:.5rem 1.5rem}.problem{color:#a00000;font-weight:600}.note{color:#444}\
.refused{border-left:4px solid #a00000;padding-left:1rem}.done{border-left:4px solid #006b21;\
padding-left:1rem}";

/// The longest text shown from one field of the object.
const MAX_SHOWN_BYTES: usize = 4096;

/// `text` escaped for HTML text and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Text from the object: cleaned (controls, bidirectional overrides) and escaped, one line.
pub fn shown(text: &str) -> String {
    escape(&capm_mailer::text::clean(text, MAX_SHOWN_BYTES))
}

/// A multi-line text from the object (the request): each line cleaned and escaped.
fn shown_lines(text: &str) -> String {
    text.lines()
        .take(100)
        .map(shown)
        .collect::<Vec<_>>()
        .join("<br>")
}

/// A whole page.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <meta name=\"referrer\" content=\"same-origin\">\n<title>{title}</title>\n\
         <style>{CSS}</style>\n</head>\n<body>\n<main>\n<h1>{title}</h1>\n{body}</main>\n\
         </body>\n</html>\n",
        title = escape(title)
    )
}

/// What was asked, as the mail said it.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// `MailgunCluster` / `MailgunMachine`.
    pub kind: String,
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// Priority.
    pub priority: String,
    /// The request's text.
    pub request: String,
    /// Who asked.
    pub requester: String,
    /// When the request was mailed (RFC 3339), or created.
    pub when: String,
    /// Kind-specific rows (Cluster, Machine, failure domain, bootstrap data).
    pub extra: Vec<(&'static str, String)>,
}

/// The request as a definition list.
pub fn summary(s: &Summary) -> String {
    let mut out = String::from("<h2>What was asked</h2>\n<dl>\n");
    let rows = [
        ("Kind", shown(&s.kind)),
        ("Name", shown(&s.name)),
        ("Namespace", shown(&s.namespace)),
        ("Priority", shown(&s.priority)),
        ("Request", shown_lines(&s.request)),
        ("Requested by", shown(&s.requester)),
        ("Requested at", shown(&s.when)),
    ];
    let extra = s.extra.iter().map(|(k, v)| (*k, shown(v)));
    for (label, value) in rows.into_iter().chain(extra) {
        let _ = writeln!(out, "<dt>{label}</dt><dd>{value}</dd>");
    }
    out.push_str("</dl>\n");
    out
}

/// A list of recorded values (label, value).
pub fn values(rows: &[(String, String)]) -> String {
    let mut out = String::from("<dl>\n");
    for (label, value) in rows {
        let _ = writeln!(out, "<dt>{}</dt><dd>{}</dd>", shown(label), shown(value));
    }
    out.push_str("</dl>\n");
    out
}

/// One form field: its name, label, hint, current value and problem.
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

impl Field<'_> {
    fn render(&self, out: &mut String) {
        let (name, hint_id, problem_id) = (
            escape(self.name),
            format!("{}-hint", escape(self.name)),
            format!("{}-problem", escape(self.name)),
        );
        let _ = write!(
            out,
            "<label for=\"{name}\">{}</label>\n<div class=\"note\" id=\"{hint_id}\">{}</div>\n",
            escape(self.label),
            escape(self.hint)
        );
        let mut described = hint_id;
        if let Some(problem) = self.problem {
            let _ = writeln!(
                out,
                "<div class=\"problem\" id=\"{problem_id}\">{}</div>",
                escape(problem)
            );
            described = format!("{described} {problem_id}");
        }
        let _ = writeln!(
            out,
            "<input type=\"{}\" id=\"{name}\" name=\"{name}\" value=\"{}\" \
             aria-describedby=\"{described}\"{}{}>",
            self.input_type,
            escape(self.value),
            if self.required { " required" } else { "" },
            if self.problem.is_some() {
                " aria-invalid=\"true\""
            } else {
                ""
            }
        );
    }
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

impl AddressRow<'_> {
    fn render(&self, out: &mut String) {
        let n = self.index;
        let _ = write!(
            out,
            "<fieldset>\n<legend>Address {}</legend>\n\
             <label for=\"address-type-{n}\">Type</label>\n\
             <select id=\"address-type-{n}\" name=\"address-type-{n}\">\n",
            n + 1
        );
        for t in ADDRESS_TYPES {
            let selected = if *t == self.type_ { " selected" } else { "" };
            let _ = writeln!(out, "<option value=\"{t}\"{selected}>{t}</option>");
        }
        out.push_str("</select>\n");
        Field {
            name: &format!("address-{n}"),
            label: "Address",
            hint: "Leave empty if the machine has no further address.",
            value: self.address,
            problem: self.problem,
            input_type: "text",
            required: false,
        }
        .render(out);
        out.push_str("</fieldset>\n");
    }
}

/// The form: hidden form token, the fields, address rows, one problem for the whole form.
pub fn form(
    action: &str,
    form_token: &str,
    fields: &[Field<'_>],
    addresses: &[AddressRow<'_>],
    problem: Option<&str>,
) -> String {
    let mut out = String::from("<h2>What you built</h2>\n");
    if let Some(problem) = problem {
        let _ = writeln!(
            out,
            "<p class=\"problem\" role=\"alert\">{}</p>",
            escape(problem)
        );
    }
    let _ = writeln!(
        out,
        "<form method=\"post\" action=\"{}\">\n\
         <input type=\"hidden\" name=\"form-token\" value=\"{}\">",
        escape(action),
        escape(form_token)
    );
    for field in fields {
        field.render(&mut out);
    }
    for row in addresses {
        row.render(&mut out);
    }
    out.push_str("<button type=\"submit\">Record it</button>\n</form>\n");
    out
}

/// A refusal: what happened, and that nothing was written.
pub fn refusal(message: &str) -> String {
    page(
        "This link cannot be used",
        &format!(
            "<div class=\"refused\" role=\"alert\">\n<p>{}</p>\n<p>Nothing was recorded. Ask \
             the requester for a new request, or record the values with <code>kubectl \
             patch</code> as the mail shows.</p>\n</div>\n",
            escape(message)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_text_is_escaped_and_cleaned() {
        assert_eq!(
            escape(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        let s = summary(&Summary {
            request: "line one\n<script>alert(1)</script>\u{202e}txt.exe".into(),
            ..Summary::default()
        });
        assert!(s.contains("line one<br>&lt;script&gt;"), "{s}");
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
        );
        for id in ["host", "address-type-0", "address-0"] {
            assert!(f.contains(&format!("<label for=\"{id}\">")), "{id}: {f}");
            assert!(f.contains(&format!("id=\"{id}\"")), "{id}: {f}");
        }
        assert!(f.contains("aria-invalid=\"true\""));
        assert!(f.contains("value=\"&quot;&gt;&lt;b&gt;\""));
        assert!(f.contains("value=\"ft&quot;\""));
        assert!(f.contains("<option value=\"ExternalIP\" selected>"));
        assert!(!page("t", &f).contains("<script"));
    }
}
