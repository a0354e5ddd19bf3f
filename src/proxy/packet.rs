//! The first packet of a flow, as NFQUEUE delivers it: an IPv4 or IPv6 header and the
//! first bytes of the transport header, parsed just far enough to name the flow.
//!
//! Sources: RFC 791 (IPv4 header), RFC 8200 §4 (IPv6 extension headers), RFC 9293 / RFC 768
//! / RFC 9260 (TCP, UDP and SCTP all start with the 16-bit source and destination ports).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::policy::ports::Protocol;

use crate::policy::FlowKey;

/// Why a queued packet could not be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Shorter than the headers it announces (the NFQUEUE copy range cut it, or it is
    /// malformed).
    #[error("packet truncated")]
    Truncated,
    /// Not IPv4 or IPv6.
    #[error("IP version {0} is neither 4 nor 6")]
    Version(u8),
    /// A transport the policy API does not cover (only TCP, UDP and SCTP are queued).
    #[error("IP protocol {0} is not TCP, UDP or SCTP")]
    Protocol(u8),
    /// A non-initial IPv4 or IPv6 fragment: it has no transport header.
    #[error("non-initial fragment")]
    Fragment,
}

const TCP: u8 = 6;
const UDP: u8 = 17;
const SCTP: u8 = 132;

fn protocol(number: u8) -> Result<Protocol, ParseError> {
    match number {
        TCP => Ok(Protocol::Tcp),
        UDP => Ok(Protocol::Udp),
        SCTP => Ok(Protocol::Sctp),
        other => Err(ParseError::Protocol(other)),
    }
}

fn ports(transport: &[u8]) -> Result<(u16, u16), ParseError> {
    match transport {
        [a, b, c, d, ..] => Ok((u16::from_be_bytes([*a, *b]), u16::from_be_bytes([*c, *d]))),
        _ => Err(ParseError::Truncated),
    }
}

/// A first packet's flow and where its transport header starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headers {
    /// The flow, as the header names it.
    pub key: FlowKey,
    /// Offset of the transport header: the IPv4 header's length (IHL), or 40 plus the
    /// IPv6 extension headers'.
    pub transport: usize,
}

/// Names the flow of a packet that starts with an IPv4 or IPv6 header.
///
/// # Errors
/// [`ParseError`] when the packet is truncated, not IP, not TCP/UDP/SCTP, or a non-initial
/// fragment. The caller drops such packets (fail closed).
pub fn parse(packet: &[u8]) -> Result<FlowKey, ParseError> {
    headers(packet).map(|h| h.key)
}

/// [`parse`], with the offset of the transport header (what a refusal answers from,
/// `super::reject`).
///
/// # Errors
/// As [`parse`].
pub fn headers(packet: &[u8]) -> Result<Headers, ParseError> {
    let first = *packet.first().ok_or(ParseError::Truncated)?;
    match first >> 4 {
        4 => parse_v4(packet),
        6 => parse_v6(packet),
        v => Err(ParseError::Version(v)),
    }
}

fn parse_v4(p: &[u8]) -> Result<Headers, ParseError> {
    let ihl = usize::from(p[0] & 0x0f) * 4;
    if ihl < 20 || p.len() < ihl {
        return Err(ParseError::Truncated);
    }
    // Fragment offset (13 bits after the flags): only the first fragment has ports.
    if u16::from_be_bytes([p[6], p[7]]) & 0x1fff != 0 {
        return Err(ParseError::Fragment);
    }
    let protocol = protocol(p[9])?;
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let (sport, dport) = ports(&p[ihl..])?;
    let key = FlowKey {
        src: SocketAddr::new(IpAddr::V4(src), sport),
        dst: SocketAddr::new(IpAddr::V4(dst), dport),
        protocol,
    };
    Ok(Headers { key, transport: ihl })
}

/// Extension headers RFC 8200 §4 says may precede the upper-layer header and that share
/// the `next header, length in 8-octet units − 1` layout (AH counts 4-octet units − 2).
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const AUTH: u8 = 51;
const DEST_OPTS: u8 = 60;
/// More extension headers than any sane first packet carries: the walk stops here.
const MAX_EXTENSION_HEADERS: usize = 8;

