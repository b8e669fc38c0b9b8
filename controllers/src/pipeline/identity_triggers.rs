//! The reconciles a mail identity's change asks for: a `MailgunClusterIdentity` or a Secret
//! claimed for one changed, so the objects whose mails go through it are reconciled now, not
//! after the backoff their refusal (`IdentityInvalid`, `IdentityNotAllowed`, ...) built up.
//!
//! Read from the stores the reconciles read ([`Stores`]): a `MailgunCluster` names its identity,
//! a `MailgunMachine` has its Cluster's `MailgunCluster`'s. No hot loop: an identity that changes
//! often asks for a reconcile of each object naming it per change, and a reconcile of an
//! unchanged object whose mail is done sends and writes nothing. A namespace whose labels
//! changed (an `allowedNamespaces` selector, the provider's own scope's included, reads them)
//! asks for the objects in it ([`namespace_triggers`]).

use futures::{StreamExt, stream::BoxStream};
use kube::{
    ResourceExt,
    runtime::reflector::{ObjectRef, Store},
};

use crate::kinds::{Mailed, Stores};

/// What the identities' and their Secrets' watches heard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum IdentityNews {
    /// The identity of this name, or a Secret claimed for it, changed.
    Changed(String),
    /// A watch listed again (after a failure): any identity may have changed.
    Relisted,
}

/// Every object of `own` in each namespace `changed` names: a namespace's labels may decide
/// whether an identity (the provider's own included) serves it.
pub(super) fn namespace_triggers<K: Mailed>(
    changed: BoxStream<'static, String>,
    own: Store<K>,
) -> BoxStream<'static, ObjectRef<K>> {
    changed
        .flat_map(move |namespace| {
            let objects: Vec<ObjectRef<K>> = own
                .state()
                .iter()
                .filter(|obj| obj.namespace().as_deref() == Some(namespace.as_str()))
                .map(|obj| ObjectRef::from_obj(&**obj))
                .collect();
            futures::stream::iter(objects)
        })
        .boxed()
}

/// The objects of `own` that `news` concerns, as they come.
pub(super) fn identity_triggers<K: Mailed>(
    news: BoxStream<'static, IdentityNews>,
    own: Store<K>,
    capi: Stores,
) -> BoxStream<'static, ObjectRef<K>> {
    news.flat_map(move |news| futures::stream::iter(concerned(&news, &own, &capi)))
        .boxed()
}

/// The objects of `own` whose mails go through the identity `news` names (after a re-list:
/// through any identity).
fn concerned<K: Mailed>(news: &IdentityNews, own: &Store<K>, capi: &Stores) -> Vec<ObjectRef<K>> {
    own.state()
        .iter()
        .filter(|obj| {
            // A cache not listed yet names nothing, as an empty one would.
            match (news, obj.wanted_identity(capi).ok().flatten()) {
                (_, None) => false,
                (IdentityNews::Relisted, Some(_)) => true,
                (IdentityNews::Changed(changed), Some(name)) => *changed == name,
            }
        })
        .map(|obj| ObjectRef::from_obj(&**obj))
        .collect()
}

#[cfg(test)]
mod tests {
    use capm_api::v1beta1::MailgunCluster;
    use kube::runtime::{reflector, watcher::Event};

    use super::*;
    use crate::pipeline::tests::test_object;

    /// A change to an identity asks for the objects naming it only; a re-list for every object
    /// naming one; the objects without one are never asked for.
    #[test]
    fn an_identity_change_asks_for_the_objects_naming_it() {
        let (own, mut writer) = reflector::store::<MailgunCluster>();
        writer.apply_watcher_event(&Event::Init);
        for (name, identity) in [("a", Some("x")), ("b", Some("y")), ("c", None)] {
            let mut obj = test_object(name, name, "1");
            obj.spec.identity_ref = identity.map(|i| {
                serde_json::from_value(serde_json::json!({
                    "kind": "MailgunClusterIdentity", "name": i
                }))
                .expect("a reference")
            });
            writer.apply_watcher_event(&Event::InitApply(obj));
        }
        writer.apply_watcher_event(&Event::InitDone);
        let capi = crate::kinds::tests::stores(reflector::store().0, reflector::store().0);
        let names = |news: IdentityNews| {
            let mut names: Vec<String> = concerned(&news, &own, &capi)
                .into_iter()
                .map(|r| r.name)
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(IdentityNews::Changed("x".into())), ["a"]);
        assert!(names(IdentityNews::Changed("z".into())).is_empty());
        assert_eq!(names(IdentityNews::Relisted), ["a", "b"]);
    }
}
