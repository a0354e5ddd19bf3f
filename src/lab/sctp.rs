//! SCTP for the lab on kernels without SCTP sockets: the few packets of an association's
//! start (RFC 9260), built and parsed here and sent on raw IP sockets (protocol 132).
//!
//! These machines' kernel has no SCTP (CONFIG_IP_SCTP unset), but conntrack knows SCTP and
//! raw sockets work. The lab's SCTP exchange is the first half of the four-way handshake:
//!
//! ```text
//! client (raw socket)                              server (raw socket, `lab serve --sctp`)
//!   INIT  vtag 0, initiate tag T, ports c → s  ─►
//!                                              ◄─  INIT ACK  vtag T, ports s → c,
//!                                                  State Cookie "tierproxy-lab <ip> <port>\n"
//!                                              ◄─  or ABORT  vtag T (nothing serves port s)
//! ```
//!
//! The INIT ACK carries the lab's greeting (`super::serve::greeting`) as its State Cookie,
//! so the client learns which address the server saw, as with TCP and UDP. No association
//! is completed (no COOKIE ECHO): the INIT is what a node's agent decides on, and the INIT
//! ACK is what proves the INIT arrived and the reply came back.
//!
//! Every packet is valid SCTP, because conntrack checks it on the way: it verifies the
//! CRC32c checksum in PREROUTING (`nf_conntrack_checksum`, a bad one makes the packet
//! INVALID), wants verification tag 0 and a nonzero initiate tag in an INIT, and takes an
//! INIT ACK or ABORT as the reply direction only when its verification tag is the INIT's
//! initiate tag. The kernel computes no SCTP checksum for raw sockets in either family:
//! [`Packet::to_bytes`] does.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;

use crc::{CRC_32_ISCSI, Crc};
use nix::sys::socket::SockaddrStorage;
use socket2::{Domain, Socket, Type};

/// IP protocol number of SCTP (IANA; RFC 9260 §1.3).
pub const IPPROTO_SCTP: i32 = 132;
/// Bytes of the common header: source port, destination port, verification tag, checksum
/// (RFC 9260 §3.1).
pub const COMMON_HEADER_LEN: usize = 12;
/// Chunk type INIT (RFC 9260 §3.3.2).
const CHUNK_INIT: u8 = 1;
/// Chunk type INIT ACK (RFC 9260 §3.3.3).
const CHUNK_INIT_ACK: u8 = 2;
/// Chunk type ABORT (RFC 9260 §3.3.7).
const CHUNK_ABORT: u8 = 6;
/// ABORT flag T: 0 when "the sender filled in the Verification Tag expected by the peer",
/// 1 when it reflected the tag it received (RFC 9260 §3.3.7).
const FLAG_T: u8 = 1;
/// Parameter type State Cookie, mandatory in an INIT ACK (RFC 9260 §3.3.3.1).
const PARAM_STATE_COOKIE: u16 = 7;
/// Bytes of an INIT or INIT ACK chunk before its parameters: chunk header (4), initiate
/// tag, a_rwnd, outbound and inbound streams, initial TSN.
const INIT_FIXED_LEN: usize = 20;
/// Advertised receiver window (a_rwnd), in bytes: RFC 9260 §6.2.1 recommends at least
/// 1500; nothing is ever sent on the lab's associations.
const A_RWND: u32 = 65_535;
/// Longest State Cookie accepted or built, in bytes: the greeting is under 64.
pub const MAX_COOKIE: usize = 512;
/// Lowest source port of a probe: the IANA dynamic range 49152–65535 (RFC 6335 §6).
const DYNAMIC_PORTS: u16 = 49_152;

/// CRC32c (Castagnoli, the iSCSI polynomial), the SCTP checksum (RFC 9260 Appendix A).
static CRC32C: Crc<u32> = Crc::<u32>::new(&CRC_32_ISCSI);

