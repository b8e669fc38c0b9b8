//! One delivery poller for the process: it asks the mail backend what became of every open
//! request mail, many per request where the backend can, and wakes an object's reconcile only
//! when its outcome changed. Reconciles register the mails they show as open ([`Poller::track`])
//! and read back what the poller learned; they never ask the backend themselves, so no reconcile
//! waits on it and no object holds a timer of its own. Its schedule, batches, request budget and
//! pauses: docs/how-it-works.md, step 4.

use std::{
    collections::HashMap,
    future::Future,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use capm_api::v1beta1::{MailgunCluster, MailgunMachine, MailgunRemediation};
use capm_mailer::{Delivery, Mailer, MessageId, OpenMail};
use futures::channel::mpsc;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::{Leadership, kinds::Mailed};

/// The poller's request budget: at most one request to the backend per this much time.
pub const REQUEST_GAP: Duration = Duration::from_millis(200);
/// How often a process that may not act checks again whether it may.
const NOT_LEADING_RECHECK: Duration = Duration::from_millis(500);

/// The poller's timings, from the controllers' configuration.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timings {
    /// First wait after the send, and the first step of the backoff.
    pub base: Duration,
    /// Longest wait between two questions about one mail.
    pub max: Duration,
    /// How long after the send the backend can still tell.
    pub retention: Duration,
}

/// Which object a mail belongs to, to wake its reconcile.
#[derive(Debug, Clone)]
struct Owner {
    kind: &'static str,
    namespace: String,
    name: String,
}

#[derive(Debug)]
struct Open {
    owner: Owner,
    mail: OpenMail,
    /// When to ask next; `None` once the outcome is final.
    due: Option<Instant>,
    /// When the backend no longer keeps the mail's events.
    expires: Instant,
    /// Questions asked that left the outcome open.
    polls: u32,
    /// What the backend said last (`None`: nothing yet).
    known: Option<Delivery>,
}

#[derive(Debug, Default)]
struct State {
    /// By UID. Boxed: a table slot is then a pointer, not the whole entry (a table grows by
    /// doubling, so half of its slots are often empty).
    mails: HashMap<String, Box<Open>>,
    paused_until: Option<Instant>,
}

/// Where the poller wakes each kind's reconciles; the runner holds the receiving ends (for
/// `Controller::reconcile_on`).
#[derive(Clone)]
pub(crate) struct WakeSenders {
    pub clusters: mpsc::UnboundedSender<ObjectRef<MailgunCluster>>,
    pub machines: mpsc::UnboundedSender<ObjectRef<MailgunMachine>>,
    pub remediations: mpsc::UnboundedSender<ObjectRef<MailgunRemediation>>,
}

/// The process's delivery poller (see the module); one more per mail identity in use
/// ([`Poller::sibling`]), each with its own request budget and pause.
pub struct Poller {
    mailer: Mutex<Arc<dyn Mailer>>,
    leadership: Leadership,
    timings: Timings,
    state: Mutex<State>,
    added: Notify,
    wakes: WakeSenders,
    /// Cancelled when this poller's run ends (shutdown); a sibling's is a child of it, so the
    /// siblings end with the first poller, or alone (cancelled: its identity is gone).
    pub(crate) stop: CancellationToken,
}

/// Whether `next` says something `known` did not (no answer and "no report yet" are the same).
fn is_news(known: Option<&Delivery>, next: &Delivery) -> bool {
    let nothing = Delivery::Pending {
        temporary_failure: None,
    };
    known.unwrap_or(&nothing) != next
}

/// When this process asks its first delivery question about a mail accepted `elapsed` ago:
/// never before `base` after the send (an answer within the send's own pass is all but always
/// "no report yet"), and, for mails found already older (this process just started or took
/// over), spread over the second half of one `base` by the object's UID: a restart does not ask
/// about every open mail at once, and the first half lets the restart's reconciles register
/// their mails, so a batching backend gets them in few questions.
fn first_question_in(base: Duration, elapsed: Duration, uid: &str) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    uid.hash(&mut hasher);
    let half = base / 2;
    let spread = half + half.mul_f64((hasher.finish() % 1024) as f64 / 1024.0);
    base.saturating_sub(elapsed).max(spread)
}

