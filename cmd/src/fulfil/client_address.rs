//! The client's address: the peer, or what trusted proxies say in `X-Forwarded-For`.

use std::net::IpAddr;

use http::HeaderMap;

/// The client behind `peer`: `peer` itself unless it is one of the `trusted` proxies; then the
/// `X-Forwarded-For` entries (all the header's lines, in order) read right to left, each
/// trusted hop skipped, up to the first entry that is not a trusted proxy. An entry that is
/// not an address ends the walk at the last trusted hop (whoever wrote it chose it). Only what
/// trusted proxies appended is believed, whatever a client sent before them.
pub(super) fn forwarded_client(
    peer: IpAddr,
    headers: &HeaderMap,
    trusted: &[ipnet::IpNet],
) -> IpAddr {
    let is_trusted = |address: IpAddr| {
        let address = address.to_canonical();
        trusted.iter().any(|net| net.contains(&address))
    };
    if !is_trusted(peer) {
        return peer;
    }
    let entries = headers
        .get_all("x-forwarded-for")
        .iter()
        .rev()
        .flat_map(|line| line.to_str().unwrap_or("").rsplit(','));
    let mut client = peer;
    for entry in entries {
        let Some(hop) = parse_hop(entry.trim()) else {
            return client;
        };
        client = hop;
        if !is_trusted(hop) {
            return hop;
        }
    }
    client
}

/// An `X-Forwarded-For` entry: an address, possibly with a port (`[::1]:80`, `1.2.3.4:5`).
fn parse_hop(entry: &str) -> Option<IpAddr> {
    entry
        .parse()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn x_forwarded_for_is_read_right_to_left_from_trusted_proxies_only() {
        let trusted: Vec<ipnet::IpNet> =
            vec!["10.0.0.0/8".parse().unwrap(), "fd00::/8".parse().unwrap()];
        let xff = |lines: &[&'static str]| {
            let mut h = HeaderMap::new();
            for line in lines {
                h.append("x-forwarded-for", HeaderValue::from_static(line));
            }
            h
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let (proxy, stranger) = (ip("10.1.2.3"), ip("203.0.113.9"));
        // A peer that is no trusted proxy is the client, whatever it says.
        assert_eq!(
            forwarded_client(stranger, &xff(&["198.51.100.1"]), &trusted),
            stranger
        );
        assert_eq!(
            forwarded_client(stranger, &xff(&["198.51.100.1"]), &[]),
            stranger
        );
        // Through the proxy: the entry it appended, not what the client put before it.
        assert_eq!(
            forwarded_client(proxy, &xff(&["1.1.1.1, 198.51.100.7"]), &trusted),
            ip("198.51.100.7")
        );
        // Two trusted hops (a load balancer, then the Ingress), over two header lines.
        assert_eq!(
            forwarded_client(
                proxy,
                &xff(&["6.6.6.6, 198.51.100.7", "10.9.9.9"]),
                &trusted
            ),
            ip("198.51.100.7")
        );
        assert_eq!(
            forwarded_client(
                ip("::ffff:10.0.0.1"),
                &xff(&["[2001:db8::1]:4711"]),
                &trusted
            ),
            ip("2001:db8::1")
        );
        // Nothing, or garbage, past the trusted hops: the last trusted hop.
        assert_eq!(forwarded_client(proxy, &xff(&[]), &trusted), proxy);
        assert_eq!(
            forwarded_client(proxy, &xff(&["198.51.100.7, junk, 10.2.2.2"]), &trusted),
            ip("10.2.2.2")
        );
    }
}