/// Why bytes are not an SCTP packet the lab understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Shorter than the common header plus one chunk header, or than a chunk's length.
    #[error("truncated SCTP packet ({len} bytes)")]
    Truncated {
        /// Bytes available.
        len: usize,
    },
    /// The CRC32c does not match the packet.
    #[error("SCTP checksum {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// The checksum field, read little-endian (as it is stored).
        stored: u32,
        /// What the packet's bytes give.
        computed: u32,
    },
    /// A chunk or parameter length field below its header size.
    #[error("SCTP chunk or parameter length {len} is invalid")]
    Length {
        /// The length field.
        len: usize,
    },
}

/// The fixed fields of an INIT or INIT ACK chunk (RFC 9260 §3.3.2, §3.3.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitFields {
    /// The tag the peer must put in every packet it sends back; nonzero.
    pub initiate_tag: u32,
    /// Advertised receiver window credit, bytes.
    pub a_rwnd: u32,
    /// Outbound streams wanted; nonzero.
    pub outbound_streams: u16,
    /// Most inbound streams allowed; nonzero.
    pub inbound_streams: u16,
    /// First transmission sequence number the sender will use.
    pub initial_tsn: u32,
}

impl InitFields {
    /// Fields for a new association: one stream each way, a TSN equal to the tag (RFC
    /// 9260 §5.1.1 allows that).
    pub fn new(initiate_tag: u32) -> Self {
        InitFields {
            initiate_tag,
            a_rwnd: A_RWND,
            outbound_streams: 1,
            inbound_streams: 1,
            initial_tsn: initiate_tag,
        }
    }
}

/// The first chunk of a packet: the kinds the lab sends, and any other by its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Chunk {
    /// INIT, no parameters.
    Init(InitFields),
    /// INIT ACK with its State Cookie (other parameters are skipped when parsing).
    InitAck {
        /// The fixed fields.
        fields: InitFields,
        /// The State Cookie's value (empty if the chunk has none).
        cookie: Vec<u8>,
    },
    /// ABORT without error causes.
    Abort {
        /// The T flag: the verification tag is the receiver's own, reflected.
        reflected: bool,
    },
    /// Any other chunk type (not built, only recognised).
    Other {
        /// The chunk type.
        kind: u8,
    },
}

/// An SCTP packet with one chunk (the lab never bundles).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Verification tag: 0 in an INIT, else the receiver's initiate tag.
    pub verification_tag: u32,
    /// The (first) chunk.
    pub chunk: Chunk,
}

/// The CRC32c of an SCTP packet, computed with its checksum field taken as zero (RFC 9260
/// §6.8). It is stored little-endian (RFC 9260 Appendix A's byte order, Linux's
/// `sctp_compute_cksum`).
///
/// # Panics
/// Never for `packet` of at least [`COMMON_HEADER_LEN`] bytes; shorter input is hashed
/// as if padded with zeros.
pub fn checksum(packet: &[u8]) -> u32 {
    let mut digest = CRC32C.digest();
    digest.update(packet.get(..8).unwrap_or(packet));
    digest.update(&[0; 4]);
    digest.update(packet.get(COMMON_HEADER_LEN..).unwrap_or_default());
    digest.finalize()
}

