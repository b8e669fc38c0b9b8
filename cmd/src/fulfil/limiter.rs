//! The fulfilment page's rate limits: GCRA (`governor`) keyed limiters per client address, per
//! client network (/24, /48) and per link, in memory (each replica counts its own; behind one
//! Service the limits are per replica).
//!
//! Nothing here can lock a newcomer out: every table is bounded by evicting its least limited
//! keys (the oldest theoretical arrival times: those closest to a fresh budget) when full, and
//! keys back at a fresh budget are dropped every [`HOUSEKEEPING`] anyway. A refusal adds no key.
//! A link is counted only once it opened (by the object's UID), so made-up links spend only
//! their sender's own budgets.

use std::{
    collections::HashMap,
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    num::NonZeroU32,
    sync::Mutex,
    time::{Duration, Instant},
};

use governor::{
    Quota, RateLimiter,
    clock::{Clock, DefaultClock},
    middleware::NoOpMiddleware,
    nanos::Nanos,
    state::{StateStore, keyed::ShrinkableKeyedStateStore},
};

/// The period every limit is stated in (a budget refills fully within it).
pub const WINDOW: Duration = Duration::from_secs(600);
/// Form submissions per opened link (per object UID) per window.
pub const POSTS_PER_LINK: u32 = 5;
/// Form submissions per client address per window.
pub const POSTS_PER_ADDRESS: u32 = 30;
/// Requests of any kind per client address per window.
pub const REQUESTS_PER_ADDRESS: u32 = 300;
/// Form submissions per client network (IPv4 /24, IPv6 /48) per window.
pub const POSTS_PER_NETWORK: u32 = 300;
/// Requests of any kind per client network per window.
pub const REQUESTS_PER_NETWORK: u32 = 3_000;
/// Keys each table keeps at most; past it the least limited half is forgotten.
pub const MAX_KEYS: usize = 10_000;
/// How often keys back at a fresh budget are dropped.
pub const HOUSEKEEPING: Duration = Duration::from_secs(60);

/// One limit: a GCRA limiter over a bounded table.
type Keyed<K> =
    RateLimiter<K, Bounded<K>, DefaultClock, NoOpMiddleware<<DefaultClock as Clock>::Instant>>;

/// The page's limits.
#[derive(Debug)]
pub struct Limiter {
    requests_by_address: Keyed<IpAddr>,
    posts_by_address: Keyed<IpAddr>,
    requests_by_network: Keyed<IpAddr>,
    posts_by_network: Keyed<IpAddr>,
    posts_by_link: Keyed<String>,
    clock: DefaultClock,
    swept: Mutex<Instant>,
}

impl Default for Limiter {
    fn default() -> Self {
        Self::with_capacity(MAX_KEYS)
    }
}

impl Limiter {
    /// The page's limits, each table keeping at most `capacity` keys.
    pub fn with_capacity(capacity: usize) -> Self {
        fn keyed<K: Hash + Eq + Clone>(per_window: u32, capacity: usize) -> Keyed<K> {
            RateLimiter::new(
                quota(per_window),
                Bounded::new(capacity),
                DefaultClock::default(),
            )
        }
        Self {
            requests_by_address: keyed(REQUESTS_PER_ADDRESS, capacity),
            posts_by_address: keyed(POSTS_PER_ADDRESS, capacity),
            requests_by_network: keyed(REQUESTS_PER_NETWORK, capacity),
            posts_by_network: keyed(POSTS_PER_NETWORK, capacity),
            posts_by_link: keyed(POSTS_PER_LINK, capacity),
            clock: DefaultClock::default(),
            swept: Mutex::new(Instant::now()),
        }
    }

    /// Counts a request from `address` (a submission when `post`) against its address and its
    /// network. `Err` holds how long until the next one is allowed.
    ///
    /// # Errors
    /// Past a limit.
    pub fn allow_address(&self, address: IpAddr, post: bool) -> Result<(), Duration> {
        self.housekeeping();
        let (client, network) = (client_key(address), network_key(address));
        // The network first: a network past its limit adds no address keys.
        self.check(&self.requests_by_network, &network)?;
        self.check(&self.requests_by_address, &client)?;
        if post {
            self.check(&self.posts_by_network, &network)?;
            self.check(&self.posts_by_address, &client)?;
        }
        Ok(())
    }

