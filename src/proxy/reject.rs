//! Refusing a rejected flow at once (issue #22, "Reject, a third verdict"): the answer a
//! closed port or a filtering router would give its first packet, built from that packet
//! and sent to the client on a raw socket. The packet itself is dropped, as for a deny.
//!
//! | protocol | answer | errno at a Linux client | source |
//! |---|---|---|---|
//! | TCP | RST (ACK set: `SEQ=0, ACK=SEG.SEQ+SEG.LEN`, or `SEQ=SEG.ACK` for a segment with ACK) | `ECONNREFUSED` from `connect` | Antrea `reject.go` (RST+ACK, ack = seq + 1), RFC 9293 §3.10.7.1 (a segment to a closed port) |
//! | UDP | ICMP destination unreachable, code 10 "host administratively prohibited" (RFC 1122 §3.2.2.1); ICMPv6 type 1 code 1 "administratively prohibited" (RFC 4443 §3.1) | IPv4 `EHOSTUNREACH`, IPv6 `EACCES` on a connected socket (Linux `icmp_err_convert`, `icmpv6_err_convert`: both hard errors) | Antrea `reject.go` (`ICMPDstHostAdminProhibitedCode`, `ICMPv6DstAdminProhibitedCode`) |
//! | SCTP | ABORT, T bit clear, verification tag = the INIT's initiate tag (another first chunk: its own tag reflected, T set) | `ECONNREFUSED` | issue #22 ("an SCTP INIT an ABORT"); RFC 9260 §8.4 (3) and (8) |
//!
//! **SCTP differs from Antrea** (which sends the ICMP error for SCTP too,
//! `shared/reference/antrea-model.md` §5): an SCTP stack takes that ICMP as a soft error
//! and keeps resending its INIT (Linux `sctp_v4_err` records it in `sk_err_soft` unless
//! the socket set `IP_RECVERR`), so its client would wait out `max_init_retransmits` as for
//! a silent drop. An ABORT is what a closed port answers, and it ends the association at
//! once; issue #22 asks for it.
//!
//! **Addresses.** The answer comes from the address and port the client sent to: the
//! original destination before any DNAT (a ClusterIP, a NodePort), which the queue reports
//! with each packet (`NFQA_CT`, [`super::nfqueue`]); the queued header is after the DNAT
//! (the decision is made on the backend pod, DESIGN §3) and a client ignores an RST from
//! an address it never connected to. An ICMP error quotes the datagram as the client sent
//! it (IP header, then the first 8 bytes of its transport header: RFC 792, as Antrea
//! does), with the original addresses and ports.
//!
//! **Why the agent sends it, not the kernel's REJECT, where it can.** The kernel's reject
//! (xt REJECT, nft `reject`) runs only in filter-type chains, so a queue verdict would have
//! to accept the packet with a "reject" mark for a later rule to refuse it; any rule before
//! that one that accepts it (another program's filter chain, a ruleset not installed yet)
//! would let a rejected flow through. Dropped in the queue, a rejected packet never goes
//! on, whatever else is installed; and nothing in the kernel sends an SCTP ABORT for a
//! packet. Also, the kernel's ICMP errors about TPROXY'd packets would come from a
//! non-local address, which its own route lookup refuses.
//!
//! **Where the kernel answers** ([`Refuser::refuse_queued`], [`KernelRefusal`]). A kernel
//! without CONFIG_NETFILTER_NETLINK_GLUE_CT passes no `NFQA_CT`, and the entry of a queued
//! first packet is not confirmed yet, so ctnetlink cannot find it either: the agent cannot
//! know the ClusterIP or NodePort a DNAT'd client used. For such packets the reader hands
//! TCP, and UDP the ruleset did not TPROXY, to the kernel's reject: it accepts the packet
//! with the reject mark, and the ruleset's refusal chains, right after the decision
//! (`redirect` rule 8), refuse it with the same answers as the table above. The kernel
//! attaches the packet's conntrack entry to its answer, and NAT un-does the DNAT on it
//! (`nf_send_reset`, `icmp_send`). A TPROXY'd datagram (`--udp-path proxy`) cannot be
//! refused so (the kernel's ICMP source must be local): the reader lets it on to the
//! proxy, which takes the reader's decision and refuses it; delivered, the flow's entry is
//! confirmed, so conntrack relates the refusal to it and NAT un-does the DNAT (the ruleset
//! keeps the agent's ICMP out of the upstream legs' zone, `redirect` rule 0). SCTP to a
//! ClusterIP stays refused from the backend's address, which its client ignores (nothing in
//! the kernel sends an ABORT for a packet). The risk named above is held small:
//! no other program's chain sits between the decision (-150) and the refusal chains
//! (-149), and packets are handed over only once those chains are installed.
//!
//! **Limits** (a refusal must not become a reflection or amplification tool):
//! - at most one answer per queued packet, to the packet's own source; a pod cannot forge
//!   that source (chain S of the ruleset drops it), so a pod's refusals go to itself;
//! - an answer is small: 36 (an SCTP ABORT over IPv4) to 96 bytes (ICMPv6 quoting a
//!   header without extension headers; more only by the IP options or extension headers it
//!   quotes), never more than the packet it answers plus 48 bytes;
//! - at most [`MAX_PER_SECOND`] per second, all flows together (the kernel's own default
//!   for the ICMP errors it sends, `net.ipv4.icmp_msgs_per_sec`); beyond it the packet is
//!   only dropped, the client times out as for a deny, and the hit is counted
//!   ([`crate::limits::Limits::rejects`]) and logged at most once per 10 s. The kernel's
//!   per-destination ICMP rate limit (`icmp_ratelimit`) does not apply to raw sockets; it
//!   does apply, on top, to the ICMP errors the kernel's reject sends.
//!
//! The answer leaves on a raw socket (`IPPROTO_RAW`: the header is ours, CAP_NET_RAW)
//! carrying the bypass mark (`SO_MARK`), so that the ruleset leaves it alone if it comes
//! back in over `lo` (a client on the node itself).