fn put_init_fields(out: &mut Vec<u8>, f: &InitFields) {
    out.extend_from_slice(&f.initiate_tag.to_be_bytes());
    out.extend_from_slice(&f.a_rwnd.to_be_bytes());
    out.extend_from_slice(&f.outbound_streams.to_be_bytes());
    out.extend_from_slice(&f.inbound_streams.to_be_bytes());
    out.extend_from_slice(&f.initial_tsn.to_be_bytes());
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Rounds `n` up to a multiple of 4 (chunks and parameters are padded to 4 bytes).
fn padded(n: usize) -> usize {
    n.div_ceil(4) * 4
}

impl Packet {
    /// An INIT from `src_port` to `dst_port` with `initiate_tag` (nonzero; verification tag
    /// 0, as RFC 9260 §8.5.1 requires).
    pub fn init(src_port: u16, dst_port: u16, initiate_tag: u32) -> Packet {
        Packet {
            src_port,
            dst_port,
            verification_tag: 0,
            chunk: Chunk::Init(InitFields::new(initiate_tag)),
        }
    }

    /// The fixed fields of an INIT chunk; `None` for any other chunk.
    pub fn init_fields(&self) -> Option<&InitFields> {
        match &self.chunk {
            Chunk::Init(f) => Some(f),
            _ => None,
        }
    }

    /// The INIT ACK answering this packet if it is an INIT (its ports swapped, its
    /// initiate tag as the verification tag), with `own_tag` (nonzero) as this side's
    /// initiate tag and `cookie` (cut to [`MAX_COOKIE`] bytes) as the State Cookie.
    pub fn init_ack(&self, own_tag: u32, cookie: &[u8]) -> Option<Packet> {
        let init = self.init_fields()?;
        let mut fields = InitFields::new(own_tag);
        // RFC 9260 §5.1.1: no more outbound streams than the peer's inbound maximum.
        fields.outbound_streams = fields.outbound_streams.min(init.inbound_streams);
        Some(Packet {
            src_port: self.dst_port,
            dst_port: self.src_port,
            verification_tag: init.initiate_tag,
            chunk: Chunk::InitAck {
                fields,
                cookie: cookie[..cookie.len().min(MAX_COOKIE)].to_vec(),
            },
        })
    }

    /// The ABORT answering this packet if it is an INIT (nothing serves its port): the
    /// INIT's initiate tag as verification tag and T unset (RFC 9260 §8.4 (3) and §5.1;
    /// Linux answers so too).
    pub fn abort(&self) -> Option<Packet> {
        let init = self.init_fields()?;
        Some(Packet {
            src_port: self.dst_port,
            dst_port: self.src_port,
            verification_tag: init.initiate_tag,
            chunk: Chunk::Abort { reflected: false },
        })
    }

    /// The packet on the wire: common header with its CRC32c, the chunk, padding to 4
    /// bytes.
    ///
    /// # Panics
    /// [`Chunk::Other`] cannot be built.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(&self.src_port.to_be_bytes());
        out.extend_from_slice(&self.dst_port.to_be_bytes());
        out.extend_from_slice(&self.verification_tag.to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        let start = out.len();
        match &self.chunk {
            Chunk::Init(f) => {
                out.extend_from_slice(&[CHUNK_INIT, 0]);
                out.extend_from_slice(&(INIT_FIXED_LEN as u16).to_be_bytes());
                put_init_fields(&mut out, f);
            }
            Chunk::InitAck { fields, cookie } => {
                let cookie = &cookie[..cookie.len().min(MAX_COOKIE)];
                let param_len = 4 + cookie.len();
                // The chunk length counts the last parameter without its padding.
                let chunk_len = INIT_FIXED_LEN + param_len;
                out.extend_from_slice(&[CHUNK_INIT_ACK, 0]);
                out.extend_from_slice(&(chunk_len as u16).to_be_bytes());
                put_init_fields(&mut out, fields);
                out.extend_from_slice(&PARAM_STATE_COOKIE.to_be_bytes());
                out.extend_from_slice(&(param_len as u16).to_be_bytes());
                out.extend_from_slice(cookie);
            }
            Chunk::Abort { reflected } => {
                out.extend_from_slice(&[CHUNK_ABORT, if *reflected { FLAG_T } else { 0 }]);
                out.extend_from_slice(&4u16.to_be_bytes());
            }
            Chunk::Other { kind } => panic!("chunk type {kind} is not built by the lab"),
        }
        out.resize(start + padded(out.len() - start), 0);
        let sum = checksum(&out);
        out[8..12].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Parses an SCTP packet (common header onwards) and its first chunk, after checking
    /// its CRC32c.
    ///
    /// # Errors
    /// [`ParseError`]: too short, a bad checksum, an impossible length field.
    pub fn parse(bytes: &[u8]) -> Result<Packet, ParseError> {
        if bytes.len() < COMMON_HEADER_LEN + 4 {
            return Err(ParseError::Truncated { len: bytes.len() });
        }
        let stored = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let computed = checksum(bytes);
        if stored != computed {
            return Err(ParseError::Checksum { stored, computed });
        }
        let c = &bytes[COMMON_HEADER_LEN..];
        let (kind, flags, len) = (c[0], c[1], usize::from(be16(c, 2)));
        if len < 4 {
            return Err(ParseError::Length { len });
        }
        if len > c.len() {
            return Err(ParseError::Truncated { len: bytes.len() });
        }
        let c = &c[..len];
        let fields = || -> Result<InitFields, ParseError> {
            if c.len() < INIT_FIXED_LEN {
                return Err(ParseError::Truncated { len: bytes.len() });
            }
            Ok(InitFields {
                initiate_tag: be32(c, 4),
                a_rwnd: be32(c, 8),
                outbound_streams: be16(c, 12),
                inbound_streams: be16(c, 14),
                initial_tsn: be32(c, 16),
            })
        };
        let chunk = match kind {
            CHUNK_INIT => Chunk::Init(fields()?),
            CHUNK_INIT_ACK => {
                let fields = fields()?;
                let mut cookie = Vec::new();
                let mut at = INIT_FIXED_LEN;
                while at + 4 <= c.len() {
                    let (ptype, plen) = (be16(c, at), usize::from(be16(c, at + 2)));
                    if plen < 4 {
                        return Err(ParseError::Length { len: plen });
                    }
                    let end = (at + plen).min(c.len());
                    if ptype == PARAM_STATE_COOKIE {
                        cookie = c[at + 4..end].iter().copied().take(MAX_COOKIE).collect();
                        break;
                    }
                    at += padded(plen);
                }
                Chunk::InitAck { fields, cookie }
            }
            CHUNK_ABORT => Chunk::Abort { reflected: flags & FLAG_T != 0 },
            other => Chunk::Other { kind: other },
        };
        Ok(Packet {
            src_port: be16(bytes, 0),
            dst_port: be16(bytes, 2),
            verification_tag: be32(bytes, 4),
            chunk,
        })
    }
}

/// The addresses and payload of an IPv4 packet as a raw IPv4 socket returns it (IP header
/// included; IPv6 raw sockets return the payload alone). `None` unless it is a
/// well-formed, unfragmented IPv4 packet of protocol 132.
pub fn ipv4_payload(datagram: &[u8]) -> Option<(Ipv4Addr, Ipv4Addr, &[u8])> {
    let first = *datagram.first()?;
    let ihl = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || ihl < 20 || datagram.len() < ihl {
        return None;
    }
    let total = usize::from(be16(datagram, 2)).min(datagram.len());
    // Offset or more-fragments set: a fragment, which the lab never sends.
    let fragment = be16(datagram, 6) & 0x3fff != 0;
    if i32::from(datagram[9]) != IPPROTO_SCTP || fragment || total < ihl {
        return None;
    }
    let src = Ipv4Addr::new(datagram[12], datagram[13], datagram[14], datagram[15]);
    let dst = Ipv4Addr::new(datagram[16], datagram[17], datagram[18], datagram[19]);
    Some((src, dst, &datagram[ihl..total]))
}

/// Whether this kernel can open SCTP sockets (these machines' cannot: CONFIG_IP_SCTP unset,
/// `socket(2)` fails with EPROTONOSUPPORT; a kernel with SCTP as a module loads it here).
pub fn kernel_has_sctp() -> bool {
    Socket::new(Domain::IPV4, Type::STREAM, Some(socket2::Protocol::from(IPPROTO_SCTP))).is_ok()
}

/// A raw IP socket for SCTP in `ip`'s family, bound to `ip` (so it receives only packets
/// addressed to `ip`, and sends from it). Needs CAP_NET_RAW.
///
/// # Errors
/// The `socket(2)` or `bind(2)` error.
pub fn raw_socket(ip: IpAddr) -> std::io::Result<Socket> {
    let domain = if ip.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
    let socket = Socket::new(domain, Type::RAW, Some(socket2::Protocol::from(IPPROTO_SCTP)))?;
    socket.bind(&SocketAddr::new(ip, 0).into())?;
    Ok(socket)
}

/// Receives one datagram on raw SCTP socket `socket` and parses it: the sender's address
/// and the packet, or `Ok(None)` for anything that is not a valid SCTP packet (so one
/// stray packet does not end a wait). Blocks up to the socket's read timeout.
///
/// # Errors
/// The `recvfrom(2)` error (a timeout is `WouldBlock`; a pending ICMP error on a connected
/// socket shows here too).
pub fn recv(socket: &Socket, buf: &mut [u8]) -> std::io::Result<Option<(IpAddr, Packet)>> {
    let (n, from) = loop {
        match nix::sys::socket::recvfrom::<SockaddrStorage>(socket.as_raw_fd(), buf) {
            Ok(r) => break r,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let data = &buf[..n];
    let (from, sctp) = if let Some(v4) = from.as_ref().and_then(|a| a.as_sockaddr_in()) {
        match ipv4_payload(data) {
            Some((_, _, payload)) => (IpAddr::V4(v4.ip()), payload),
            None => return Ok(None),
        }
    } else if let Some(v6) = from.as_ref().and_then(|a| a.as_sockaddr_in6()) {
        (IpAddr::V6(v6.ip()), data)
    } else {
        return Ok(None);
    };
    Ok(Packet::parse(sctp).ok().map(|p| (from, p)))
}

/// A random nonzero tag (initiate tags must not be 0: RFC 9260 §3.3.2).
///
/// # Errors
/// The system's random source failed.
pub fn random_tag() -> std::io::Result<u32> {
    loop {
        let t = getrandom::u32().map_err(|e| std::io::Error::other(e.to_string()))?;
        if t != 0 {
            return Ok(t);
        }
    }
}

/// A random source port from the dynamic range (49152–65535).
///
/// # Errors
/// The system's random source failed.
pub fn random_port() -> std::io::Result<u16> {
    let r = getrandom::u32().map_err(|e| std::io::Error::other(e.to_string()))?;
    let span = u32::from(u16::MAX - DYNAMIC_PORTS) + 1;
    Ok(DYNAMIC_PORTS + (r % span) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn crc32c_matches_the_iscsi_check_values() {
        // The catalogue's check value, and RFC 3720 §B.4: 32 bytes of zeros.
        assert_eq!(CRC32C.checksum(b"123456789"), 0xe306_9283);
        assert_eq!(CRC32C.checksum(&[0; 32]), 0x8a91_36aa);
    }

    #[test]
    fn the_checksum_of_an_independently_built_init_matches() {
        // Scapy's regression test "SCTP - Chunk Init - build": the SCTP part of
        // raw(IP()/SCTP()/SCTPChunkInit(params=[SCTPChunkParamIPv4Addr()])), an INIT with
        // every fixed field 0 and one IPv4 Address parameter (127.0.0.1); its checksum
        // bytes on the wire are 40 2c 0b 5f.
        let wire = hex("0000 0000 00000000 402c0b5f 0100001c 00000000 00000000 0000 0000
             00000000 00050008 7f000001");
        assert_eq!(checksum(&wire).to_le_bytes(), [0x40, 0x2c, 0x0b, 0x5f]);
        let p = Packet::parse(&wire).unwrap();
        assert_eq!(
            p.chunk,
            Chunk::Init(InitFields {
                initiate_tag: 0,
                a_rwnd: 0,
                outbound_streams: 0,
                inbound_streams: 0,
                initial_tsn: 0
            })
        );
        let mut bad = wire.clone();
        bad[31] ^= 1;
        assert!(matches!(Packet::parse(&bad), Err(ParseError::Checksum { .. })));
    }

    #[test]
    fn an_init_is_laid_out_as_rfc_9260_says() {
        let bytes = Packet::init(50_000, 38_412, 0x0102_0304).to_bytes();
        let mut expected = hex("c350 960c 00000000 00000000 01000014 01020304 0000ffff 0001 0001
             01020304");
        let sum = checksum(&expected);
        expected[8..12].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(bytes, expected);
        assert_eq!(bytes.len(), 32);
    }

    #[test]
    fn init_ack_and_abort_answer_an_init_and_round_trip() {
        let init = Packet::init(50_000, 38_412, 0xdead_beef);
        let cookie = b"tierproxy-lab 10.0.0.1 50000\n";
        let ack = init.init_ack(0x1111_2222, cookie).unwrap();
        let bytes = ack.to_bytes();
        assert_eq!(bytes.len() % 4, 0, "padded to 4 bytes");
        // Chunk length: 20 fixed + 4 parameter header + 29 cookie bytes, padding excluded.
        assert_eq!(be16(&bytes, 14), 53);
        let back = Packet::parse(&bytes).unwrap();
        assert_eq!(back, ack);
        assert_eq!(
            (back.src_port, back.dst_port, back.verification_tag),
            (38_412, 50_000, 0xdead_beef)
        );
        let Chunk::InitAck { fields, cookie: got } = back.chunk else { panic!("{back:?}") };
        assert_eq!((fields.initiate_tag, got.as_slice()), (0x1111_2222, &cookie[..]));
        let abort = init.abort().unwrap();
        assert_eq!((ack.init_ack(1, b""), ack.abort()), (None, None), "only an INIT is answered");
        let bytes = abort.to_bytes();
        assert_eq!(&bytes[12..], &[6, 0, 0, 4]);
        assert_eq!(Packet::parse(&bytes).unwrap(), abort);
        assert_eq!(abort.verification_tag, 0xdead_beef);
    }

    #[test]
    fn malformed_packets_are_refused() {
        assert_eq!(Packet::parse(&[0; 15]), Err(ParseError::Truncated { len: 15 }));
        // A chunk length of 2.
        let mut p = Packet::init(1, 2, 3).to_bytes();
        p[14..16].copy_from_slice(&2u16.to_be_bytes());
        let sum = checksum(&p);
        p[8..12].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(Packet::parse(&p), Err(ParseError::Length { len: 2 }));
        // An INIT ACK cut in its fixed fields.
        let mut p = Packet::init(1, 2, 3).to_bytes();
        p[12] = CHUNK_INIT_ACK;
        p[14..16].copy_from_slice(&8u16.to_be_bytes());
        let sum = checksum(&p);
        p[8..12].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(Packet::parse(&p), Err(ParseError::Truncated { .. })));
    }

    #[test]
    fn ipv4_payload_strips_the_header_and_skips_others() {
        let sctp = Packet::init(1, 2, 3).to_bytes();
        let mut ip = hex("45000034 00004000 40840000 0a000001 0a000002");
        ip[2..4].copy_from_slice(&((20 + sctp.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&sctp);
        let (src, dst, payload) = ipv4_payload(&ip).unwrap();
        assert_eq!(
            (src, dst, payload),
            (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2), &sctp[..])
        );
        let mut udp = ip.clone();
        udp[9] = 17;
        assert_eq!(ipv4_payload(&udp), None);
        let mut fragment = ip.clone();
        fragment[6] = 0x20; // more fragments
        assert_eq!(ipv4_payload(&fragment), None);
        assert_eq!(ipv4_payload(&ip[..10]), None);
    }

    #[test]
    fn random_tags_are_nonzero_and_ports_dynamic() {
        for _ in 0..1000 {
            assert_ne!(random_tag().unwrap(), 0);
            assert!(random_port().unwrap() >= DYNAMIC_PORTS);
        }
    }
}
