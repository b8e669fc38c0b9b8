//! Property tests: converting between v1alpha1 and v1beta1 loses nothing, in either direction,
//! both through the typed `From` implementations and through the webhook's JSON `review`.

use std::collections::BTreeMap;

use capm_api::{names::CONVERSION_DATA_ANNOTATION, v1alpha1 as a, v1beta1 as b, webhook::review};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::core::conversion::ConversionReview;
use proptest::{option, prelude::*};
use serde::{Serialize, de::DeserializeOwned};

fn text() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9 .\n-]{1,40}"
}

fn token() -> impl Strategy<Value = String> {
    "[a-z0-9][a-z0-9-]{0,20}"
}

fn map() -> impl Strategy<Value = Option<BTreeMap<String, String>>> {
    option::of(prop::collection::btree_map(
        "[a-z]{1,8}(\\.example\\.com/[a-z]{1,8})?",
        "[a-zA-Z0-9 ]{0,12}",
        1..4,
    ))
}

fn meta() -> impl Strategy<Value = ObjectMeta> {
    (
        token(),
        option::of(token()),
        map(),
        map(),
        option::of(1i64..100),
        option::of("[0-9a-f-]{36}"),
    )
        .prop_map(
            |(name, namespace, labels, annotations, generation, uid)| ObjectMeta {
                name: Some(name),
                namespace,
                labels,
                annotations,
                generation,
                uid,
                ..ObjectMeta::default()
            },
        )
}

fn time() -> impl Strategy<Value = Time> {
    (0i64..4_000_000_000)
        .prop_map(|s| Time(Timestamp::from_second(s).unwrap_or(Timestamp::UNIX_EPOCH)))
}

fn priority() -> impl Strategy<Value = b::Priority> {
    prop_oneof![
        Just(b::Priority::Urgent),
        Just(b::Priority::ExtremelyUrgent),
        Just(b::Priority::BusinessCritical)
    ]
}

fn endpoint() -> impl Strategy<Value = b::ApiEndpoint> {
    (token(), 1i32..65536).prop_map(|(host, port)| b::ApiEndpoint { host, port })
}

fn addresses() -> impl Strategy<Value = Vec<b::MachineAddress>> {
    let ty = prop_oneof![
        Just(b::MachineAddressType::Hostname),
        Just(b::MachineAddressType::ExternalIp),
        Just(b::MachineAddressType::InternalIp),
        Just(b::MachineAddressType::ExternalDns),
        Just(b::MachineAddressType::InternalDns),
    ];
    prop::collection::vec(
        (ty, token()).prop_map(|(type_, address)| b::MachineAddress { type_, address }),
        0..3,
    )
}

fn conditions() -> impl Strategy<Value = Vec<Condition>> {
    prop::collection::vec(
        (
            token(),
            prop_oneof![Just("True"), Just("False"), Just("Unknown")],
            token(),
            text(),
            time(),
            option::of(0i64..9),
        )
            .prop_map(|(type_, status, reason, message, t, observed_generation)| {
                Condition {
                    type_,
                    status: status.into(),
                    reason,
                    message,
                    last_transition_time: t,
                    observed_generation,
                }
            }),
        0..3,
    )
}

fn initialization() -> impl Strategy<Value = Option<b::Initialization>> {
    option::of(option::of(any::<bool>()).prop_map(|provisioned| b::Initialization { provisioned }))
}

fn mail() -> impl Strategy<Value = Option<b::MailStatus>> {
    let state = prop_oneof![
        Just(b::MailState::Pending),
        Just(b::MailState::Sent),
        Just(b::MailState::Delivered),
        Just(b::MailState::Failed)
    ];
    option::of(
        (option::of(token()), option::of(state), option::of(time())).prop_map(
            |(message_id, state, sent_at)| b::MailStatus {
                message_id,
                state,
                sent_at,
            },
        ),
    )
}