use std::io;
use std::net::{IpAddr, SocketAddr};

use crc::{CRC_32_ISCSI, Crc};
use socket2::{Domain, Protocol, Socket, Type};

use super::conntrack::Tuple;
use super::packet::{self, ParseError};
use crate::policy::Protocol as FlowProtocol;

/// Most refusals sent per second, all flows together: the kernel's default
/// `net.ipv4.icmp_msgs_per_sec`.
pub const MAX_PER_SECOND: u64 = 1000;

/// IPv4 and IPv6 hop limit of an answer (Linux's default `ip_default_ttl`).
const HOP_LIMIT: u8 = 64;
const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMPV6: u8 = 58;
const SCTP: u8 = 132;
/// ICMP destination unreachable (RFC 792), ICMPv6 destination unreachable (RFC 4443 §3.1).
const ICMP_UNREACHABLE: u8 = 3;
const ICMPV6_UNREACHABLE: u8 = 1;
/// "Communication with destination host is administratively prohibited" (RFC 1122
/// §3.2.2.1), Antrea's code.
const ICMP_HOST_PROHIBITED: u8 = 10;
/// "Communication with destination administratively prohibited" (RFC 4443 §3.1).
const ICMPV6_PROHIBITED: u8 = 1;
/// Bytes of the transport header an ICMP error quotes after the IP header (RFC 792).
const QUOTED_TRANSPORT: usize = 8;
/// TCP flags.
const FIN: u8 = 0x01;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;
/// SCTP chunk types (RFC 9260 §3.2) a refusal must not answer (§8.4 (2), (5)-(7)): an
/// ABORT, a SHUTDOWN COMPLETE, a COOKIE ERROR; and the INIT it answers specially (§8.4 (3)).
const CHUNK_INIT: u8 = 1;
const CHUNK_ABORT: u8 = 6;
const CHUNK_SHUTDOWN_ACK: u8 = 8;
const CHUNK_COOKIE_ERROR: u8 = 10;
const CHUNK_SHUTDOWN_COMPLETE: u8 = 14;
/// ABORT's T flag: the verification tag is the receiver's own, reflected (RFC 9260 §3.3.7).
const FLAG_T: u8 = 1;

/// CRC32c (Castagnoli), the SCTP checksum (RFC 9260 Appendix A).
static CRC32C: Crc<u32> = Crc::<u32>::new(&CRC_32_ISCSI);

/// The refusals sent this second.
static LIMIT: crate::limits::PerSecond = crate::limits::PerSecond::new(MAX_PER_SECOND);

/// What a refusal is, by protocol (the `answer` label of the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A TCP RST.
    TcpReset,
    /// ICMP(v6) destination unreachable, administratively prohibited.
    IcmpProhibited,
    /// An SCTP ABORT.
    SctpAbort,
}

impl Answer {
    /// Every answer, in metric order.
    pub const ALL: [Answer; 3] = [Answer::TcpReset, Answer::IcmpProhibited, Answer::SctpAbort];

    /// `tcp_reset`, `icmp_prohibited`, `sctp_abort`.
    pub fn as_str(self) -> &'static str {
        match self {
            Answer::TcpReset => "tcp_reset",
            Answer::IcmpProhibited => "icmp_prohibited",
            Answer::SctpAbort => "sctp_abort",
        }
    }

    /// Position in [`Answer::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// A refusal ready to send: a whole IP packet to `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What it is.
    pub answer: Answer,
    /// The client it goes to.
    pub to: IpAddr,
    /// The IP packet, header included.
    pub packet: Vec<u8>,
}

