//! `POST /v1/analytics/logs`, Mailgun's Logs API, as its published OpenAPI description gives
//! it: a JSON body of `start`/`end` (RFC 2822) or `duration`, `events`, `filter.AND[]` of
//! `{attribute, comparator, values[] = {label, value}}`, `include_totals`,
//! `include_subaccounts`, `pagination = {sort, token, limit ≤ 100}`; the reply's `start`, `end`,
//! `items` (each with `id`, `event`, `@timestamp`, `recipient`, `domain.name`, the message's
//! headers, and for failures `severity`, `reason` and `delivery-status`), `pagination` (opaque
//! tokens) and `aggregates`.
//!
//! What it checks and answers 400 for, so tests pin the shapes the provider sends: unknown
//! fields at any level, dates that are not RFC 2822, an unknown event, a filter attribute other
//! than `domain`, `message-id`, `recipient` or `event`, a comparator other than `=` or `!=`, a
//! clause without values, a limit outside 1..=100, a sort other than `timestamp:asc` or
//! `timestamp:desc`, a token it did not give. The account has one domain, the server's.

use axum::{
    body::Bytes,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Asked, FailureTarget, MaybeCutter, Shared, all_events, bare, error, fail, now};

/// The most items a page holds, and the documented `pagination.limit` bound.
const MAX_LIMIT: usize = 100;
/// The window when neither `start` nor `duration` is given: the day before `end`.
const DEFAULT_WINDOW: f64 = 24.0 * 3600.0;
/// The events the Logs API knows (its OpenAPI description's enumeration).
const KNOWN_EVENTS: &[&str] = &[
    "accepted",
    "delivered",
    "failed",
    "opened",
    "unique_opened",
    "clicked",
    "unique_clicked",
    "unsubscribed",
    "complained",
    "rejected",
    "stored",
    "email_validation",
    "list_uploaded",
    "list_member_uploaded",
    "list_member_upload_error",
    "trapped",
];

