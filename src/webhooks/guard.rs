//! Where a webhook may go: not to loopback, private, link-local, shared or reserved
//! addresses (the services beside the worker, a cloud's metadata endpoint) unless allowed.
//! Names are checked on the addresses they resolve to, and the connection goes to an
//! address that passed ([`CheckedResolver`]); addresses written in the URL are checked by
//! the caller with [`is_public`].

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::client::legacy::connect::dns::Name;

pub(super) fn refused(ip: IpAddr) -> String {
    format!(
        "refused: {ip} is a loopback, private or link-local address \
         (WebhookBuilder::allow_private_targets allows them)"
    )
}

/// Whether `ip` is on the public internet: not loopback, private, link-local, unspecified,
/// multicast, broadcast, shared (100.64/10), documentation, or IPv4 mapped into IPv6.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_multicast()
                || v4.is_broadcast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
                || a >= 240) // reserved
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let seg = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                std::net::Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)
            };
            // IPv4 inside IPv6: NAT64 (64:ff9b::/96), IPv4-compatible (::a.b.c.d, ::1 and
            // :: included: 0.0.0.0/8 is never public), 6to4 (2002::/16): the IPv4 address
            // decides.
            if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || seg[..6] == [0; 6] {
                return is_public(IpAddr::V4(embedded(seg[6], seg[7])));
            }
            if seg[0] == 0x2002 {
                return is_public(IpAddr::V4(embedded(seg[1], seg[2])));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (seg[0] & 0xfe00) == 0xfc00 // unique local
                || (seg[0] & 0xffc0) == 0xfe80 // link-local
                || (seg[0] & 0xffc0) == 0xfec0 // site-local (deprecated)
                || (seg[0] == 0x2001 && seg[1] == 0) // Teredo
                || (seg[0] == 0x2001 && seg[1] == 0x0db8) // documentation
                || (seg[0] == 0x3fff && seg[1] < 0x1000) // documentation (3fff::/20)
                || (seg[..3] == [0x64, 0xff9b, 1]) // local-use translation (64:ff9b:1::/48)
                || (seg[..4] == [0x100, 0, 0, 0]) // discard-only (100::/64)
                || (seg[..3] == [0x2001, 2, 0]) // benchmarking (2001:2::/48)
                || (seg[0] == 0x2001 && (0x10..0x30).contains(&seg[1]))) // ORCHID (v2)
        }
    }
}

/// Resolves a host and keeps only the addresses a notification may go to: the connection
/// is made to an address checked here, so a name cannot resolve to a public address for
/// the check and a private one for the connection.
#[derive(Clone, Copy, Debug)]
pub(super) struct CheckedResolver {
    pub(super) allow_private: bool,
}

impl tower_service::Service<Name> for CheckedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let all: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = all
                .iter()
                .copied()
                .filter(|a| allow_private || is_public(a.ip()))
                .collect();
            match (allowed.is_empty(), all.first()) {
                (false, _) => Ok(allowed.into_iter()),
                (true, Some(first)) => Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!(
                        "{} resolves to {}: {}",
                        name.as_str(),
                        first.ip(),
                        refused(first.ip())
                    ),
                )),
                (true, None) => Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} resolves to no address", name.as_str()),
                )),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_and_not() {
        for private in [
            "240.0.0.1",
            "192.0.0.8",
            "fec0::1",
            "64:ff9b::a9fe:a9fe",
            "::10.0.0.1",
            "2002:7f00:1::",
            "2001:0:4136:e378::1",
            "64:ff9b:1::a00:1",
            "64:ff9b:1:ffff::1",
            "::0.0.1.2",
            "::",
            "100::1",
            "2001:2::1",
            "2001:10::1",
            "2001:20::1",
            "3fff::1",
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "0.0.0.0",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!is_public(private.parse().unwrap()), "{private}");
        }
        for public in [
            "1.1.1.1",
            "93.184.216.34",
            "2606:4700::1111",
            "64:ff9b::101:101",
            "2002:101:101::",
        ] {
            assert!(is_public(public.parse().unwrap()), "{public}");
        }
    }
}