/// Why a queued packet gets no refusal (it is dropped all the same).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RefuseError {
    /// Its headers could not be read.
    #[error("queued packet not understood")]
    Parse(#[source] ParseError),
    /// Its transport header is cut short before the fields an answer needs.
    #[error("{0} header truncated")]
    Truncated(&'static str),
    /// A packet the protocol never answers (a TCP RST; an SCTP ABORT, SHUTDOWN COMPLETE,
    /// SHUTDOWN ACK or COOKIE ERROR: RFC 9293 §3.10.7.1, RFC 9260 §8.4).
    #[error("a {0} is never answered")]
    Unanswerable(&'static str),
}

/// The client's view of the flow: its own address and the address it sent to (before any
/// DNAT).
#[derive(Debug, Clone, Copy)]
struct View {
    client: SocketAddr,
    server: SocketAddr,
}

/// The refusal of `queued`, the first packet of a rejected flow as NFQUEUE delivered it
/// (IP header onwards, possibly cut at the copy range). `original` is its conntrack entry's
/// original tuple (`NFQA_CT`), used when it is of the packet's family and protocol: the
/// addresses the client used, before any DNAT.
///
/// # Errors
/// [`RefuseError`]: a packet without readable headers, cut too short, or one its protocol
/// never answers.
pub fn refusal(queued: &[u8], original: Option<&Tuple>) -> Result<Refusal, RefuseError> {
    let h = packet::headers(queued).map_err(RefuseError::Parse)?;
    let number = protocol_number(h.key.protocol);
    let view = match original {
        Some(o)
            if o.protocol == number
                && o.src.is_ipv4() == h.key.src.is_ipv4()
                && o.dst.is_ipv4() == h.key.dst.is_ipv4() =>
        {
            View { client: o.src, server: o.dst }
        }
        _ => View { client: h.key.src, server: h.key.dst },
    };
    let transport = &queued[h.transport..];
    let (answer, proto, body) = match h.key.protocol {
        FlowProtocol::Tcp => (Answer::TcpReset, TCP, tcp_reset(queued, h.transport, view)?),
        FlowProtocol::Sctp => (Answer::SctpAbort, SCTP, sctp_abort(transport, view)?),
        FlowProtocol::Udp => {
            let quote = quote(queued, h.transport, view);
            let (proto, body) = match view.server.ip() {
                IpAddr::V4(_) => (1, icmp(ICMP_UNREACHABLE, ICMP_HOST_PROHIBITED, &quote)),
                IpAddr::V6(_) => (ICMPV6, icmp(ICMPV6_UNREACHABLE, ICMPV6_PROHIBITED, &quote)),
            };
            (Answer::IcmpProhibited, proto, body)
        }
    };
    let packet = ip_packet(view.server.ip(), view.client.ip(), proto, body);
    Ok(Refusal { answer, to: view.client.ip(), packet })
}

/// The refusal of a UDP datagram of `len` payload bytes from `client` to `server` that the
/// proxy decided itself (no queued packet: see [`super::udp`]): the ICMP error quotes the
/// IP and UDP headers such a datagram carries.
pub fn datagram_refusal(client: SocketAddr, server: SocketAddr, len: usize) -> Refusal {
    let mut udp = Vec::with_capacity(8);
    udp.extend_from_slice(&client.port().to_be_bytes());
    udp.extend_from_slice(&server.port().to_be_bytes());
    let total = (8 + len).min(usize::from(u16::MAX)) as u16;
    udp.extend_from_slice(&total.to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    let datagram = ip_packet_len(client.ip(), server.ip(), UDP, udp, 8 + len);
    refusal(&datagram, None).expect("a well-formed UDP datagram is answered")
}

fn protocol_number(p: FlowProtocol) -> u8 {
    match p {
        FlowProtocol::Tcp => TCP,
        FlowProtocol::Udp => UDP,
        FlowProtocol::Sctp => SCTP,
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Bytes of transport header and payload the packet announces (IPv4 total length or IPv6
/// payload length, less its headers), whatever the copy range kept of them.
fn transport_len(queued: &[u8], transport: usize) -> usize {
    if queued[0] >> 4 == 4 {
        usize::from(be16(queued, 2)).saturating_sub(transport)
    } else {
        (40 + usize::from(be16(queued, 4))).saturating_sub(transport)
    }
}

/// The RST a closed port answers the TCP segment at `transport` with (RFC 9293
/// §3.10.7.1): `<SEQ=SEG.ACK><CTL=RST>` for a segment with ACK, else
/// `<SEQ=0><ACK=SEG.SEQ+SEG.LEN><CTL=RST,ACK>`, SEG.LEN counting SYN, FIN and payload.
fn tcp_reset(queued: &[u8], transport: usize, v: View) -> Result<Vec<u8>, RefuseError> {
    let t = &queued[transport..];
    if t.len() < 20 {
        return Err(RefuseError::Truncated("TCP"));
    }
    let flags = t[13];
    if flags & RST != 0 {
        return Err(RefuseError::Unanswerable("TCP RST"));
    }
    let (seq, ack, out_flags) = if flags & ACK != 0 {
        (be32(t, 8), 0, RST)
    } else {
        let header = usize::from(t[12] >> 4) * 4;
        let payload = transport_len(queued, transport).saturating_sub(header) as u32;
        let len = payload + u32::from(flags & SYN != 0) + u32::from(flags & FIN != 0);
        (0, be32(t, 4).wrapping_add(len), RST | ACK)
    };
    let mut r = Vec::with_capacity(20);
    r.extend_from_slice(&v.server.port().to_be_bytes());
    r.extend_from_slice(&v.client.port().to_be_bytes());
    r.extend_from_slice(&seq.to_be_bytes());
    r.extend_from_slice(&ack.to_be_bytes());
    r.extend_from_slice(&[5 << 4, out_flags, 0, 0, 0, 0, 0, 0]);
    let sum = transport_checksum(v.server.ip(), v.client.ip(), TCP, &r);
    r[16..18].copy_from_slice(&sum.to_be_bytes());
    Ok(r)
}

/// The ABORT answering the SCTP packet `t` (common header onwards; RFC 9260 §8.4): for an
/// INIT, the INIT's initiate tag as verification tag and T clear ((3)); for any other first
/// chunk, the packet's own verification tag reflected, T set ((8)); none for the chunks
/// that are never answered. No error cause: none says "prohibited by policy", and Linux
/// answers an INIT to a closed port with an ABORT without one.
fn sctp_abort(t: &[u8], v: View) -> Result<Vec<u8>, RefuseError> {
    if t.len() < 16 {
        return Err(RefuseError::Truncated("SCTP"));
    }
    let (tag, flags) = match t[12] {
        CHUNK_INIT if t.len() < 20 => return Err(RefuseError::Truncated("SCTP INIT")),
        CHUNK_INIT => (be32(t, 16), 0),
        CHUNK_ABORT | CHUNK_SHUTDOWN_ACK | CHUNK_COOKIE_ERROR | CHUNK_SHUTDOWN_COMPLETE => {
            return Err(RefuseError::Unanswerable("SCTP ABORT, SHUTDOWN or COOKIE ERROR"));
        }
        _ => (be32(t, 4), FLAG_T),
    };
    let mut r = Vec::with_capacity(16);
    r.extend_from_slice(&v.server.port().to_be_bytes());
    r.extend_from_slice(&v.client.port().to_be_bytes());
    r.extend_from_slice(&tag.to_be_bytes());
    r.extend_from_slice(&[0; 4]);
    r.extend_from_slice(&[CHUNK_ABORT, flags, 0, 4]);
    // The checksum is computed over the packet with the field zero and stored
    // little-endian (RFC 9260 Appendix A; Linux `sctp_compute_cksum`).
    let sum = CRC32C.checksum(&r);
    r[8..12].copy_from_slice(&sum.to_le_bytes());
    Ok(r)
}

/// The quote an ICMP error carries: the queued packet's IP header (extension headers
/// included) and the first 8 bytes of its transport header (fewer if the copy has fewer),
/// with the addresses and ports the client used (`v`); an IPv4 header's checksum is made
/// right again.
fn quote(queued: &[u8], transport: usize, v: View) -> Vec<u8> {
    let end = queued.len().min(transport + QUOTED_TRANSPORT);
    let mut q = queued[..end].to_vec();
    match (v.client.ip(), v.server.ip()) {
        (IpAddr::V4(c), IpAddr::V4(s)) => {
            q[12..16].copy_from_slice(&c.octets());
            q[16..20].copy_from_slice(&s.octets());
            q[10..12].copy_from_slice(&[0, 0]);
            let sum = checksum(&q[..transport], 0);
            q[10..12].copy_from_slice(&sum.to_be_bytes());
        }
        (IpAddr::V6(c), IpAddr::V6(s)) => {
            q[8..24].copy_from_slice(&c.octets());
            q[24..40].copy_from_slice(&s.octets());
        }
        _ => {}
    }
    if q.len() >= transport + 4 {
        q[transport..transport + 2].copy_from_slice(&v.client.port().to_be_bytes());
        q[transport + 2..transport + 4].copy_from_slice(&v.server.port().to_be_bytes());
    }
    q
}

/// An ICMP or ICMPv6 error message of `kind` and `code` (unused word 0) quoting `quote`.
/// The checksum is left 0 here: it depends on the family ([`ip_packet`] fills it in).
fn icmp(kind: u8, code: u8, quote: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(quote);
    m
}

/// An IP packet from `src` to `dst` carrying `body` of protocol `proto`, whose checksum
/// (ICMP: over the message; ICMPv6: with the pseudo-header, RFC 4443 §2.3) is filled in
/// here for ICMP; TCP and SCTP bodies carry theirs already.
fn ip_packet(src: IpAddr, dst: IpAddr, proto: u8, mut body: Vec<u8>) -> Vec<u8> {
    match proto {
        1 => {
            let sum = checksum(&body, 0);
            body[2..4].copy_from_slice(&sum.to_be_bytes());
        }
        ICMPV6 => {
            let sum = transport_checksum(src, dst, ICMPV6, &body);
            body[2..4].copy_from_slice(&sum.to_be_bytes());
        }
        _ => {}
    }
    let len = body.len();
    ip_packet_len(src, dst, proto, body, len)
}

/// An IP packet whose header announces `len` bytes after it (`body` may be shorter: a
/// header for a quote). IPv4: no options, DF clear, id 0 (the kernel fills in the id and
/// the header checksum of a raw socket's packet, raw(7); it is computed here too, so the
/// bytes are right wherever they go).
fn ip_packet_len(src: IpAddr, dst: IpAddr, proto: u8, body: Vec<u8>, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40 + body.len());
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = (20 + len).min(usize::from(u16::MAX)) as u16;
            p.extend_from_slice(&[0x45, 0]);
            p.extend_from_slice(&total.to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, 0, HOP_LIMIT, proto, 0, 0]);
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            let sum = checksum(&p, 0);
            p[10..12].copy_from_slice(&sum.to_be_bytes());
        }
        _ => {
            let payload = len.min(usize::from(u16::MAX)) as u16;
            p.extend_from_slice(&[0x60, 0, 0, 0]);
            p.extend_from_slice(&payload.to_be_bytes());
            p.extend_from_slice(&[proto, HOP_LIMIT]);
            p.extend_from_slice(&v6(src).octets());
            p.extend_from_slice(&v6(dst).octets());
        }
    }
    p.extend_from_slice(&body);
    p
}

fn v6(ip: IpAddr) -> std::net::Ipv6Addr {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

/// The checksum of a TCP segment or ICMPv6 message `data` (its checksum field zero) with
/// the pseudo-header of `src`, `dst` and `proto` (RFC 9293 §3.1, RFC 8200 §8.1).
fn transport_checksum(src: IpAddr, dst: IpAddr, proto: u8, data: &[u8]) -> u16 {
    let mut pseudo = Vec::with_capacity(40);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, proto]);
            pseudo.extend_from_slice(&(data.len() as u16).to_be_bytes());
        }
        _ => {
            pseudo.extend_from_slice(&v6(src).octets());
            pseudo.extend_from_slice(&v6(dst).octets());
            pseudo.extend_from_slice(&(data.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
        }
    }
    checksum(data, sum16(&pseudo))
}

/// The 16-bit one's complement sum of `data` (RFC 1071), unfolded.
fn sum16(data: &[u8]) -> u32 {
    data.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]))).sum()
}