fn cluster_spec() -> impl Strategy<Value = b::MailgunClusterSpec> {
    (
        priority(),
        text(),
        token(),
        option::of(endpoint()),
        option::of("[a-z][a-z0-9-]{0,20}"),
    )
        .prop_map(
            |(priority, request, user, ep, identity)| b::MailgunClusterSpec {
                priority,
                request,
                requester: format!("{user}@example.com"),
                control_plane_endpoint: ep,
                identity_ref: identity.map(|name| b::IdentityReference {
                    kind: b::IdentityKind::MailgunClusterIdentity,
                    name,
                }),
            },
        )
}

fn machine_spec() -> impl Strategy<Value = b::MailgunMachineSpec> {
    (
        priority(),
        text(),
        token(),
        option::of(token()),
        option::of(token()),
        option::of(addresses()),
    )
        .prop_map(
            |(priority, request, user, id, fd, addresses)| b::MailgunMachineSpec {
                priority,
                request,
                requester: format!("{user}@example.com"),
                provider_id: id.map(|id| format!("mailgun://{id}")),
                failure_domain: fd,
                addresses,
            },
        )
}

fn template_meta() -> impl Strategy<Value = Option<b::TemplateMetadata>> {
    option::of(
        (map(), map()).prop_map(|(labels, annotations)| b::TemplateMetadata {
            labels,
            annotations,
        }),
    )
}

prop_compose! {
    fn beta_cluster()(metadata in meta(), spec in cluster_spec(), status in option::of(
        (initialization(), option::of(conditions()), option::of(0i64..50), mail()).prop_map(
            |(initialization, conditions, observed_generation, mail)| b::MailgunClusterStatus {
                initialization, conditions, observed_generation, mail,
            })
    )) -> b::MailgunCluster {
        b::MailgunCluster { metadata, spec, status }
    }
}

prop_compose! {
    fn beta_machine()(metadata in meta(), spec in machine_spec(), status in option::of(
        (initialization(), option::of(conditions()), option::of(0i64..50), option::of(addresses()), mail()).prop_map(
            |(initialization, conditions, observed_generation, addresses, mail)| b::MailgunMachineStatus {
                initialization, conditions, observed_generation, addresses, mail,
            })
    )) -> b::MailgunMachine {
        b::MailgunMachine { metadata, spec, status }
    }
}

prop_compose! {
    fn beta_cluster_template()(metadata in meta(), tm in template_meta(), spec in cluster_spec()) -> b::MailgunClusterTemplate {
        b::MailgunClusterTemplate { metadata, spec: b::MailgunClusterTemplateSpec {
            template: b::MailgunClusterTemplateResource { metadata: tm, spec } } }
    }
}

prop_compose! {
    fn beta_machine_template()(metadata in meta(), tm in template_meta(), spec in machine_spec()) -> b::MailgunMachineTemplate {
        b::MailgunMachineTemplate { metadata, spec: b::MailgunMachineTemplateSpec {
            template: b::MailgunMachineTemplateResource { metadata: tm, spec } } }
    }
}

fn alpha_priority() -> impl Strategy<Value = a::Priority> {
    priority().prop_map(Into::into)
}

prop_compose! {
    fn alpha_cluster()(metadata in meta(), priority in alpha_priority(), request in text(), user in token(),
        status in option::of((option::of(token()), any::<bool>()).prop_map(|(response, ready)| a::MailgunClusterStatus { response, ready }))
    ) -> a::MailgunCluster {
        a::MailgunCluster { metadata, spec: a::MailgunClusterSpec { priority, request, requester: format!("{user}@example.org") }, status }
    }
}

prop_compose! {
    fn alpha_machine()(metadata in meta(), priority in alpha_priority(), request in text(), user in token(),
        id in option::of(token()),
        status in option::of(any::<bool>().prop_map(|ready| a::MailgunMachineStatus { ready }))
    ) -> a::MailgunMachine {
        a::MailgunMachine { metadata, spec: a::MailgunMachineSpec {
            priority, request, requester: format!("{user}@example.org"), provider_id: id.map(|i| format!("x://{i}")) }, status }
    }
}

