//! The fulfilment page's rate limits: fixed windows per client address and per link, in
//! memory (each replica counts its own; behind one Service the limits are per replica).

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::Mutex,
    time::{Duration, Instant},
};

/// The window every limit counts in.
pub const WINDOW: Duration = Duration::from_secs(600);
/// Form submissions per link per window.
pub const POSTS_PER_TOKEN: u32 = 5;
/// Form submissions per client address per window.
pub const POSTS_PER_ADDRESS: u32 = 30;
/// Requests of any kind per client address per window.
pub const REQUESTS_PER_ADDRESS: u32 = 300;
/// Keys remembered at most; past it, new keys are refused until windows end (fail closed).
const MAX_KEYS: usize = 10_000;

/// Counts per key in the current window.
#[derive(Debug, Default)]
pub struct Limiter {
    counts: Mutex<HashMap<Box<str>, (Instant, u32)>>,
}

impl Limiter {
    /// Counts a request from `address` (a submission when `post`); false past a limit.
    /// An IPv6 client counts by its /64 (one host usually holds a whole /64, and would
    /// otherwise get a fresh budget per address and fill the table).
    pub fn allow_address(&self, address: IpAddr, post: bool) -> bool {
        let client = client_key(address);
        let any = self.allow(format!("a:{client}"), REQUESTS_PER_ADDRESS);
        any && (!post || self.allow(format!("p:{client}"), POSTS_PER_ADDRESS))
    }

    /// Counts a submission for the link `token`; false past the limit.
    pub fn allow_token(&self, token: &str) -> bool {
        let digest = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let key: String = digest.as_ref()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.allow(format!("t:{key}"), POSTS_PER_TOKEN)
    }

    fn allow(&self, key: String, limit: u32) -> bool {
        let now = Instant::now();
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if counts.len() >= MAX_KEYS && !counts.contains_key(key.as_str()) {
            counts.retain(|_, (start, _)| now.duration_since(*start) < WINDOW);
            if counts.len() >= MAX_KEYS {
                return false;
            }
        }
        let (start, count) = counts.entry(key.into()).or_insert((now, 0));
        if now.duration_since(*start) >= WINDOW {
            *start = now;
            *count = 0;
        }
        *count += 1;
        *count <= limit
    }
}

/// The key an address counts under: an IPv4 address (also IPv4-mapped IPv6) itself, an IPv6
/// address its /64 prefix.
fn client_key(address: IpAddr) -> String {
    match address {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_link_and_address_has_its_own_budget() {
        let limiter = Limiter::default();
        for _ in 0..POSTS_PER_TOKEN {
            assert!(limiter.allow_token("a"));
        }
        assert!(!limiter.allow_token("a"));
        assert!(limiter.allow_token("b"));
        let (one, two) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        for _ in 0..POSTS_PER_ADDRESS {
            assert!(limiter.allow_address(one, true));
        }
        assert!(!limiter.allow_address(one, true));
        assert!(limiter.allow_address(one, false));
        assert!(limiter.allow_address(two, true));
    }

    #[test]
    fn an_ipv6_client_counts_by_its_prefix() {
        let limiter = Limiter::default();
        let host = |last: u16| IpAddr::from([0x2001, 0xdb8, 1, 2, 0, 0, 0, last]);
        for i in 0..POSTS_PER_ADDRESS {
            assert!(limiter.allow_address(host(i as u16), true));
        }
        assert!(!limiter.allow_address(host(999), true), "same /64");
        assert!(limiter.allow_address(IpAddr::from([0x2001, 0xdb8, 1, 3, 0, 0, 0, 1]), true));
        let mapped: IpAddr = "::ffff:10.0.0.9".parse().unwrap();
        assert_eq!(client_key(mapped), "10.0.0.9");
    }
}