/// The Internet checksum (RFC 1071) of `data`, starting from the partial sum `initial`.
fn checksum(data: &[u8], initial: u32) -> u16 {
    let mut sum = u64::from(initial) + u64::from(sum16(data));
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// Raw sockets that send refusals, one per family, opened on first use, and the kernel's
/// reject where it answers instead ([`Refuser::refuse_queued`]). One per queue reader
/// thread: sending needs no lock.
#[derive(Debug)]
pub struct Refuser {
    mark: u32,
    v4: Option<Socket>,
    v6: Option<Socket>,
    kernel: Option<KernelRefusal>,
    /// The budget answers count against: the process's [`MAX_PER_SECOND`] (a test's own).
    limit: &'static crate::limits::PerSecond,
}

/// The kernel's reject as the answerer of rejected packets: the ruleset's refusal chains
/// (`redirect`'s `Backend::refuses`) refuse a packet the queue accepted with the reject
/// mark ([`crate::config::RedirectConfig::reject_mark`]). Clones share one switch, armed
/// once those chains are installed: before, a packet accepted so would go on undecided (a
/// previous agent's ruleset, handed over, may lack them).
#[derive(Debug, Clone)]
pub struct KernelRefusal {
    mark: crate::config::Mark,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl KernelRefusal {
    /// Refusals by packets marked `mark` (its bits within its mask set, the rest of the
    /// packet's mark kept), disarmed.
    pub fn new(mark: crate::config::Mark) -> KernelRefusal {
        KernelRefusal { mark, armed: Default::default() }
    }

    /// Says that the refusal chains are installed: from now on rejected packets may be
    /// handed to them.
    pub fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`KernelRefusal::arm`] was called on this or a clone.
    pub fn is_armed(&self) -> bool {
        self.armed.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Whether one more refusal fits in this second's budget (`limit`: [`MAX_PER_SECOND`]);
/// counts and logs (at most once per [`crate::limits::LOG_EVERY`]) the hit when not.
fn within_limit(limit: &crate::limits::PerSecond) -> bool {
    if limit.allow() {
        return true;
    }
    if let Some(n) = crate::limits::LIMITS.rejects.hit() {
        tracing::warn!(
            hits = n,
            max_per_second = MAX_PER_SECOND,
            "refusals of rejected flows over the rate limit: dropped without an answer (their clients time out)"
        );
    }
    false
}

/// What became of one refusal.
#[derive(Debug)]
pub enum Sent {
    /// Sent.
    Sent(Answer),
    /// Over [`MAX_PER_SECOND`]: not sent (counted as a `rejects` limit hit).
    Limited,
    /// No answer for this packet ([`refusal`]'s error).
    Unanswered(RefuseError),
    /// Sending failed.
    Failed(io::Error),
}

impl Refuser {
    /// Refusals from sockets marked `mark` (`SO_MARK`: the ruleset's bypass mark).
    pub fn new(mark: u32) -> Refuser {
        Refuser { mark, v4: None, v6: None, kernel: None, limit: &LIMIT }
    }

    /// Sends `r` unless this refuser's budget ([`MAX_PER_SECOND`]) was spent this second.
    pub fn send_limited(&mut self, r: &Refusal) -> Sent {
        if !within_limit(self.limit) {
            return Sent::Limited;
        }
        match self.send(r) {
            Ok(()) => Sent::Sent(r.answer),
            Err(e) => Sent::Failed(e),
        }
    }

    /// This refuser, handing refusals to the kernel where `kernel` says
    /// ([`Refuser::refuse_queued`]).
    pub fn with_kernel(mut self, kernel: Option<KernelRefusal>) -> Refuser {
        self.kernel = kernel;
        self
    }

    /// Refuses the rejected packet `queued`, whose mark is `mark`, and says what its verdict
    /// is: `None`, drop it (its [`refusal`] sent here with [`Refuser::send_limited`], or
    /// none); `Some(new mark)`, accept it with that mark, for the ruleset's refusal chains
    /// to answer it with the kernel's reject.
    ///
    /// The kernel answers when the queue passed no conntrack entry (`original` is `None`),
    /// a [`KernelRefusal`] is armed, and the answer is one the kernel can send: a TCP RST,
    /// or ICMP for UDP the ruleset did not TPROXY (`tproxied` false; a TPROXY'd datagram's
    /// destination is not local, and the kernel's ICMP source address must be). Either
    /// way the answer counts against [`MAX_PER_SECOND`]: over it the packet is dropped
    /// unanswered ([`Sent::Limited`]).
    pub fn refuse_queued(
        &mut self,
        queued: &[u8],
        mark: u32,
        original: Option<&Tuple>,
        tproxied: bool,
    ) -> (Sent, Option<u32>) {
        let r = match refusal(queued, original) {
            Ok(r) => r,
            Err(e) => return (Sent::Unanswered(e), None),
        };
        let kernel_answers = match r.answer {
            Answer::TcpReset => true,
            Answer::IcmpProhibited => !tproxied,
            Answer::SctpAbort => false,
        };
        let kernel = self.kernel.as_ref().filter(|k| k.is_armed());
        match kernel {
            Some(k) if original.is_none() && kernel_answers => {
                if !within_limit(self.limit) {
                    return (Sent::Limited, None);
                }
                (Sent::Sent(r.answer), Some(mark & !k.mark.mask | k.mark.value))
            }
            _ => (self.send_limited(&r), None),
        }
    }

    /// Sends `r` now, whatever the rate.
    ///
    /// # Errors
    /// The raw socket cannot be opened (no CAP_NET_RAW), marked (no CAP_NET_ADMIN) or sent
    /// on (no route to the client).
    pub fn send(&mut self, r: &Refusal) -> io::Result<()> {
        let (slot, domain) = match r.to {
            IpAddr::V4(_) => (&mut self.v4, Domain::IPV4),
            IpAddr::V6(_) => (&mut self.v6, Domain::IPV6),
        };
        let socket = match slot {
            Some(s) => s,
            None => {
                // IPPROTO_RAW: the packet's own IP header is sent (raw(7): it implies
                // IP_HDRINCL; IPv6 raw sockets of IPPROTO_RAW likewise).
                let s = Socket::new(domain, Type::RAW, Some(Protocol::from(255)))?;
                if self.mark != 0 {
                    s.set_mark(self.mark)?;
                }
                slot.insert(s)
            }
        };
        // The port of a raw socket's address must be 0 (or its protocol).
        socket.send_to(&r.packet, &SocketAddr::new(r.to, 0).into())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4_packet(proto: u8, src: [u8; 4], dst: [u8; 4], transport: &[u8], total: usize) -> Vec<u8> {
        let mut p = vec![0x45, 0];
        p.extend_from_slice(&((20 + total) as u16).to_be_bytes());
        p.extend_from_slice(&[0, 1, 0x40, 0, 63, proto, 0, 0]);
        p.extend_from_slice(&src);
        p.extend_from_slice(&dst);
        let sum = checksum(&p, 0);
        p[10..12].copy_from_slice(&sum.to_be_bytes());
        p.extend_from_slice(transport);
        p
    }

    fn syn(seq: u32, flags: u8) -> Vec<u8> {
        let mut t = vec![0xc3, 0x50, 0, 80];
        t.extend_from_slice(&seq.to_be_bytes());
        t.extend_from_slice(&[0, 0, 0, 9, 0xa0, flags, 0xff, 0xff, 0, 0, 0, 0]);
        t.extend_from_slice(&[0; 20]); // options
        t
    }

    const CLIENT: [u8; 4] = [10, 0, 0, 1];
    const BACKEND: [u8; 4] = [10, 0, 0, 2];

    #[test]
    fn a_syn_is_answered_with_rst_ack_from_the_server_acking_the_syn() {
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(1000, SYN), 40);
        let r = refusal(&p, None).unwrap();
        assert_eq!((r.answer, r.to), (Answer::TcpReset, IpAddr::from(CLIENT)));
        let (ip, t) = r.packet.split_at(20);
        assert_eq!(checksum(ip, 0), 0, "IPv4 header checksum");
        assert_eq!((&ip[12..16], &ip[16..20], ip[9]), (&BACKEND[..], &CLIENT[..], TCP));
        assert_eq!(be16(ip, 2), 40, "a bare 20-byte TCP header");
        assert_eq!((be16(t, 0), be16(t, 2)), (80, 50_000), "ports swapped");
        assert_eq!((be32(t, 4), be32(t, 8), t[13]), (0, 1001, RST | ACK));
        let pseudo = [&BACKEND[..], &CLIENT[..], &[0, TCP, 0, 20]].concat();
        assert_eq!(checksum(t, sum16(&pseudo)), 0, "TCP checksum with the pseudo-header");
    }

    #[test]
    fn a_syn_with_data_is_acked_past_its_data_and_a_segment_with_ack_gets_its_ack_as_seq() {
        // A SYN carrying 10 bytes (TCP Fast Open), cut by the copy range: the IP header's
        // length says how much it carried.
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(u32::MAX, SYN), 40 + 10);
        let r = refusal(&p, None).unwrap();
        assert_eq!(be32(&r.packet[20..], 8), 10, "seq + 1 (SYN) + 10, wrapped");
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(5, ACK), 40);
        let t = refusal(&p, None).unwrap().packet.split_off(20);
        assert_eq!((be32(&t, 4), be32(&t, 8), t[13]), (9, 0, RST));
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(5, RST | ACK), 40);
        assert_eq!(refusal(&p, None), Err(RefuseError::Unanswerable("TCP RST")));
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(5, SYN)[..12], 40);
        assert_eq!(refusal(&p, None), Err(RefuseError::Truncated("TCP")));
    }

    #[test]
    fn a_dnatd_flow_is_answered_from_the_address_the_client_used() {
        let clusterip: SocketAddr = "10.96.0.10:8080".parse().unwrap();
        let orig = Tuple { src: "10.0.0.1:50000".parse().unwrap(), dst: clusterip, protocol: TCP };
        let p = v4_packet(TCP, CLIENT, BACKEND, &syn(1000, SYN), 40);
        let r = refusal(&p, Some(&orig)).unwrap();
        assert_eq!(&r.packet[12..16], &[10, 96, 0, 10]);
        assert_eq!(be16(&r.packet, 20), 8080);
        let pseudo = [&[10, 96, 0, 10][..], &CLIENT[..], &[0, TCP, 0, 20]].concat();
        assert_eq!(checksum(&r.packet[20..], sum16(&pseudo)), 0);
        // A tuple of another protocol is not this packet's: ignored.
        let udp = Tuple { protocol: UDP, ..orig };
        assert_eq!(&refusal(&p, Some(&udp)).unwrap().packet[12..16], &BACKEND[..]);
    }

    #[test]
    fn a_udp_datagram_gets_host_prohibited_quoting_it_as_the_client_sent_it() {
        let udp = [0xc3, 0x50, 0x00, 0x35, 0, 30, 0xab, 0xcd, 1, 2, 3, 4];
        let p = v4_packet(UDP, CLIENT, BACKEND, &udp, 30);
        let orig = Tuple {
            src: "10.0.0.1:50000".parse().unwrap(),
            dst: "10.96.0.10:53".parse().unwrap(),
            protocol: UDP,
        };
        let r = refusal(&p, Some(&orig)).unwrap();
        assert_eq!(r.answer, Answer::IcmpProhibited);
        let (ip, m) = r.packet.split_at(20);
        assert_eq!((ip[9], &ip[12..16]), (1, &[10, 96, 0, 10][..]), "ICMP from the ClusterIP");
        assert_eq!((m[0], m[1]), (3, 10), "destination unreachable, host prohibited");
        assert_eq!(checksum(m, 0), 0);
        assert_eq!(m.len(), 8 + 20 + 8, "the IP header and 8 bytes of the datagram");
        let quoted = &m[8..28];
        assert_eq!(checksum(quoted, 0), 0, "the quoted header's checksum is right again");
        assert_eq!((&quoted[12..16], &quoted[16..20]), (&CLIENT[..], &[10, 96, 0, 10][..]));
        assert_eq!(&m[28..36], &[0xc3, 0x50, 0x00, 0x35, 0, 30, 0xab, 0xcd]);
        assert_eq!(be16(ip, 2) as usize, r.packet.len());
    }

    /// Which rejected packets are handed to the kernel's reject (an accept verdict with the
    /// reject mark) and which the agent answers itself (dropped). Loopback addresses: an
    /// answer the agent sends here stays on this host.
    #[test]
    fn the_kernel_refuses_tcp_and_untproxied_udp_only_when_armed_and_without_conntrack() {
        let (client, server) = ([127, 0, 0, 1], [127, 0, 0, 2]);
        let tcp = v4_packet(TCP, client, server, &syn(1000, SYN), 40);
        let udp = v4_packet(UDP, client, server, &[0xc3, 0x50, 0, 0x35, 0, 9, 0, 0, 1], 9);
        let kernel = KernelRefusal::new(crate::config::Mark::bit(6));
        let mut r = Refuser::new(0).with_kernel(Some(kernel.clone()));
        // Disarmed (the refusal chains not installed yet): never accepted.
        assert_eq!(r.refuse_queued(&tcp, 0, None, false).1, None);
        kernel.arm();
        let (sent, mark) = r.refuse_queued(&tcp, 0x1000, None, false);
        assert!(matches!(sent, Sent::Sent(Answer::TcpReset)), "{sent:?}");
        assert_eq!(mark, Some(0x1040), "the reject bit set, the packet's other bits kept");
        let (sent, mark) = r.refuse_queued(&udp, 0, None, false);
        assert!(matches!(sent, Sent::Sent(Answer::IcmpProhibited)), "{sent:?}");
        assert_eq!(mark, Some(0x40));
        // A TPROXY'd datagram: the kernel's ICMP cannot come from its non-local destination.
        assert_eq!(r.refuse_queued(&udp, 0, None, true).1, None);
        // With the conntrack entry the agent answers from the original destination itself.
        let original = Tuple {
            src: "127.0.0.1:50000".parse().unwrap(),
            dst: "127.0.0.3:80".parse().unwrap(),
            protocol: TCP,
        };
        assert_eq!(r.refuse_queued(&tcp, 0, Some(&original), false).1, None);
        // What no refusal answers is dropped, whoever would answer.
        let rst = v4_packet(TCP, client, server, &syn(1000, RST), 40);
        let (sent, mark) = r.refuse_queued(&rst, 0, None, false);
        assert!(matches!(sent, Sent::Unanswered(RefuseError::Unanswerable(_))), "{sent:?}");
        assert_eq!(mark, None);
        // Without a kernel refusal (no refusal chains) the agent answers everything.
        assert_eq!(Refuser::new(0).refuse_queued(&tcp, 0, None, false).1, None);
    }

    /// A pod flooding a rejected port reaches the refusal budget: past it, a packet the
    /// kernel would have answered is dropped unanswered, not accepted, and each such packet
    /// is counted as a `rejects` limit hit. (A budget of the test's own: the process's is
    /// shared with the tests that send refusals.)
    #[test]
    fn past_the_budget_a_rejected_packet_is_dropped_unanswered_and_counted() {
        static BUDGET: crate::limits::PerSecond = crate::limits::PerSecond::new(10);
        let syn = v4_packet(TCP, [127, 0, 0, 1], [127, 0, 0, 2], &syn(1000, SYN), 40);
        let kernel = KernelRefusal::new(crate::config::Mark::bit(6));
        kernel.arm();
        let mut r = Refuser::new(0).with_kernel(Some(kernel));
        r.limit = &BUDGET;
        let hits = crate::limits::LIMITS.rejects.get();
        let (mut answered, mut limited) = (0, 0);
        for _ in 0..25 {
            match r.refuse_queued(&syn, 0, None, false) {
                (Sent::Sent(Answer::TcpReset), Some(0x40)) => answered += 1,
                (Sent::Limited, None) => limited += 1,
                other => panic!("{other:?}"),
            }
        }
        // Within one second 10 are answered; a second that ends during the loop allows 10
        // more at most.
        assert!((10..=20).contains(&answered), "{answered} answered");
        assert_eq!(answered + limited, 25);
        assert!(crate::limits::LIMITS.rejects.get() - hits >= limited, "each counted");
    }

    #[test]
    fn an_ipv6_datagram_gets_icmpv6_prohibited_with_its_checksum() {
        let c: std::net::Ipv6Addr = "fd00::1".parse().unwrap();
        let s: std::net::Ipv6Addr = "fd00::2".parse().unwrap();
        let r =
            datagram_refusal(SocketAddr::new(c.into(), 40000), SocketAddr::new(s.into(), 53), 5);
        let (ip, m) = r.packet.split_at(40);
        assert_eq!((ip[0] >> 4, ip[6], be16(ip, 4) as usize), (6, ICMPV6, m.len()));
        assert_eq!((&ip[8..24], &ip[24..40]), (&s.octets()[..], &c.octets()[..]));
        assert_eq!((m[0], m[1]), (1, 1), "destination unreachable, administratively prohibited");
        let mut pseudo = [s.octets(), c.octets()].concat();
        pseudo.extend_from_slice(&(m.len() as u32).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, ICMPV6]);
        assert_eq!(checksum(m, sum16(&pseudo)), 0);
        assert_eq!(m.len(), 8 + 40 + 8);
        assert_eq!(&m[48..54], &[0x9c, 0x40, 0, 53, 0, 13], "ports and UDP length");
    }

    fn init(tag: u32) -> Vec<u8> {
        let mut t = vec![0xc3, 0x50, 0x96, 0x0c, 0, 0, 0, 0, 0, 0, 0, 0, CHUNK_INIT, 0, 0, 20];
        t.extend_from_slice(&tag.to_be_bytes());
        t.extend_from_slice(&[0, 0, 0xff, 0xff, 0, 1, 0, 1, 0, 0, 0, 1]);
        t
    }

    #[test]
    fn an_sctp_init_is_aborted_with_its_initiate_tag_and_t_clear() {
        let p = v4_packet(SCTP, CLIENT, BACKEND, &init(0xdead_beef), 32);
        let r = refusal(&p, None).unwrap();
        assert_eq!(r.answer, Answer::SctpAbort);
        let a = &r.packet[20..];
        assert_eq!(a.len(), 16);
        assert_eq!((be16(a, 0), be16(a, 2), be32(a, 4)), (38_412, 50_000, 0xdead_beef));
        assert_eq!(&a[12..], &[CHUNK_ABORT, 0, 0, 4]);
        let mut zeroed = a.to_vec();
        zeroed[8..12].copy_from_slice(&[0; 4]);
        assert_eq!(u32::from_le_bytes(a[8..12].try_into().unwrap()), CRC32C.checksum(&zeroed));
        // Another chunk: its tag reflected, T set; an ABORT is never answered.
        let mut data = init(1);
        data[4..8].copy_from_slice(&7u32.to_be_bytes());
        data[12] = 0; // DATA
        let r = refusal(&v4_packet(SCTP, CLIENT, BACKEND, &data, 32), None).unwrap();
        assert_eq!((be32(&r.packet[20..], 4), r.packet[20 + 13]), (7, FLAG_T));
        data[12] = CHUNK_ABORT;
        let e = refusal(&v4_packet(SCTP, CLIENT, BACKEND, &data, 32), None).unwrap_err();
        assert!(matches!(e, RefuseError::Unanswerable(_)), "{e:?}");
    }

    proptest::proptest! {
        /// Whatever the queue hands over, a refusal is built or refused, never a panic,
        /// and is never much larger than what it answers.
        #[test]
        fn arbitrary_packets_never_panic(bytes in proptest::collection::vec(0u8.., 0..120)) {
            for first in [0x45, 0x46, 0x60] {
                let mut p = bytes.clone();
                if let Some(b) = p.first_mut() { *b = first; }
                if let Ok(r) = refusal(&p, None) {
                    proptest::prop_assert!(r.packet.len() <= p.len().max(40) + 56);
                }
            }
        }
    }
}
