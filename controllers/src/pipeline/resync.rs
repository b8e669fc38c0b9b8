//! The safety net: every object reconciled at least once per sync period, even with no event.
//!
//! controller-runtime's `SyncPeriod`, which kube-runtime lacks: a trigger lost anywhere costs at
//! most one period. The store's objects are walked one at a time, spaced evenly so that one walk
//! takes one period: no burst, a steady trickle of reconciles that write nothing when nothing
//! changed.

use std::{collections::VecDeque, time::Duration};

use tokio::time::Instant;

use futures::Stream;
use kube::{
    Resource,
    runtime::reflector::{ObjectRef, Store},
};

/// How long an empty store is waited on before it is looked at again: short, so that the first
/// walk begins right after the first list; looking at an empty store costs nothing.
const EMPTY_RECHECK: Duration = Duration::from_secs(2);

/// The objects of `store` in turn, one every `period / n` (`n`: the objects when the walk
/// began); an empty store is looked at again after `period` or [`EMPTY_RECHECK`], if shorter.
pub(crate) fn every_object<K>(
    store: Store<K>,
    period: Duration,
) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    let walk = Walk {
        queue: VecDeque::new(),
        gap: period,
        next: Instant::now(),
    };
    // Not `Store::wait_until_ready`: kube-runtime's delayed init wakes only the last of several
    // concurrent waiters (the controller's applier waits on it too). Before the first list the
    // store is empty, which waits the same way.
    futures::stream::unfold((store, walk), move |(store, mut walk)| async move {
        loop {
            if walk.queue.is_empty() {
                walk.queue = store
                    .state()
                    .iter()
                    .map(|o| ObjectRef::from_obj(&**o))
                    .collect();
                if walk.queue.is_empty() {
                    tokio::time::sleep(period.min(EMPTY_RECHECK)).await;
                    walk.next = Instant::now();
                    continue;
                }
                walk.gap = gap_for(period, walk.queue.len());
            }
            // Deadlines, not delays: the consumer's time does not stretch the period. A walk
            // that fell more than a gap behind (a stalled process) resumes from now rather than
            // catching up in a burst.
            walk.next += walk.gap;
            let now = Instant::now();
            if walk.next + walk.gap < now {
                walk.next = now;
            }
            tokio::time::sleep_until(walk.next).await;
            if let Some(next) = walk.queue.pop_front() {
                return Some((next, (store, walk)));
            }
        }
    })
}

/// Where a walk is: the objects left, their spacing and the next deadline.
struct Walk<K: Resource<DynamicType = ()>> {
    queue: VecDeque<ObjectRef<K>>,
    gap: Duration,
    next: Instant,
}

/// The spacing of a walk over `n` objects that lasts `period`.
fn gap_for(period: Duration, n: usize) -> Duration {
    period / u32::try_from(n.max(1)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_api::v1beta1::MailgunCluster;
    use futures::StreamExt;
    use kube::runtime::{reflector, watcher};

    fn object(name: &str) -> MailgunCluster {
        super::super::tests::test_object(name, name, "1")
    }

    #[tokio::test(start_paused = true)]
    async fn each_object_once_per_period_spread_evenly() {
        let (store, mut writer) = reflector::store::<MailgunCluster>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for name in ["a", "b", "c", "d"] {
            writer.apply_watcher_event(&watcher::Event::InitApply(object(name)));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let period = Duration::from_secs(40);
        let started = tokio::time::Instant::now();
        let mut walk = every_object(store, period).boxed();
        let mut seen = Vec::new();
        for _ in 0..8 {
            let r = walk.next().await.expect("an object");
            seen.push((r.name, started.elapsed().as_secs()));
        }
        let mut first: Vec<_> = seen[..4].iter().map(|(n, _)| n.clone()).collect();
        first.sort();
        assert_eq!(first, ["a", "b", "c", "d"], "every object in one period");
        let times: Vec<u64> = seen.iter().map(|(_, t)| *t).collect();
        assert_eq!(times, [10, 20, 30, 40, 50, 60, 70, 80], "evenly spread");
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_consumer_does_not_stretch_the_period() {
        let (store, mut writer) = reflector::store::<MailgunCluster>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for name in ["a", "b", "c", "d"] {
            writer.apply_watcher_event(&watcher::Event::InitApply(object(name)));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let started = tokio::time::Instant::now();
        let mut walk = every_object(store, Duration::from_secs(40)).boxed();
        let mut times = Vec::new();
        for _ in 0..4 {
            walk.next().await.expect("an object");
            times.push(started.elapsed().as_secs());
            // The consumer takes half a gap before it asks for the next object.
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        assert_eq!(times, [10, 20, 30, 40], "one walk per period");
    }

    #[test]
    fn the_gap_of_a_large_store_is_small_and_never_zero_objects() {
        assert_eq!(
            gap_for(Duration::from_secs(36_000), 1000),
            Duration::from_secs(36)
        );
        assert_eq!(gap_for(Duration::from_secs(10), 0), Duration::from_secs(10));
    }
}