prop_compose! {
    fn alpha_machine_template()(m in alpha_machine(), tm in template_meta()) -> a::MailgunMachineTemplate {
        a::MailgunMachineTemplate { metadata: m.metadata, spec: a::MailgunMachineTemplateSpec {
            template: a::MailgunMachineTemplateResource { metadata: tm.map(Into::into), spec: m.spec } } }
    }
}

prop_compose! {
    fn alpha_cluster_template()(c in alpha_cluster(), tm in template_meta()) -> a::MailgunClusterTemplate {
        a::MailgunClusterTemplate { metadata: c.metadata, spec: a::MailgunClusterTemplateSpec {
            template: a::MailgunClusterTemplateResource { metadata: tm.map(Into::into), spec: c.spec } } }
    }
}

/// Converts through the webhook's JSON path.
fn via_review<F: Serialize, T: DeserializeOwned>(object: &F, desired: &str) -> T {
    let request = serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "desiredAPIVersion": format!("infrastructure.cluster.x-k8s.io/{desired}"),
            "objects": [serde_json::to_value(object).expect("json")],
        }
    });
    let review_in: ConversionReview = serde_json::from_value(request).expect("review");
    let out = serde_json::to_value(review(review_in)).expect("json");
    assert_eq!(
        out["response"]["uid"],
        "705ab4f5-6393-11e8-b7cc-42010a800002"
    );
    assert_eq!(out["response"]["result"]["status"], "Success", "{out}");
    let converted = out["response"]["convertedObjects"][0].clone();
    assert_eq!(
        converted["apiVersion"],
        format!("infrastructure.cluster.x-k8s.io/{desired}")
    );
    serde_json::from_value(converted).expect("converted object decodes")
}

fn no_conversion_annotation(meta: &ObjectMeta) -> bool {
    meta.annotations
        .as_ref()
        .is_none_or(|a| !a.contains_key(CONVERSION_DATA_ANNOTATION))
}

/// What survives a round trip through v1alpha1: all of spec and metadata, and of status only
/// what v1alpha1 holds (the conversion-data annotation never carries status: issue 14).
trait AfterRoundTrip: Clone {
    fn after_round_trip(&self) -> Self {
        self.clone()
    }
}

fn provisioned_after(provisioned: Option<bool>) -> Option<b::Initialization> {
    Some(b::Initialization {
        provisioned: Some(provisioned.unwrap_or(false)),
    })
}

impl AfterRoundTrip for b::MailgunCluster {
    fn after_round_trip(&self) -> Self {
        let mut out = self.clone();
        out.status = self.status.as_ref().map(|s| b::MailgunClusterStatus {
            initialization: provisioned_after(
                s.initialization.as_ref().and_then(|i| i.provisioned),
            ),
            mail: s
                .mail
                .as_ref()
                .and_then(|m| m.message_id.clone())
                .map(|id| b::MailStatus {
                    message_id: Some(id),
                    ..Default::default()
                }),
            ..Default::default()
        });
        out
    }
}

impl AfterRoundTrip for b::MailgunMachine {
    fn after_round_trip(&self) -> Self {
        let mut out = self.clone();
        out.status = self.status.as_ref().map(|s| b::MailgunMachineStatus {
            initialization: provisioned_after(
                s.initialization.as_ref().and_then(|i| i.provisioned),
            ),
            ..Default::default()
        });
        out
    }
}

impl AfterRoundTrip for b::MailgunClusterTemplate {}
impl AfterRoundTrip for b::MailgunMachineTemplate {}
impl AfterRoundTrip for a::MailgunCluster {}
impl AfterRoundTrip for a::MailgunMachine {}
impl AfterRoundTrip for a::MailgunClusterTemplate {}
impl AfterRoundTrip for a::MailgunMachineTemplate {}

macro_rules! round_trips {
    ($name:ident, $strategy:expr, $from:ty, $to:ty, $from_v:literal, $to_v:literal) => {
        proptest! {
            #[test]
            fn $name(original in $strategy) {
                let there: $to = original.clone().into();
                let back: $from = there.clone().into();
                let original = original.after_round_trip();
                prop_assert_eq!(&back, &original);
                prop_assert!(no_conversion_annotation(&back.metadata));
                let there_json: $to = via_review(&original, $to_v);
                prop_assert_eq!(&there_json, &there);
                let back_json: $from = via_review(&there_json, $from_v);
                prop_assert_eq!(&back_json, &original);
            }
        }
    };
}