/// The request body.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogsQuery {
    #[serde(default)]
    start: Option<String>,
    #[serde(default)]
    end: Option<String>,
    #[serde(default)]
    duration: Option<String>,
    #[serde(default)]
    events: Option<Vec<String>>,
    #[serde(default)]
    #[allow(
        dead_code,
        reason = "accepted as documented; this server has no metrics"
    )]
    metric_events: Option<Vec<String>>,
    #[serde(default)]
    filter: Option<Filter>,
    #[serde(default)]
    #[allow(
        dead_code,
        reason = "accepted as documented; this server has no subaccounts"
    )]
    include_subaccounts: Option<bool>,
    #[serde(default)]
    include_totals: Option<bool>,
    #[serde(default)]
    pagination: Option<Pagination>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Filter {
    #[serde(rename = "AND")]
    and: Vec<Clause>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Clause {
    attribute: String,
    comparator: String,
    values: Vec<LabelValue>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LabelValue {
    #[allow(dead_code, reason = "required by the contract, shown to humans only")]
    label: String,
    value: String,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pagination {
    #[serde(default)]
    sort: Option<String>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    limit: Option<i64>,
}

/// What a page token holds: where the next page starts. Opaque to clients (base64url JSON).
#[derive(Debug, Serialize, Deserialize)]
struct Token {
    offset: usize,
}

fn token(offset: usize) -> String {
    let raw = serde_json::to_vec(&Token { offset }).unwrap_or_default();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

fn offset_of(token: &str) -> Option<usize> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.as_bytes())
        .ok()?;
    serde_json::from_slice::<Token>(&raw).ok().map(|t| t.offset)
}

/// Seconds since the epoch as the items' `@timestamp` (RFC 3339, UTC, milliseconds).
pub(super) fn rfc3339(seconds: f64) -> String {
    let millis = (seconds * 1000.0) as i64;
    jiff::Timestamp::from_millisecond(millis)
        .map(|t| format!("{t:.3}"))
        .unwrap_or_default()
}

fn rfc2822(seconds: f64) -> String {
    jiff::Timestamp::from_second(seconds as i64)
        .ok()
        .and_then(|t| {
            jiff::fmt::rfc2822::DateTimePrinter::new()
                .timestamp_to_string(&t)
                .ok()
        })
        .unwrap_or_default()
}

fn parse_rfc2822(field: &str, text: &str) -> Result<f64, String> {
    jiff::fmt::rfc2822::DateTimeParser::new()
        .parse_timestamp(text)
        .map(|t| t.as_millisecond() as f64 / 1000.0)
        .map_err(|_| format!("{field}: not an RFC 2822 date: {text:?}"))
}

/// `1d`, `2h`, `30m`, `10s` in seconds.
fn parse_duration(text: &str) -> Result<f64, String> {
    let bad = || format!("duration: not a duration like 1d or 2h: {text:?}");
    let unit = text.chars().last().ok_or_else(bad)?;
    let count: f64 = text[..text.len() - unit.len_utf8()]
        .parse()
        .map_err(|_| bad())?;
    let per = match unit {
        'd' => 86400.0,
        'h' => 3600.0,
        'm' => 60.0,
        's' => 1.0,
        _ => return Err(bad()),
    };
    Ok(count * per)
}

/// A validated query: the window, the events, the clauses, the page.
struct Plan {
    start: f64,
    end: f64,
    events: Option<Vec<String>>,
    clauses: Vec<Clause>,
    ascending: bool,
    limit: usize,
    offset: usize,
    totals: bool,
}

fn plan(query: LogsQuery) -> Result<Plan, String> {
    let end = match &query.end {
        Some(end) => parse_rfc2822("end", end)?,
        None => now(),
    };
    let start = match (&query.duration, &query.start) {
        (Some(duration), _) => end - parse_duration(duration)?,
        (None, Some(start)) => parse_rfc2822("start", start)?,
        (None, None) => end - DEFAULT_WINDOW,
    };
    if start > end {
        return Err("start: after end".into());
    }
    for event in query.events.iter().flatten() {
        if !KNOWN_EVENTS.contains(&event.as_str()) {
            return Err(format!("events: unknown event {event:?}"));
        }
    }
    let clauses = query.filter.map(|f| f.and).unwrap_or_default();
    for clause in &clauses {
        if !["domain", "message-id", "recipient", "event"].contains(&clause.attribute.as_str()) {
            return Err(format!(
                "filter: unsupported attribute {:?}",
                clause.attribute
            ));
        }
        if !["=", "!="].contains(&clause.comparator.as_str()) {
            return Err(format!(
                "filter: unsupported comparator {:?}",
                clause.comparator
            ));
        }
        if clause.values.is_empty() {
            return Err(format!("filter: no values for {:?}", clause.attribute));
        }
    }
    let pagination = query.pagination.unwrap_or_default();
    let ascending = match pagination.sort.as_deref() {
        None | Some("timestamp:desc") => false,
        Some("timestamp:asc") => true,
        Some(other) => return Err(format!("pagination.sort: unsupported {other:?}")),
    };
    let limit = match pagination.limit {
        None => MAX_LIMIT,
        Some(n) if (1..=MAX_LIMIT as i64).contains(&n) => n as usize,
        Some(n) => return Err(format!("pagination.limit: {n} is not in 1..=100")),
    };
    let offset = match pagination.token.as_deref() {
        None => 0,
        Some(t) => offset_of(t).ok_or_else(|| "pagination.token: invalid".to_owned())?,
    };
    Ok(Plan {
        start,
        end,
        events: query.events,
        clauses,
        ascending,
        limit,
        offset,
        totals: query.include_totals.unwrap_or(false),
    })
}

/// Whether `item` (an events API item) passes `clause` (`domain` is the server's one domain).
fn passes(clause: &Clause, item: &serde_json::Value, domain: &str) -> bool {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    let actual = match clause.attribute.as_str() {
        "domain" => domain.to_owned(),
        "message-id" => text(&item["message"]["headers"]["message-id"]),
        "recipient" => text(&item["recipient"]),
        _ => text(&item["event"]),
    };
    let any = clause
        .values
        .iter()
        .any(|v| match clause.attribute.as_str() {
            "message-id" => bare(&v.value) == actual,
            _ => v.value == actual,
        });
    any == (clause.comparator == "=")
}

/// `POST /v1/analytics/logs`.
pub(super) async fn logs(
    State(state): State<Shared>,
    MaybeCutter(cutter): MaybeCutter,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    state.store().stats.logs_requests += 1;
    if let Some(r) = state.unauthorized(&headers, super::Scope::Read) {
        return r;
    }
    let query: LogsQuery = match serde_json::from_slice(&body) {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("invalid request: {e}")),
    };
    let first_id = query
        .filter
        .iter()
        .flat_map(|f| &f.and)
        .find(|c| c.attribute == "message-id")
        .and_then(|c| c.values.first())
        .map(|v| v.value.clone());
    let plan = match plan(query) {
        Ok(plan) => plan,
        Err(message) => return error(StatusCode::BAD_REQUEST, &message),
    };
    if let Some(rule) = state.take_failure(FailureTarget::Logs) {
        // A hostile page's token asks again from where this one started.
        let asked = Asked::Events {
            message_id: first_id,
            next: token(plan.offset),
            logs: true,
        };
        return fail(rule, &state, asked, cutter).await;
    }
    page(&state, &plan)
}

fn page(state: &Shared, plan: &Plan) -> Response {
    let domain = state.domain.clone();
    let (items, total, size) = {
        let store = state.store();
        // Message-id clauses select messages before any item is built (see `all_events`).
        let ids: Vec<&Clause> = plan
            .clauses
            .iter()
            .filter(|c| c.attribute == "message-id" && c.comparator == "=")
            .collect();
        let wanted = |id: &str| {
            ids.iter()
                .all(|c| c.values.iter().any(|v| bare(&v.value) == bare(id)))
        };
        let mut all: Vec<serde_json::Value> = all_events(&store, &wanted)
            .into_iter()
            .filter(|(at, _, _)| *at >= plan.start && *at <= plan.end)
            .map(|(at, _, mut item)| {
                if let Some(fields) = item.as_object_mut() {
                    fields.remove("timestamp");
                    fields.insert("@timestamp".into(), json!(rfc3339(at)));
                    fields.insert("domain".into(), json!({ "name": domain }));
                }
                item
            })
            .filter(|item| {
                plan.events
                    .as_ref()
                    .is_none_or(|events| events.iter().any(|e| item["event"].as_str() == Some(e)))
                    && plan.clauses.iter().all(|c| passes(c, item, &domain))
            })
            .collect();
        if !plan.ascending {
            all.reverse();
        }
        let size = plan.limit.min(store.page_size.unwrap_or(MAX_LIMIT)).max(1);
        let total = all.len();
        let items: Vec<_> = all.into_iter().skip(plan.offset).take(size).collect();
        (items, total, size)
    };
    let after = plan.offset + items.len();
    let mut pagination = json!({
        "previous": token(plan.offset.saturating_sub(size)),
        "first": token(0),
        "last": token(total.saturating_sub(1) / size * size),
    });
    // The last page has no `next`: nothing follows it (yet).
    if after < total {
        pagination["next"] = json!(token(after));
    }
    if plan.totals {
        pagination["total"] = json!(total);
    }
    (
        StatusCode::OK,
        axum::Json(json!({
            "start": rfc2822(plan.start),
            "end": rfc2822(plan.end),
            "items": items,
            "pagination": pagination,
            "aggregates": {},
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_durations_and_tokens() {
        let at = parse_rfc2822("start", "Mon, 08 Jul 2024 00:00:00 -0000").unwrap();
        assert_eq!(at, 1_720_396_800.0);
        assert_eq!(rfc2822(at), "Mon, 8 Jul 2024 00:00:00 -0000");
        assert!(parse_rfc2822("start", "2024-07-08T00:00:00Z").is_err());
        assert_eq!(rfc3339(1_720_456_218.53), "2024-07-08T16:30:18.530Z");
        assert_eq!(parse_duration("2h").unwrap(), 7200.0);
        assert!(parse_duration("2 weeks").is_err());
        assert_eq!(offset_of(&token(42)), Some(42));
        assert_eq!(offset_of("not-ours"), None);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_refused() {
        let bad = [
            json!({"begin": "x"}),
            json!({"events": ["exploded"]}),
            json!({"filter": {"AND": [{"attribute": "subject", "comparator": "=", "values": [{"label": "a", "value": "a"}]}]}}),
            json!({"filter": {"AND": [{"attribute": "domain", "comparator": "~", "values": [{"label": "a", "value": "a"}]}]}}),
            json!({"filter": {"AND": [{"attribute": "domain", "comparator": "=", "values": []}]}}),
            json!({"filter": {"OR": []}}),
            json!({"pagination": {"limit": 101}}),
            json!({"pagination": {"sort": "id:asc"}}),
            json!({"pagination": {"token": "nope"}}),
            json!({"start": "yesterday"}),
        ];
        for body in bad {
            let parsed = serde_json::from_value::<LogsQuery>(body.clone())
                .map_err(|e| e.to_string())
                .and_then(plan);
            assert!(parsed.is_err(), "accepted {body}");
        }
    }
}