impl Poller {
    pub(crate) fn new(
        mailer: Arc<dyn Mailer>,
        leadership: Leadership,
        timings: Timings,
        wakes: WakeSenders,
    ) -> Self {
        Self {
            mailer: Mutex::new(mailer),
            leadership,
            timings,
            state: Mutex::default(),
            added: Notify::new(),
            wakes,
            stop: CancellationToken::new(),
        }
    }

    /// A poller asking `mailer` (a mail identity's backend) with a budget and pause of its own,
    /// waking the same reconciles, running until this one's run ends. Call within a runtime.
    pub(crate) fn sibling(&self, mailer: Arc<dyn Mailer>) -> Arc<Self> {
        let (leadership, wakes) = (self.leadership.clone(), self.wakes.clone());
        let sibling = Self {
            stop: self.stop.child_token(),
            ..Self::new(mailer, leadership, self.timings, wakes)
        };
        let sibling = Arc::new(sibling);
        let stop = sibling.stop.clone();
        tokio::spawn(Arc::clone(&sibling).run(stop.cancelled_owned()));
        sibling
    }

    /// Asks `mailer` from now on (a backend rebuilt with a rotated key).
    pub(crate) fn set_mailer(&self, mailer: Arc<dyn Mailer>) {
        *crate::lock(&self.mailer) = mailer;
    }

    fn mailer(&self) -> Arc<dyn Mailer> {
        Arc::clone(&crate::lock(&self.mailer))
    }

    fn wake(&self, owner: &Owner) {
        let (name, namespace) = (&owner.name, &owner.namespace);
        // Nobody listening (the controllers stopped) is not an error.
        let wakes = &self.wakes;
        match owner.kind {
            MailgunCluster::KIND => {
                drop(
                    wakes
                        .clusters
                        .unbounded_send(ObjectRef::new(name).within(namespace)),
                );
            }
            MailgunRemediation::KIND => {
                drop(
                    wakes
                        .remediations
                        .unbounded_send(ObjectRef::new(name).within(namespace)),
                );
            }
            _ => drop(
                wakes
                    .machines
                    .unbounded_send(ObjectRef::new(name).within(namespace)),
            ),
        }
    }

    /// Registers the open request mail `message_id` of object `uid` (accepted at `sent_at`,
    /// `elapsed` ago) if it is not yet, and returns what the backend said of it so far.
    pub(crate) fn track<K: Mailed>(
        &self,
        obj: &K,
        uid: &str,
        message_id: MessageId,
        sent_at: SystemTime,
        elapsed: Duration,
    ) -> Option<Delivery> {
        use kube::ResourceExt;
        let now = Instant::now();
        let mut state = crate::lock(&self.state);
        if let Some(open) = state.mails.get(uid)
            && open.mail.message_id == message_id
        {
            return open.known.clone();
        }
        let first = first_question_in(self.timings.base, elapsed, uid);
        state.mails.insert(
            uid.to_owned(),
            Box::new(Open {
                owner: Owner {
                    kind: K::KIND,
                    namespace: obj.namespace().unwrap_or_default(),
                    name: obj.name_any(),
                },
                mail: OpenMail {
                    message_id,
                    sent_at,
                },
                due: Some(now + first),
                expires: now + self.timings.retention.saturating_sub(elapsed),
                polls: 0,
                known: None,
            }),
        );
        drop(state);
        self.added.notify_one();
        None
    }

    /// Forgets object `uid`'s mail (its outcome is shown for good, or the object is gone).
    pub(crate) fn forget(&self, uid: &str) {
        crate::lock(&self.state).mails.remove(uid);
    }

    /// The wait before the next question or expiry is due (`None`: nothing is scheduled).
    fn next_in(&self, now: Instant) -> Option<Duration> {
        let state = crate::lock(&self.state);
        let next = state
            .mails
            .values()
            .flat_map(|m| [m.due, Some(m.expires)])
            .flatten()
            .min()?;
        let next = next.max(state.paused_until.unwrap_or(next));
        Some(next.saturating_duration_since(now))
    }