round_trips!(
    cluster_beta_alpha_beta,
    beta_cluster(),
    b::MailgunCluster,
    a::MailgunCluster,
    "v1beta1",
    "v1alpha1"
);
round_trips!(
    machine_beta_alpha_beta,
    beta_machine(),
    b::MailgunMachine,
    a::MailgunMachine,
    "v1beta1",
    "v1alpha1"
);
round_trips!(
    cluster_template_beta_alpha_beta,
    beta_cluster_template(),
    b::MailgunClusterTemplate,
    a::MailgunClusterTemplate,
    "v1beta1",
    "v1alpha1"
);
round_trips!(
    machine_template_beta_alpha_beta,
    beta_machine_template(),
    b::MailgunMachineTemplate,
    a::MailgunMachineTemplate,
    "v1beta1",
    "v1alpha1"
);
round_trips!(
    cluster_alpha_beta_alpha,
    alpha_cluster(),
    a::MailgunCluster,
    b::MailgunCluster,
    "v1alpha1",
    "v1beta1"
);
round_trips!(
    machine_alpha_beta_alpha,
    alpha_machine(),
    a::MailgunMachine,
    b::MailgunMachine,
    "v1alpha1",
    "v1beta1"
);
round_trips!(
    cluster_template_alpha_beta_alpha,
    alpha_cluster_template(),
    a::MailgunClusterTemplate,
    b::MailgunClusterTemplate,
    "v1alpha1",
    "v1beta1"
);
round_trips!(
    machine_template_alpha_beta_alpha,
    alpha_machine_template(),
    a::MailgunMachineTemplate,
    b::MailgunMachineTemplate,
    "v1alpha1",
    "v1beta1"
);

proptest! {
    /// Issue 14: down-conversion never writes status into the annotation, and up-conversion
    /// ignores a status someone put there.
    #[test]
    fn the_annotation_never_carries_status(original in beta_cluster(), machine in beta_machine()) {
        let alpha: a::MailgunCluster = original.clone().into();
        let alpha_machine: a::MailgunMachine = machine.into();
        for annotations in [&alpha.metadata.annotations, &alpha_machine.metadata.annotations] {
            if let Some(data) = annotations.as_ref().and_then(|a| a.get(CONVERSION_DATA_ANNOTATION)) {
                let data: serde_json::Value = serde_json::from_str(data).expect("JSON");
                prop_assert!(data.get("status").is_none(), "{}", data);
            }
        }
        let mut forged = alpha.clone();
        forged.metadata.annotations.get_or_insert_with(Default::default).insert(
            CONVERSION_DATA_ANNOTATION.to_owned(),
            r#"{"status":{"conditions":[{"type":"Hacked","status":"True","reason":"x","message":"","lastTransitionTime":"2026-01-02T03:04:05Z"}],"mail":{"state":"Sent","messageID":"<forged@evil.example>"}}}"#.to_owned(),
        );
        let stored: b::MailgunCluster = forged.clone().into();
        let expected: b::MailgunCluster = {
            let mut alpha = alpha;
            alpha.metadata.annotations.as_mut().map(|a| a.remove(CONVERSION_DATA_ANNOTATION));
            if alpha.metadata.annotations.as_ref().is_some_and(|a| a.is_empty()) {
                alpha.metadata.annotations = None;
            }
            alpha.into()
        };
        prop_assert_eq!(&stored.status, &expected.status);
        prop_assert!(stored.status.as_ref().is_none_or(|s| s.conditions.is_none() && s.mail.as_ref().is_none_or(|m| m.state.is_none())));
    }

    /// Up-conversion never carries the annotation into the storage version.
    #[test]
    fn alpha_objects_store_without_conversion_data(original in alpha_cluster()) {
        let stored: b::MailgunCluster = original.into();
        prop_assert!(no_conversion_annotation(&stored.metadata));
    }

    /// A v1alpha1 client that marks the object ready is not overruled by the kept snapshot.
    #[test]
    fn alpha_status_changes_win_over_the_snapshot(original in beta_cluster(), ready in any::<bool>(), response in option::of(token())) {
        let mut alpha: a::MailgunCluster = original.clone().into();
        let status = alpha.status.get_or_insert_with(Default::default);
        status.ready = ready;
        status.response = response.clone();
        let stored: b::MailgunCluster = alpha.into();
        let s = stored.status.unwrap_or_default();
        prop_assert_eq!(s.initialization.and_then(|i| i.provisioned).unwrap_or(false), ready);
        prop_assert_eq!(s.mail.and_then(|m| m.message_id), response);
        prop_assert_eq!(stored.spec, original.spec);
    }
}

