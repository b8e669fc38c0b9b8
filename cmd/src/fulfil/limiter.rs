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
    pub fn allow_address(&self, address: IpAddr, post: bool) -> bool {
        let any = self.allow(format!("a:{address}"), REQUESTS_PER_ADDRESS);
        any && (!post || self.allow(format!("p:{address}"), POSTS_PER_ADDRESS))
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
}