fn parse_v6(p: &[u8]) -> Result<Headers, ParseError> {
    if p.len() < 40 {
        return Err(ParseError::Truncated);
    }
    let octets = |at: usize| -> [u8; 16] { p[at..at + 16].try_into().expect("16 bytes") };
    let src = Ipv6Addr::from(octets(8));
    let dst = Ipv6Addr::from(octets(24));
    let mut next = p[6];
    let mut at = 40;
    for _ in 0..MAX_EXTENSION_HEADERS {
        let len = match next {
            HOP_BY_HOP | ROUTING | DEST_OPTS => {
                (usize::from(*p.get(at + 1).ok_or(ParseError::Truncated)?) + 1) * 8
            }
            AUTH => (usize::from(*p.get(at + 1).ok_or(ParseError::Truncated)?) + 2) * 4,
            FRAGMENT => {
                let frag = p.get(at + 2..at + 4).ok_or(ParseError::Truncated)?;
                if u16::from_be_bytes([frag[0], frag[1]]) & 0xfff8 != 0 {
                    return Err(ParseError::Fragment);
                }
                8
            }
            _ => {
                let protocol = protocol(next)?;
                let (sport, dport) = ports(p.get(at..).ok_or(ParseError::Truncated)?)?;
                let key = FlowKey {
                    src: SocketAddr::new(IpAddr::V6(src), sport),
                    dst: SocketAddr::new(IpAddr::V6(dst), dport),
                    protocol,
                };
                return Ok(Headers { key, transport: at });
            }
        };
        next = *p.get(at).ok_or(ParseError::Truncated)?;
        at += len;
    }
    Err(ParseError::Truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(protocol: u8, frag: u16, transport: &[u8]) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 0, 0, 0, (frag >> 8) as u8, frag as u8, 64, protocol, 0, 0];
        p.extend([10, 244, 1, 4, 10, 244, 2, 3]);
        p.extend(transport);
        p
    }

    #[test]
    fn ipv4_tcp_udp_sctp() {
        for (n, proto) in [(6, Protocol::Tcp), (17, Protocol::Udp), (132, Protocol::Sctp)] {
            let k = parse(&v4(n, 0x4000, &[0xc3, 0x50, 0x00, 0x50, 0, 0])).unwrap();
            assert_eq!(k.protocol, proto);
            assert_eq!(k.src, "10.244.1.4:50000".parse().unwrap());
            assert_eq!(k.dst, "10.244.2.3:80".parse().unwrap());
            assert_eq!(k.flow().dst_port, 80);
        }
    }

    #[test]
    fn ipv4_errors() {
        assert_eq!(parse(&[]), Err(ParseError::Truncated));
        assert_eq!(parse(&v4(6, 0, &[1, 2])), Err(ParseError::Truncated));
        assert_eq!(parse(&v4(1, 0, &[0; 8])), Err(ParseError::Protocol(1)));
        assert_eq!(parse(&v4(6, 0x0001, &[0; 8])), Err(ParseError::Fragment));
        assert_eq!(parse(&[0x75, 0, 0]), Err(ParseError::Version(7)));
        // IHL shorter than the minimum header.
        let mut p = v4(6, 0, &[0; 8]);
        p[0] = 0x44;
        assert_eq!(parse(&p), Err(ParseError::Truncated));
    }

    fn v6(next: u8, ext: &[u8]) -> Vec<u8> {
        let mut p = vec![0x60, 0, 0, 0, 0, 0, next, 64];
        p.extend("fd00::1".parse::<Ipv6Addr>().unwrap().octets());
        p.extend("fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        p.extend(ext);
        p
    }

    proptest::proptest! {
        /// Whatever the queue hands over, parsing answers (a flow or an error) and never
        /// panics: a packet is never dropped by a crash of its reader.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(0u8.., 0..120)) {
            let _ = parse(&bytes);
            let mut v4 = bytes.clone();
            if let Some(b) = v4.first_mut() { *b = 0x40 | (*b & 0x0f); }
            let _ = parse(&v4);
            let mut v6 = bytes;
            if let Some(b) = v6.first_mut() { *b = 0x60; }
            let _ = parse(&v6);
        }
    }

    #[test]
    fn ipv6_with_extension_headers() {
        let k = parse(&v6(6, &[0x30, 0x39, 0x01, 0xbb])).unwrap();
        assert_eq!(k.dst, "[fd00::2]:443".parse().unwrap());
        // Hop-by-hop (8 bytes) then destination options (16 bytes) then UDP.
        let mut ext = vec![60, 0, 0, 0, 0, 0, 0, 0];
        ext.extend([17, 1]);
        ext.extend([0; 14]);
        ext.extend([0x00, 0x35, 0x00, 0x35]);
        let k = parse(&v6(0, &ext)).unwrap();
        assert_eq!((k.protocol, k.dst.port()), (Protocol::Udp, 53));
        // First fragment carries ports; later ones do not.
        let first = parse(&v6(44, &[6, 0, 0x00, 0x01, 0, 0, 0, 1, 0, 80, 0, 81])).unwrap();
        assert_eq!(first.dst.port(), 81);
        assert_eq!(parse(&v6(44, &[6, 0, 0x00, 0x08, 0, 0, 0, 1])), Err(ParseError::Fragment));
        assert_eq!(parse(&v6(0, &[6])), Err(ParseError::Truncated));
        assert_eq!(parse(&v6(58, &[0; 8])), Err(ParseError::Protocol(58)));
    }
}
