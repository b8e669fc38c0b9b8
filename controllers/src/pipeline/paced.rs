//! Reconciles asked for in bulk, handed to the controller a window at a time.
//!
//! A list (the first, a re-list) asks for a reconcile of every object it brought, and a list of
//! the Cluster API objects for every object they name: thousands at once. Handed to
//! kube-runtime's scheduler together, each costs a timer slot, a table entry and a copy of the
//! reference there, and the scheduler keeps the capacity it grew to for the life of the process
//! (7 MB after a list of 10 000, as heaptrack measured). The [`Pacer`] keeps them instead, as
//! one short key each and without duplicates, and lets at most a window of them into the
//! scheduler at a time: one more each time one of them has been reconciled. An object asked for
//! again while its earlier reconcile is handed and unfinished is handed again, as kube's
//! scheduler would take a second trigger: none is dropped. Reconciles asked for
//! by a change (a watch event, a wake-up, a retry) do not wait behind a list: they do not come
//! through here.

use std::{
    collections::HashSet,
    marker::PhantomData,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, Waker},
};

use futures::Stream;
use indexmap::IndexSet;
use kube::{Resource, runtime::reflector::ObjectRef};

use crate::compact::Key;

struct State {
    /// Asked for, not handed yet.
    waiting: IndexSet<Key>,
    /// Handed to the controller, their reconcile not finished yet (at most `window`).
    handed: HashSet<Key>,
    window: usize,
    waker: Option<Waker>,
}

/// The queue of bulk reconciles of one controller (see the module docs). Cloning shares it.
#[derive(Clone)]
pub(crate) struct Pacer {
    state: Arc<Mutex<State>>,
}

impl Pacer {
    /// A pacer that lets `window` reconciles (at least one) into the controller at a time.
    pub(crate) fn new(window: usize) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                waiting: IndexSet::new(),
                handed: HashSet::new(),
                window: window.max(1),
                waker: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Asks for a reconcile of `r` (once, however often it is asked for before it is handed).
    pub(crate) fn ask<K: Resource>(&self, r: &ObjectRef<K>) {
        let mut state = self.lock();
        state.waiting.insert(Key::of(r));
        if state.handed.len() < state.window
            && let Some(waker) = state.waker.take()
        {
            waker.wake();
        }
    }

    /// A reconcile of `r` finished (whatever asked for it): frees its place in the window if
    /// the pacer had handed it.
    pub(crate) fn finished<K: Resource>(&self, r: &ObjectRef<K>) {
        let mut state = self.lock();
        // Most reconciles are not the pacer's: no key is built for them.
        if !state.handed.is_empty()
            && state.handed.remove(&Key::of(r))
            && !state.waiting.is_empty()
            && let Some(waker) = state.waker.take()
        {
            waker.wake();
        }
    }

    /// How many wait, and how many are handed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> (usize, usize) {
        let state = self.lock();
        (state.waiting.len(), state.handed.len())
    }

    /// The reconciles to hand to the controller of `K`, as the window allows. Never ends.
    pub(crate) fn stream<K: Resource<DynamicType = ()>>(&self) -> Paced<K> {
        Paced {
            pacer: self.clone(),
            kind: PhantomData,
        }
    }
}

/// The stream of [`Pacer::stream`].
pub(crate) struct Paced<K> {
    pacer: Pacer,
    kind: PhantomData<fn() -> K>,
}

impl<K: Resource<DynamicType = ()>> Stream for Paced<K> {
    type Item = ObjectRef<K>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut state = self.pacer.lock();
        let state = &mut *state;
        if state.handed.len() < state.window
            // The first asked is handed first, but for the one moved into its place.
            && let Some(key) = state.waiting.swap_remove_index(0)
        {
            // One handed before and not finished yet is handed again: its reconcile may already
            // be running against the snapshot before this ask, and kube's scheduler runs it
            // once more after it (or folds the two, if it has not started).
            let reference = key.to_ref();
            state.handed.insert(key);
            return Poll::Ready(Some(reference));
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_api::v1beta1::MailgunCluster;
    use futures::{FutureExt, StreamExt};

    fn r(name: &str) -> ObjectRef<MailgunCluster> {
        ObjectRef::new(name).within("ns")
    }

    fn ready(paced: &mut Paced<MailgunCluster>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Some(next)) = paced.next().now_or_never() {
            out.push(next.name);
        }
        out
    }

    #[test]
    fn a_window_at_a_time_one_more_per_finished_reconcile() {
        let pacer = Pacer::new(2);
        let mut paced = pacer.stream::<MailgunCluster>();
        for name in ["a", "b", "c", "d", "b"] {
            pacer.ask(&r(name));
        }
        assert_eq!(pacer.len(), (4, 0), "asked twice, waiting once");
        let first = ready(&mut paced);
        assert_eq!(first.len(), 2, "the window: {first:?}");
        assert_eq!(
            ready(&mut paced),
            Vec::<String>::new(),
            "the window is full"
        );
        // A reconcile the pacer did not hand frees nothing.
        pacer.finished(&r("z"));
        assert!(ready(&mut paced).is_empty());
        pacer.finished(&r(&first[0]));
        let second = ready(&mut paced);
        assert_eq!(second.len(), 1);
        pacer.finished(&r(&first[1]));
        pacer.finished(&r(&second[0]));
        let third = ready(&mut paced);
        assert_eq!(third.len(), 1);
        let mut all: Vec<String> = [first, second, third].concat();
        all.sort();
        assert_eq!(all, ["a", "b", "c", "d"], "each once");
        assert_eq!(pacer.len(), (0, 1));
    }

    /// A list asks again for an object whose reconcile the pacer handed and which has not
    /// finished (it may be running against the snapshot before the list): it is handed again,
    /// not dropped.
    #[test]
    fn an_object_asked_again_while_handed_is_handed_again() {
        let pacer = Pacer::new(2);
        let mut paced = pacer.stream::<MailgunCluster>();
        pacer.ask(&r("a"));
        assert_eq!(ready(&mut paced), ["a"]);
        pacer.ask(&r("a"));
        assert_eq!(ready(&mut paced), ["a"], "handed again");
        assert_eq!(pacer.len(), (0, 1), "one place in the window");
        pacer.finished(&r("a"));
        assert_eq!(pacer.len(), (0, 0));
    }

    /// What `paced` yields next, when it waits on its own first and `then` wakes it.
    async fn woken(mut paced: Paced<MailgunCluster>, then: impl FnOnce()) -> Option<String> {
        let waiting = tokio::spawn(async move { paced.next().await.map(|r| r.name) });
        tokio::task::yield_now().await;
        then();
        tokio::time::timeout(std::time::Duration::from_secs(1), waiting)
            .await
            .expect("woken")
            .expect("no panic")
    }

    #[tokio::test]
    async fn an_ask_wakes_a_waiting_stream() {
        let pacer = Pacer::new(4);
        let got = woken(pacer.stream(), || pacer.ask(&r("late"))).await;
        assert_eq!(got.as_deref(), Some("late"));
    }

    #[tokio::test]
    async fn a_finished_reconcile_wakes_a_stream_held_by_the_window() {
        let pacer = Pacer::new(1);
        let mut paced = pacer.stream::<MailgunCluster>();
        pacer.ask(&r("a"));
        pacer.ask(&r("b"));
        assert_eq!(paced.next().await.map(|r| r.name).as_deref(), Some("a"));
        let got = woken(paced, || pacer.finished(&r("a"))).await;
        assert_eq!(got.as_deref(), Some("b"));
    }
}
