//! ICMP errors the UDP proxy passes on to a client (issue #20: "ICMP errors reach the
//! client").
//!
//! When the original destination answers a proxied datagram with ICMP port unreachable,
//! the error reaches the proxy's upstream socket (`ECONNREFUSED`), not the client. Without
//! tierproxy the client's own kernel would have received it, and a connected UDP socket
//! reports it as "connection refused" on its next call (udp(7), `IP_RECVERR` off); through
//! the proxy the client only times out. So the proxy sends the client the error the
//! destination would have sent: ICMP destination unreachable, port unreachable (ICMPv4
//! type 3 code 3, RFC 792; ICMPv6 type 1 code 4, RFC 4443 §3.1), from the destination's
//! address, quoting the client's datagram as it left the client (IP header, then the UDP
//! header with the client's ports): what the client's kernel matches the error to its
//! socket by. It leaves from a raw ICMP socket bound to the destination's address with
//! `IP_TRANSPARENT` (needs CAP_NET_RAW and CAP_NET_ADMIN, which the agent has), one per
//! error: refused flows are rare, and a flood of them is bounded below.
//!
//! A pod that makes many flows to closed ports would make the proxy send as many errors:
//! at most [`MAX_PER_SECOND`] per second are sent (the kernel's own default rate for the
//! errors it generates, `net.ipv4.icmp_msgs_per_sec`), the rest counted
//! ([`crate::limits::Limits::icmp_errors`]) and logged at most once per
//! [`crate::limits::LOG_EVERY`].
use std::io;
use std::net::SocketAddr;

use socket2::{Domain, Protocol, Socket, Type};

/// Most ICMP errors sent to clients per second, all flows together.
pub const MAX_PER_SECOND: u64 = 1000;

/// Sends `client` the ICMP port unreachable that `server` would have sent for a datagram of
/// `len` payload bytes from `client` to `server` (the lengths in the quote; a receiver
/// matches the error by addresses and ports). Returns false when the rate limit held it
/// back.
///
/// # Errors
/// The raw socket cannot be created, bound or sent on (no CAP_NET_RAW, no route).
pub fn port_unreachable(client: SocketAddr, server: SocketAddr, len: usize) -> io::Result<bool> {
    if !LIMIT.allow() {
        if let Some(n) = crate::limits::LIMITS.icmp_errors.hit() {
            tracing::warn!(
                hits = n,
                max_per_second = MAX_PER_SECOND,
                "ICMP port unreachable errors to clients over the rate limit; not sent"
            );
        }
        return Ok(false);
    }
    let (socket, message) = match (client, server) {
        (SocketAddr::V4(c), SocketAddr::V4(s)) => {
            let s4 = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))?;
            s4.set_ip_transparent_v4(true)?;
            (s4, icmpv4(c, s, len))
        }
        (SocketAddr::V6(c), SocketAddr::V6(s)) => {
            let s6 = Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?;
            s6.set_ip_transparent_v6(true)?;
            (s6, icmpv6(c, s, len))
        }
        _ => return Err(io::Error::new(io::ErrorKind::InvalidInput, "mixed address families")),
    };
    socket.bind(&SocketAddr::new(server.ip(), 0).into())?;
    // A raw socket's port must be 0 (the ICMPv6 checksum is the kernel's: IPV6_CHECKSUM is
    // on for raw ICMPv6 sockets, RFC 3542 §3.1).
    socket.send_to(&message, &SocketAddr::new(client.ip(), 0).into())?;
    Ok(true)
}

/// The errors sent this second.
static LIMIT: crate::limits::PerSecond = crate::limits::PerSecond::new(MAX_PER_SECOND);

/// The UDP header the client's datagram carried (checksum 0: not verified in a quote).
fn udp_header(client_port: u16, server_port: u16, len: usize) -> [u8; 8] {
    let total = (8 + len).min(usize::from(u16::MAX)) as u16;
    let mut h = [0u8; 8];
    h[0..2].copy_from_slice(&client_port.to_be_bytes());
    h[2..4].copy_from_slice(&server_port.to_be_bytes());
    h[4..6].copy_from_slice(&total.to_be_bytes());
    h
}

/// ICMPv4 destination unreachable / port unreachable quoting the client's datagram (RFC
/// 792: the original IP header and its first 64 bits of data).
fn icmpv4(client: std::net::SocketAddrV4, server: std::net::SocketAddrV4, len: usize) -> Vec<u8> {
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    let total = (20 + 8 + len).min(usize::from(u16::MAX)) as u16;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17; // UDP
    ip[12..16].copy_from_slice(&client.ip().octets());
    ip[16..20].copy_from_slice(&server.ip().octets());
    let sum = checksum(&ip);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    let mut m = vec![3u8, 3, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(&ip);
    m.extend_from_slice(&udp_header(client.port(), server.port(), len));
    let sum = checksum(&m);
    m[2..4].copy_from_slice(&sum.to_be_bytes());
    m
}

/// ICMPv6 destination unreachable / port unreachable quoting the client's datagram (RFC
/// 4443 §3.1; the checksum is left to the kernel).
fn icmpv6(client: std::net::SocketAddrV6, server: std::net::SocketAddrV6, len: usize) -> Vec<u8> {
    let mut ip = [0u8; 40];
    ip[0] = 0x60;
    let payload = (8 + len).min(usize::from(u16::MAX)) as u16;
    ip[4..6].copy_from_slice(&payload.to_be_bytes());
    ip[6] = 17; // UDP
    ip[7] = 64;
    ip[8..24].copy_from_slice(&client.ip().octets());
    ip[24..40].copy_from_slice(&server.ip().octets());
    let mut m = vec![1u8, 4, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(&ip);
    m.extend_from_slice(&udp_header(client.port(), server.port(), len));
    m
}

/// The Internet checksum (RFC 1071) of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_icmpv4_error_quotes_the_clients_datagram_and_checks_out() {
        let m = icmpv4("10.0.0.1:40000".parse().unwrap(), "10.0.0.2:53".parse().unwrap(), 20);
        assert_eq!((m[0], m[1]), (3, 3), "destination unreachable, port unreachable");
        assert_eq!(checksum(&m), 0, "a message with its checksum sums to zero");
        let quoted = &m[8..28];
        assert_eq!(checksum(quoted), 0, "the quoted IP header's checksum");
        assert_eq!(&quoted[12..16], &[10, 0, 0, 1], "from the client");
        assert_eq!(&quoted[16..20], &[10, 0, 0, 2], "to the server");
        assert_eq!(&m[28..32], &[0x9c, 0x40, 0, 53], "the client's and the server's ports");
        assert_eq!(u16::from_be_bytes([m[32], m[33]]), 28, "UDP length: header and payload");
    }

    #[test]
    fn an_icmpv6_error_quotes_the_clients_datagram() {
        let m = icmpv6("[fd00::1]:40000".parse().unwrap(), "[fd00::2]:53".parse().unwrap(), 20);
        assert_eq!((m[0], m[1]), (1, 4));
        assert_eq!(m.len(), 8 + 40 + 8);
        assert_eq!(m[8] >> 4, 6);
        assert_eq!(m[8 + 6], 17);
        assert_eq!(&m[48..52], &[0x9c, 0x40, 0, 53]);
    }
}