#[test]
fn review_fails_whole_on_a_bad_object() {
    let request = serde_json::json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {
            "uid": "u1",
            "desiredAPIVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "objects": [
                {"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MailgunCluster",
                 "metadata": {"name": "ok"}, "spec": {"priority": "Urgent", "request": "r", "requester": "a@b.co"}},
                {"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MailgunCluster",
                 "metadata": {"name": "bad", "namespace": "ns"}, "spec": {"priority": "Whenever"}},
            ],
        }
    });
    let out = serde_json::to_value(review(serde_json::from_value(request).expect("review")))
        .expect("json");
    assert_eq!(out["response"]["uid"], "u1");
    assert_eq!(out["response"]["result"]["status"], "Failure");
    let message = out["response"]["result"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("object 1 (MailgunCluster ns/bad)"),
        "{message}"
    );
    assert_eq!(out["response"]["convertedObjects"], serde_json::json!([]));
}

#[test]
fn unknown_kinds_and_versions_are_refused() {
    for (api_version, kind, desired) in [
        (
            "infrastructure.cluster.x-k8s.io/v1alpha1",
            "DockerCluster",
            "infrastructure.cluster.x-k8s.io/v1beta1",
        ),
        (
            "infrastructure.cluster.x-k8s.io/v1alpha2",
            "MailgunCluster",
            "infrastructure.cluster.x-k8s.io/v1beta1",
        ),
        (
            "infrastructure.cluster.x-k8s.io/v1alpha1",
            "MailgunCluster",
            "cluster.x-k8s.io/v1beta2",
        ),
    ] {
        let object =
            serde_json::json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}});
        assert!(
            capm_api::conversion::convert(object, desired).is_err(),
            "{api_version} {kind} -> {desired}"
        );
    }
}

#[test]
fn metadata_is_passed_through_untouched_except_annotations() {
    let object = serde_json::json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunCluster",
        "metadata": {"name": "x", "namespace": "n", "uid": "u", "resourceVersion": "42", "generation": 3,
                     "creationTimestamp": "2026-01-02T03:04:05Z", "finalizers": ["f"],
                     "managedFields": [{"manager": "kubectl", "operation": "Apply", "apiVersion": "v1",
                                        "time": "2026-01-02T03:04:05Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}]},
        "spec": {"priority": "Urgent", "request": "r", "requester": "a@b.co",
                 "controlPlaneEndpoint": {"host": "h", "port": 6443}},
    });
    let out =
        capm_api::conversion::convert(object.clone(), "infrastructure.cluster.x-k8s.io/v1alpha1")
            .expect("convert");
    let mut meta = out["metadata"].clone();
    let annotations = meta
        .as_object_mut()
        .and_then(|m| m.remove("annotations"))
        .expect("annotation written");
    assert_eq!(meta, object["metadata"]);
    assert!(
        annotations[CONVERSION_DATA_ANNOTATION]
            .as_str()
            .is_some_and(|s| s.contains("controlPlaneEndpoint"))
    );
    let back = capm_api::conversion::convert(out, "infrastructure.cluster.x-k8s.io/v1beta1")
        .expect("convert");
    assert_eq!(back, object);
}