    /// The backoff after `polls` questions that left the outcome open.
    fn backoff(&self, polls: u32) -> Duration {
        self.timings
            .base
            .saturating_mul(1u32 << polls.saturating_sub(1).min(20))
            .min(self.timings.max)
    }

    /// Wakes the objects whose mails' retention has passed, and forgets those mails.
    fn expire(&self, now: Instant) {
        let mut state = crate::lock(&self.state);
        let expired: Vec<String> = state
            .mails
            .iter()
            .filter(|(_, m)| m.expires <= now)
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in expired {
            if let Some(open) = state.mails.remove(&uid) {
                self.wake(&open.owner);
            }
        }
    }

    /// Asks about the due mails, one request's worth; true when a request was made.
    pub(crate) async fn ask_due(&self) -> bool {
        let now = Instant::now();
        self.expire(now);
        let batch: Vec<(String, OpenMail)> = {
            let state = crate::lock(&self.state);
            if state.paused_until.is_some_and(|until| until > now) {
                return false;
            }
            // The due mails, and to fill the request (a batch costs what one mail costs) those
            // awaiting their first question within one base whose send is a base old already
            // (a process that just started spread them out by UID).
            let horizon = now + self.timings.base;
            let old_enough = SystemTime::now()
                .checked_sub(self.timings.base)
                .unwrap_or(SystemTime::UNIX_EPOCH);
            let mut due: Vec<(&String, &Open)> = state
                .mails
                .iter()
                .filter(|(_, m)| {
                    m.due.is_some_and(|d| {
                        d <= now || (m.polls == 0 && d <= horizon && m.mail.sent_at <= old_enough)
                    })
                })
                .map(|(uid, m)| (uid, &**m))
                .collect();
            if !due.iter().any(|(_, m)| m.due.is_some_and(|d| d <= now)) {
                return false;
            }
            due.sort_by_key(|(_, m)| m.due);
            due.into_iter()
                .take(self.mailer().delivery_batch_size().max(1))
                .map(|(uid, m)| (uid.clone(), m.mail.clone()))
                .collect()
        };
        if batch.is_empty() {
            return false;
        }
        let mails: Vec<OpenMail> = batch.iter().map(|(_, m)| m.clone()).collect();
        let answers = self.mailer().delivery_statuses(&mails).await;
        let now = Instant::now();
        let mut state = crate::lock(&self.state);
        match answers {
            Ok(answers) => {
                for ((uid, mail), answer) in batch.iter().zip(answers) {
                    let Some(open) = state.mails.get_mut(uid) else {
                        continue;
                    };
                    if open.mail != *mail {
                        continue;
                    }
                    if answer.is_final() {
                        open.due = None;
                    } else {
                        open.polls = open.polls.saturating_add(1);
                        open.due = Some(now + self.backoff(open.polls));
                    }
                    if is_news(open.known.as_ref(), &answer) {
                        open.known = Some(answer);
                        self.wake(&open.owner);
                    }
                }
            }
            Err(error) => {
                debug!(%error, mails = batch.len(), "Could not ask about deliveries");
                if let Some(wait) = error.retry_after() {
                    // The backend's rate limit is the account's: every question waits.
                    state.paused_until = Some(now + wait);
                } else {
                    for (uid, _) in &batch {
                        if let Some(open) = state.mails.get_mut(uid) {
                            open.polls = open.polls.saturating_add(1);
                            open.due = Some(now + self.backoff(open.polls));
                        }
                    }
                }
            }
        }
        true
    }

