//! `MailgunRemediation` on the pipeline: which Cluster API objects ask for its reconciles.

use std::{future::Future, sync::Arc};

use capm_api::{
    capi::{Machine, MachineHealthCheck},
    v1beta1::{MailgunRemediation, RemediationPhase},
};
use futures::{StreamExt, stream::BoxStream};
use kube::{
    ResourceExt,
    runtime::{
        controller::Action,
        reflector::{ObjectRef, Store},
    },
};

use super::capi_triggers::{CapiWatches, Pipelined, by_cluster_label, labelled, targets};
use crate::context::{Ctx, ReconcileError};

impl Pipelined for MailgunRemediation {
    /// A `Machine` asks for the remediation named like it (its health, its owner's answer, its
    /// replacement under the same name); a `Cluster` (its pause) for every remediation labelled
    /// with its name; a `MachineHealthCheck` (its brake) for every held hand-back of its
    /// Cluster.
    fn capi_triggers(
        watches: &CapiWatches,
        own: &Store<Self>,
    ) -> Vec<BoxStream<'static, ObjectRef<Self>>> {
        let (machines, changes) = watches.machine_changes();
        let by_machine = changes.flat_map(move |heard| {
            targets(&machines, heard, |m: &Machine| {
                Some(ObjectRef::new(&m.name_any()).within(&m.namespace().unwrap_or_default()))
            })
        });
        let by_cluster = by_cluster_label(watches, own);
        let (checks, changes) = watches.health_check_changes();
        let held = own.clone();
        let by_brake = labelled(changes, checks, own, |c: &MachineHealthCheck| {
            c.spec.cluster_name.clone()
        })
        .filter(move |r| {
            let phase = held.get(r).and_then(|o| o.status.as_ref()?.phase);
            futures::future::ready(phase == Some(RemediationPhase::HandBackHeld))
        });
        vec![by_machine.boxed(), by_cluster, by_brake.boxed()]
    }

    fn reconcile(
        obj: Arc<Self>,
        ctx: Arc<Ctx>,
    ) -> impl Future<Output = Result<Action, ReconcileError>> + Send + 'static {
        crate::remediation::reconcile(obj, ctx)
    }
}