    /// Counts a submission for the opened link of the object `uid`.
    ///
    /// # Errors
    /// Past the limit; how long until the next one is allowed.
    pub fn allow_link(&self, uid: &str) -> Result<(), Duration> {
        self.check(&self.posts_by_link, &uid.to_owned())
    }

    fn check<K: Hash + Eq + Clone>(&self, limiter: &Keyed<K>, key: &K) -> Result<(), Duration> {
        limiter
            .check_key(key)
            .map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// Drops the keys back at a fresh budget, at most every [`HOUSEKEEPING`].
    fn housekeeping(&self) {
        {
            let mut swept = self.swept.lock().unwrap_or_else(|e| e.into_inner());
            if swept.elapsed() < HOUSEKEEPING {
                return;
            }
            *swept = Instant::now();
        }
        self.requests_by_address.retain_recent();
        self.posts_by_address.retain_recent();
        self.requests_by_network.retain_recent();
        self.posts_by_network.retain_recent();
        self.posts_by_link.retain_recent();
    }

    /// Keys held, over all tables.
    #[cfg(test)]
    fn keys(&self) -> usize {
        self.requests_by_address.len()
            + self.posts_by_address.len()
            + self.requests_by_network.len()
            + self.posts_by_network.len()
            + self.posts_by_link.len()
    }
}

/// `per_window` cells per [`WINDOW`], all of them at once at most.
fn quota(per_window: u32) -> Quota {
    let burst = NonZeroU32::new(per_window).unwrap_or(NonZeroU32::MIN);
    Quota::with_period(WINDOW / burst.get())
        .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
        .allow_burst(burst)
}

/// A GCRA state table that never refuses a key: past its capacity, the half of its keys with
/// the earliest theoretical arrival times (the least limited) is forgotten; a key forgotten
/// starts again with a fresh budget, as after a restart.
#[derive(Debug)]
pub struct Bounded<K> {
    capacity: usize,
    /// Theoretical arrival time per key, in nanoseconds from the limiter's start.
    tats: Mutex<HashMap<K, u64>>,
}

impl<K> Bounded<K> {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(2),
            tats: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone> StateStore for Bounded<K> {
    type Key = K;

    fn measure_and_replace<T, F, E>(&self, key: &K, f: F) -> Result<T, E>
    where
        F: Fn(Option<Nanos>) -> Result<(T, Nanos), E>,
    {
        let mut tats = self.tats.lock().unwrap_or_else(|e| e.into_inner());
        let (outcome, tat) = f(tats.get(key).copied().map(Nanos::new))?;
        if !tats.contains_key(key) && tats.len() >= self.capacity {
            let mut all: Vec<u64> = tats.values().copied().collect();
            let half = all.len() / 2;
            let (_, &mut median, above) = all.select_nth_unstable(half);
            let greater = above.iter().filter(|&&t| t > median).count();
            // Keys at the median are kept only as far as they fit the upper half.
            let mut ties = (all.len() - half).saturating_sub(greater);
            tats.retain(|_, tat| {
                if *tat > median {
                    true
                } else if *tat == median && ties > 0 {
                    ties -= 1;
                    true
                } else {
                    false
                }
            });
        }
        if let Some(stored) = tats.get_mut(key) {
            *stored = tat.as_u64();
        } else {
            tats.insert(key.clone(), tat.as_u64());
        }
        Ok(outcome)
    }
}

impl<K: Hash + Eq + Clone> ShrinkableKeyedStateStore<K> for Bounded<K> {
    fn retain_recent(&self, drop_below: Nanos) {
        let mut tats = self.tats.lock().unwrap_or_else(|e| e.into_inner());
        tats.retain(|_, tat| *tat > drop_below.as_u64());
    }

    fn shrink_to_fit(&self) {
        self.tats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .shrink_to_fit();
    }