    /// Runs until `shutdown` resolves.
    pub(crate) async fn run(self: Arc<Self>, shutdown: impl Future<Output = ()>) {
        let stop = self.stop.clone();
        let shutdown = async move {
            tokio::select! {
                () = shutdown => stop.cancel(),
                () = stop.cancelled() => {}
            }
        };
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let wait = self
                .next_in(Instant::now())
                .unwrap_or(Duration::from_secs(3600));
            tokio::select! {
                () = &mut shutdown => return,
                () = self.added.notified() => continue,
                () = tokio::time::sleep(wait) => {}
            }
            if !self.leadership.may_act() {
                self.expire(Instant::now());
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(NOT_LEADING_RECHECK) => {}
                }
                continue;
            }
            if self.ask_due().await {
                tokio::select! {
                    () = &mut shutdown => return,
                    () = tokio::time::sleep(REQUEST_GAP) => {}
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use capm_mailer::{MailError, MockMailer};
    use futures::StreamExt;

    /// Wake senders, and the receiving end of the clusters' wake-ups.
    pub(crate) fn wakes() -> (
        WakeSenders,
        mpsc::UnboundedReceiver<ObjectRef<MailgunCluster>>,
    ) {
        let (clusters, woken) = mpsc::unbounded();
        let (machines, remediations) = (mpsc::unbounded().0, mpsc::unbounded().0);
        let wakes = WakeSenders {
            clusters,
            machines,
            remediations,
        };
        (wakes, woken)
    }

    impl Poller {
        /// Whether this poller holds a mail of object `uid`.
        pub(crate) fn holds(&self, uid: &str) -> bool {
            crate::lock(&self.state).mails.contains_key(uid)
        }
    }

    pub(crate) fn cluster(name: &str) -> MailgunCluster {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "MailgunCluster",
            "metadata": { "name": name, "namespace": "ns", "uid": name },
            "spec": { "priority": "Urgent", "request": "r", "requester": "dev@example.com" }
        }))
        .unwrap()
    }

    fn timings() -> Timings {
        Timings {
            base: Duration::from_millis(50),
            max: Duration::from_millis(400),
            retention: Duration::from_secs(3600),
        }
    }

    pub(crate) fn id(n: usize) -> MessageId {
        MessageId::parse(&format!("<m{n}@example.com>")).unwrap()
    }

    #[test]
    fn the_first_question_waits_a_base_after_the_send_and_spreads_a_restart() {
        let base = Duration::from_secs(30);
        for uid in ["a", "b", "c"] {
            assert_eq!(first_question_in(base, Duration::ZERO, uid), base);
        }
        let later: Vec<_> = (0..100)
            .map(|i| first_question_in(base, Duration::from_secs(3600), &format!("uid-{i}")))
            .collect();
        assert!(later.iter().all(|w| *w < base && *w >= base / 2));
        let distinct: std::collections::HashSet<_> = later.iter().collect();
        assert!(distinct.len() > 50, "not spread: {distinct:?}");
        assert!(first_question_in(base, Duration::from_secs(20), "a") >= Duration::from_secs(10));
        assert_eq!(
            first_question_in(base, Duration::from_secs(3600), "x"),
            first_question_in(base, Duration::from_secs(3600), "x")
        );
    }

    /// 250 open mails due at once: three requests of at most 100, and a wake-up only for the
    /// mails whose outcome changed.
    #[tokio::test]
    async fn due_mails_are_asked_in_batches_and_only_news_wakes() {
        let mut mock = MockMailer::new();
        mock.expect_delivery_batch_size().return_const(100usize);
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        mock.expect_delivery_statuses().returning(move |mails| {
            crate::lock(&seen).push(mails.len());
            Ok(mails
                .iter()
                .map(|m| {
                    if m.message_id == id(7) {
                        Delivery::Delivered
                    } else {
                        Delivery::Pending {
                            temporary_failure: None,
                        }
                    }
                })
                .collect())
        });
        // A base long enough that tracking 250 mails, or asking about them, never outlasts it
        // on a loaded machine (50 ms did, once, in a debug build beside a soak).
        let timings = Timings {
            base: Duration::from_millis(500),
            max: Duration::from_secs(4),
            ..timings()
        };
        let (senders, mut wakes) = wakes();
        let poller = Poller::new(
            Arc::new(mock),
            Leadership::unelected("test"),
            timings,
            senders,
        );
        for n in 0..250 {
            let obj = cluster(&format!("c{n}"));
            let sent = SystemTime::now();
            assert_eq!(
                poller.track(&obj, &format!("c{n}"), id(n), sent, Duration::ZERO),
                None
            );
        }
        // Nothing is due before one base after the send.
        assert!(!poller.ask_due().await);
        tokio::time::sleep(Duration::from_millis(600)).await;
        while poller.ask_due().await {}
        assert_eq!(*crate::lock(&sizes), [100, 100, 50]);
        let woken = wakes.next().await.unwrap();
        assert_eq!(woken.name, "c7");
        assert!(wakes.try_recv().is_err(), "woken without news");
        assert_eq!(
            poller.track(
                &cluster("c7"),
                "c7",
                id(7),
                SystemTime::now(),
                Duration::ZERO
            ),
            Some(Delivery::Delivered)
        );
        // The open ones wait a base again; the final one is never asked again.
        assert!(!poller.ask_due().await);
        tokio::time::sleep(Duration::from_millis(600)).await;
        while poller.ask_due().await {}
        assert_eq!(crate::lock(&sizes)[3..], [100, 100, 49]);
    }

    #[tokio::test]
    async fn a_retry_after_pauses_every_mail() {
        let mut mock = MockMailer::new();
        mock.expect_delivery_batch_size().return_const(1usize);
        let calls = Arc::new(Mutex::new(0));
        let counted = calls.clone();
        mock.expect_delivery_statuses().returning(move |mails| {
            *crate::lock(&counted) += 1;
            if *crate::lock(&counted) == 1 {
                Err(MailError::Retryable {
                    backend: "mock",
                    code: Some(429),
                    retry_after: Some(Duration::from_millis(300)),
                    message: "slow down".into(),
                    source: None,
                })
            } else {
                Ok(vec![Delivery::Delivered; mails.len()])
            }
        });
        let poller = Poller::new(
            Arc::new(mock),
            Leadership::unelected("test"),
            timings(),
            wakes().0,
        );
        for n in 0..3 {
            let obj = cluster(&format!("c{n}"));
            poller.track(
                &obj,
                &format!("c{n}"),
                id(n),
                SystemTime::now(),
                Duration::ZERO,
            );
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(poller.ask_due().await);
        // Paused: not one of the three is asked about, though all are due.
        assert!(!poller.ask_due().await);
        assert_eq!(*crate::lock(&calls), 1);
        let wait = poller.next_in(Instant::now()).unwrap();
        assert!(wait > Duration::from_millis(200), "{wait:?}");
        tokio::time::sleep(wait).await;
        while poller.ask_due().await {}
        assert_eq!(*crate::lock(&calls), 4);
    }

    #[tokio::test]
    async fn the_retention_cut_off_wakes_once_and_forgets() {
        let mut mock = MockMailer::new();
        mock.expect_delivery_batch_size().return_const(100usize);
        let (senders, mut wakes) = wakes();
        let poller = Poller::new(
            Arc::new(mock),
            Leadership::unelected("test"),
            Timings {
                retention: Duration::from_millis(100),
                base: Duration::from_secs(30),
                ..timings()
            },
            senders,
        );
        poller.track(
            &cluster("c1"),
            "c1",
            id(1),
            SystemTime::now(),
            Duration::ZERO,
        );
        let wait = poller.next_in(Instant::now()).unwrap();
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        tokio::time::sleep(wait).await;
        assert!(!poller.ask_due().await);
        assert_eq!(wakes.next().await.unwrap().name, "c1");
        assert!(poller.next_in(Instant::now()).is_none());
    }

    #[test]
    fn backoff_doubles_to_the_max() {
        let poller = Poller::new(
            Arc::new(MockMailer::new()),
            Leadership::unelected("test"),
            timings(),
            wakes().0,
        );
        let waits: Vec<_> = (1..8).map(|p| poller.backoff(p)).collect();
        assert_eq!(waits[0], Duration::from_millis(50));
        assert_eq!(waits[1], Duration::from_millis(100));
        assert_eq!(waits[3], Duration::from_millis(400));
        assert_eq!(waits[6], Duration::from_millis(400));
    }
}
