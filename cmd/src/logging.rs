//! The log formats, both in Cluster API's conventions: each reconcile's span names its object
//! by kind (`MailgunCluster="ns/name"`, `MailgunMachine="ns/name"`) with its `Cluster` (and
//! `Machine`), and messages start with a capital.
//!
//! JSON (the default): one object per line, `timestamp`, `level`, the fields of every span the
//! event is in (outermost first, so the object's keys are top-level keys as in Cluster API's JSON
//! logs), the event's own fields (`message` among them) and `target`. tracing-subscriber's JSON
//! format nests span fields under `span`/`spans`, where `| json | MailgunCluster="ns/name"`
//! (Loki) or `jq 'select(.MailgunCluster == "ns/name")'` would not find them.
//! Text: tracing-subscriber's, whose span prefix reads `reconcile{controller="mailguncluster"
//! MailgunCluster="ns/name" Cluster="ns/name"}`.

use std::fmt;

use serde_json::{Map, Value};
use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
};
use tracing_subscriber::{
    EnvFilter,
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{JsonFields, Writer},
        time::{FormatTime, SystemTime},
    },
    registry::LookupSpan,
};

use crate::settings::{LogFormat, Settings};

/// Installs the process's logger: `settings.log_level` (an `EnvFilter`), to stderr.
pub fn init(settings: &Settings) {
    // Validated while resolving the settings; `info` is a safe fallback all the same.
    let filter = EnvFilter::try_new(&settings.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match settings.log_format {
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .init(),
        LogFormat::Text => builder.init(),
    }
}

/// JSON lines with span fields at the top level (see the module docs). Needs `JsonFields` as
/// the field formatter: span fields are kept as JSON objects, merged here.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlatJson;

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), timestamp.into());
        line.insert("level".into(), event.metadata().level().as_str().into());
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let extensions = span.extensions();
                let Some(fields) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                // Empty (a span without fields) or not JSON (another field formatter): skipped.
                if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(fields) {
                    line.extend(fields);
                }
            }
        }
        event.record(&mut Fields(&mut line));
        line.insert("target".into(), event.metadata().target().into());
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// An event's fields into the line's map (later keys win: the event's over its spans').
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0.insert(field.name().into(), value.to_string().into());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io::Write,
        sync::{Arc, Mutex},
    };

    use tracing::{error_span, field::Empty, info, info_span};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn span_fields_are_top_level_keys_beside_the_events() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            // As kube-runtime's span around each reconcile, and ours inside it.
            let outer = info_span!("reconciling object", object.reason = "object updated");
            outer.in_scope(|| {
                let object = error_span!(
                    "reconcile",
                    controller = "mailgunmachine",
                    MailgunMachine = "team-a/m-0",
                    Machine = Empty,
                    Cluster = Empty,
                );
                object.record("Machine", "team-a/m-0");
                object.record("Cluster", "team-a/c");
                object.in_scope(|| info!(attempts = 2_u64, ok = false, "Finalizer removed"));
            });
            info!("Controllers started");
        });
        let text = String::from_utf8(buffer.0.lock().map(|b| b.clone()).unwrap_or_default())
            .unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let line = &lines[0];
        for (key, value) in [
            ("message", "Finalizer removed"),
            ("level", "INFO"),
            ("MailgunMachine", "team-a/m-0"),
            ("Machine", "team-a/m-0"),
            ("Cluster", "team-a/c"),
            ("controller", "mailgunmachine"),
            ("object.reason", "object updated"),
            ("target", module_path!()),
        ] {
            assert_eq!(line[key], value, "{key} in {line}");
        }
        assert_eq!(line["attempts"], 2);
        assert_eq!(line["ok"], false);
        assert!(line["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert!(line.get("span").is_none() && line.get("spans").is_none());
        assert_eq!(lines[1]["message"], "Controllers started");
        assert!(lines[1].get("MailgunMachine").is_none(), "{}", lines[1]);
    }
}