    fn len(&self) -> usize {
        self.tats.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The key an address counts under: an IPv4 address (also IPv4-mapped IPv6) itself, an IPv6
/// address its /64 prefix (one host usually holds a whole /64).
fn client_key(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !((1 << 64) - 1))),
    }
}

/// The network an address counts under as well: its IPv4 /24, its IPv6 /48.
fn network_key(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from_bits(v4.to_bits() & 0xffff_ff00)),
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !((1 << 80) - 1))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_link_and_address_has_its_own_budget() {
        let limiter = Limiter::default();
        for _ in 0..POSTS_PER_LINK {
            assert!(limiter.allow_link("uid-a").is_ok());
        }
        let wait = limiter.allow_link("uid-a").unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= WINDOW / POSTS_PER_LINK,
            "{wait:?}"
        );
        assert!(limiter.allow_link("uid-b").is_ok());
        let (one, two) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        for _ in 0..POSTS_PER_ADDRESS {
            assert!(limiter.allow_address(one, true).is_ok());
        }
        assert!(limiter.allow_address(one, true).is_err());
        assert!(limiter.allow_address(one, false).is_ok());
        assert!(limiter.allow_address(two, true).is_ok());
    }

    #[test]
    fn an_ipv6_client_counts_by_its_prefix() {
        let limiter = Limiter::default();
        let host = |last: u16| IpAddr::from([0x2001, 0xdb8, 1, 2, 0, 0, 0, last]);
        for i in 0..POSTS_PER_ADDRESS {
            assert!(limiter.allow_address(host(i as u16), true).is_ok());
        }
        assert!(limiter.allow_address(host(999), true).is_err(), "same /64");
        assert!(
            limiter
                .allow_address(IpAddr::from([0x2001, 0xdb8, 1, 3, 0, 0, 0, 1]), true)
                .is_ok()
        );
        let mapped: IpAddr = "::ffff:10.0.0.9".parse().unwrap();
        assert_eq!(client_key(mapped), IpAddr::from([10, 0, 0, 9]));
        assert_eq!(network_key(mapped), IpAddr::from([10, 0, 0, 0]));
        assert_eq!(
            network_key(host(7)),
            "2001:db8:1::".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn a_network_counts_all_its_addresses() {
        let limiter = Limiter::default();
        let mut refused = 0;
        for i in 0..=POSTS_PER_NETWORK {
            let address = IpAddr::from([192, 0, 2, (i % 250) as u8]);
            if limiter.allow_address(address, true).is_err() {
                refused += 1;
            }
        }
        assert!(refused >= 1, "the /24 has {POSTS_PER_NETWORK} submissions");
        assert!(
            limiter
                .allow_address(IpAddr::from([192, 0, 3, 1]), true)
                .is_ok()
        );
    }

    /// The attack of issue 54: thousands of made-up links from many addresses used to fill the
    /// one table and lock every newcomer out.
    #[test]
    fn junk_from_thousands_of_addresses_locks_no_newcomer_out() {
        let limiter = Limiter::with_capacity(1_000);
        let mut sent = 0;
        for a in 0..40u8 {
            for b in 0..=255u8 {
                for _ in 0..4 {
                    // Made-up links never open, so they count only against their senders.
                    let _ = limiter.allow_address(IpAddr::from([10, a, b, 1]), true);
                    sent += 1;
                }
            }
        }
        assert!(sent > 40_000);
        assert!(limiter.keys() <= 5 * 1_000, "bounded: {}", limiter.keys());
        let newcomer = IpAddr::from([198, 51, 100, 7]);
        assert!(limiter.allow_address(newcomer, false).is_ok(), "GET");
        assert!(limiter.allow_address(newcomer, true).is_ok(), "POST");
        assert!(limiter.allow_link("the-newcomer's-object").is_ok());
        // A newcomer from an attacked network is limited only by the network's own budget.
        let attacked = IpAddr::from([10, 39, 255, 9]);
        assert!(limiter.allow_address(attacked, false).is_ok());
    }

    #[test]
    fn a_full_table_forgets_its_least_limited_keys() {
        let store = Bounded::<u32>::new(4);
        for (key, tat) in [(1, 10), (2, 40), (3, 20), (4, 30)] {
            let _: Result<(), ()> = store.measure_and_replace(&key, |_| Ok(((), Nanos::new(tat))));
        }
        let _: Result<(), ()> = store.measure_and_replace(&5, |_| Ok(((), Nanos::new(50))));
        let mut kept: Vec<u32> = store.tats.lock().unwrap().keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, [2, 4, 5], "the two earliest arrival times went");
        // A refusal adds no key.
        let _: Result<(), ()> = store.measure_and_replace(&6, |_| Err(()));
        assert_eq!(store.len(), 3);
        store.retain_recent(Nanos::new(40));
        assert_eq!(store.len(), 1);
    }
}
