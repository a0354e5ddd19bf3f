//! A minimal `nfnetlink_queue` client with batched verdicts.
//!
//! The kernel sends each queued packet as its own netlink message; this client waits for
//! one, then drains whatever else is pending without blocking (up to a batch size), and
//! answers the whole batch with one `send(2)`: a single `NFQNL_MSG_VERDICT_BATCH` when
//! every packet gets the same verdict and mark (the kernel applies it to every packet with
//! an id up to the given one), else one `NFQNL_MSG_VERDICT` per packet in one datagram.
//! The `nfq` crate reads and verdicts one packet per system call and has no batch verdict,
//! which is why this exists.
//!
//! Message layouts: include/uapi/linux/netfilter/nfnetlink_queue.h and nfnetlink.h
//! (nlmsghdr + nfgenmsg + attributes; multi-byte attribute values are big-endian);
//! netlink(7); the batch verdict: kernel commit 97d32cf9440d ("nfnetlink_queue: batch
//! verdict support", Linux 3.1).

use std::io;
use std::os::fd::{AsFd, OwnedFd};

use nix::errno::Errno;

use super::netlink::{self, Message, NFGEN_HDRLEN, NLM_F_ACK, attr, finish};
use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, send,
    socket,
};

/// `NFNL_SUBSYS_QUEUE`.
const SUBSYS_QUEUE: u16 = 3;
const MSG_PACKET: u16 = 0;
const MSG_VERDICT: u16 = 1;
const MSG_CONFIG: u16 = 2;
const MSG_VERDICT_BATCH: u16 = 3;

const CFG_CMD: u16 = 1;
const CFG_PARAMS: u16 = 2;
const CFG_QUEUE_MAXLEN: u16 = 3;
const CFG_MASK: u16 = 4;
const CFG_FLAGS: u16 = 5;
const CFG_CMD_BIND: u8 = 1;
const COPY_PACKET: u8 = 2;
const CFG_F_FAIL_OPEN: u32 = 1;
/// `NFQA_CFG_F_CONNTRACK`: each packet message carries the packet's conntrack entry
/// (`NFQA_CT`), whose original tuple is the header before any DNAT (what a refusal
/// answers from, [`super::reject`]).
const CFG_F_CONNTRACK: u32 = 2;

const A_PACKET_HDR: u16 = 1;
const A_VERDICT_HDR: u16 = 2;
const A_MARK: u16 = 3;
const A_PAYLOAD: u16 = 10;
const A_CT: u16 = 11;

/// Netfilter verdicts on a queued packet (include/uapi/linux/netfilter.h): the kernel's
/// answer to a packet, not a policy [`crate::policy::Verdict`] (which the queue reader
/// turns into one of these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NfVerdict {
    /// `NF_DROP`.
    Drop,
    /// `NF_ACCEPT`.
    Accept,
    /// `NF_REPEAT`: walk the hook again.
    Repeat,
}

impl NfVerdict {
    fn code(self) -> u32 {
        match self {
            NfVerdict::Drop => 0,
            NfVerdict::Accept => 1,
            NfVerdict::Repeat => 4,
        }
    }
}

/// A queued packet: its id, its mark, the first bytes of its payload (the IP header
/// onward, up to the copy range) and its conntrack entry's attributes.
#[derive(Debug, Clone, Copy)]
pub struct Packet<'a> {
    /// The kernel's id of the packet in its queue (monotonic per queue).
    pub id: u32,
    /// The packet's mark (`skb->mark`), 0 when the kernel sent none.
    pub mark: u32,
    /// The payload.
    pub payload: &'a [u8],
    /// The `NFQA_CT` attribute's content (ctnetlink attributes,
    /// [`super::conntrack::original_tuple`] reads them); empty when the packet has no
    /// conntrack entry or the queue was bound without `NFQA_CFG_F_CONNTRACK`.
    pub conntrack: &'a [u8],
}

/// The answer to one packet: a verdict and, if set, the packet's new mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    /// The verdict.
    pub verdict: NfVerdict,
    /// Replaces the whole packet mark when set.
    pub mark: Option<u32>,
}

/// How long a read of a queue waits for a packet before it returns none: the longest a
/// reader takes to notice it is to hand its queue over (issue #23). An idle reader wakes
/// ten times a second for it.
pub const PARK_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// One bound queue.
#[derive(Debug)]
pub struct Queue {
    fd: OwnedFd,
    num: u16,
    recv_buf: Vec<u8>,
    send_buf: Vec<u8>,
    seq: u32,
}

/// Appends a netlink message header and the nfgenmsg header of queue `queue`; returns the
/// message start.
fn begin(buf: &mut Vec<u8>, msg: u16, flags: u16, seq: u32, queue: u16) -> usize {
    netlink::begin(buf, SUBSYS_QUEUE, msg, flags, seq, 0 /* AF_UNSPEC */, queue)
}

/// Appends the verdict message(s) for `answers` (ids ascending) to `buf`: one batch
/// verdict when all answers are equal, else one verdict per packet.
///
/// A batch verdict covers every packet still queued with an id up to the one it names.
/// That is exactly the answered packets: the kernel queues a packet only after its message
/// reached this socket (a message that cannot be delivered — ENOBUFS — drops its packet,
/// counted as `user_dropped`, or accepts it when the queue fails open), ids increase in
/// the order messages are sent, and the batch answers everything received up to its last
/// id.
fn encode_verdicts(buf: &mut Vec<u8>, queue: u16, seq: u32, answers: &[(u32, Answer)]) {
    let (Some(&(_, first)), Some(&(last_id, _))) = (answers.first(), answers.last()) else {
        return;
    };
    let one = |buf: &mut Vec<u8>, msg: u16, id: u32, a: Answer| {
        let start = begin(buf, msg, 0, seq, queue);
        let mut hdr = [0u8; 8];
        hdr[..4].copy_from_slice(&a.verdict.code().to_be_bytes());
        hdr[4..].copy_from_slice(&id.to_be_bytes());
        attr(buf, A_VERDICT_HDR, &hdr);
        if let Some(mark) = a.mark {
            attr(buf, A_MARK, &mark.to_be_bytes());
        }
        finish(buf, start);
    };
    if answers.len() > 1 && answers.iter().all(|(_, a)| *a == first) {
        one(buf, MSG_VERDICT_BATCH, last_id, first);
    } else {
        for &(id, a) in answers {
            one(buf, MSG_VERDICT, id, a);
        }
    }
}

/// Parses the netlink messages of one datagram: packets are passed to `on_packet`; an
/// error message becomes `Err`; an ACK (error 0) is `Ok(true)`.
fn parse_datagram(data: &[u8], mut on_packet: impl FnMut(Packet<'_>)) -> io::Result<bool> {
    let mut acked = false;
    for m in netlink::messages(data) {
        match m? {
            Message::Error(0) | Message::Done => acked = true,
            Message::Error(code) => return Err(io::Error::from_raw_os_error(code)),
            Message::Other { kind, body }
                if kind == (SUBSYS_QUEUE << 8) | MSG_PACKET && body.len() >= NFGEN_HDRLEN =>
            {
                let mut p = Packet { id: 0, mark: 0, payload: &[], conntrack: &[] };
                let mut have_id = false;
                for (atype, v) in netlink::attrs(&body[NFGEN_HDRLEN..]) {
                    match atype {
                        A_PACKET_HDR if v.len() >= 4 => {
                            p.id = u32::from_be_bytes(v[..4].try_into().expect("4 bytes"));
                            have_id = true;
                        }
                        A_MARK if v.len() >= 4 => {
                            p.mark = u32::from_be_bytes(v[..4].try_into().expect("4 bytes"));
                        }
                        A_PAYLOAD => p.payload = v,
                        A_CT => p.conntrack = v,
                        _ => {}
                    }
                }
                if have_id {
                    on_packet(p);
                }
            }
            Message::Other { .. } => {}
        }
    }
    Ok(acked)
}

/// Receive-buffer bytes reserved per queued packet: a packet message with the copy range
/// is under 512 bytes, but the socket is charged the skb's true size (its allocation, the
/// `sk_buff` and `skb_shared_info` with it), about 1.3 KiB each; 2 KiB leaves room.
pub const RECV_BYTES_PER_PACKET: usize = 2048;

/// Makes the socket's receive buffer hold `max_len` packet messages: the queue's own length
/// limit, not the socket's default (`net.core.rmem_default`, 208 KiB: ~150 messages), must
/// be what a burst of new flows meets first. Beyond the buffer the kernel cannot deliver a
/// message and drops its packet (`user_dropped`, or accepts it when failing open), which a
/// random-source flood did 100,000 times a minute while the queue (`queue_dropped`) never
/// filled (issue #17). `SO_RCVBUFFORCE` (CAP_NET_ADMIN, which binding a queue needs anyway)
/// ignores `net.core.rmem_max`; the kernel doubles the value for its bookkeeping (socket(7)).
///
/// # Errors
/// `setsockopt`'s.
fn size_receive_buffer(fd: &OwnedFd, max_len: u32) -> io::Result<()> {
    let want = (max_len as usize).saturating_mul(RECV_BYTES_PER_PACKET).min(i32::MAX as usize);
    nix::sys::socket::setsockopt(fd, nix::sys::socket::sockopt::RcvBufForce, &want)?;
    Ok(())
}

impl Queue {
    /// Opens a netlink socket and binds queue `num`: copy `copy_range` bytes of each
    /// packet, hold at most `max_len` packets, fail open when full iff `fail_open`, and
    /// pass each packet's conntrack entry with it (`NFQA_CFG_F_CONNTRACK`; the kernel
    /// needs `nf_conntrack_netlink` for it, which it loads on the first request and then
    /// answers `EAGAIN` once: asked again; where it still cannot, the queue is bound
    /// without it, with a warning, and a rejected flow to a DNAT'd address is refused from
    /// the backend's address, which its client ignores).
    ///
    /// # Errors
    /// Socket errors, and the kernel's answer to each configuration request (EPERM
    /// without CAP_NET_ADMIN; EBUSY when another socket holds the queue).
    pub fn bind(num: u16, copy_range: u32, max_len: u32, fail_open: bool) -> io::Result<Queue> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )?;
        bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &NetlinkAddr::new(0, 0))?;
        size_receive_buffer(&fd, max_len)?;
        let mut q = Queue::adopt(num, fd, copy_range)?;
        q.configure(|b| attr(b, CFG_CMD, &[CFG_CMD_BIND, 0, 0, 0]))?;
        q.configure(|b| {
            let mut params = copy_range.to_be_bytes().to_vec();
            params.push(COPY_PACKET);
            attr(b, CFG_PARAMS, &params);
        })?;
        q.configure(|b| attr(b, CFG_QUEUE_MAXLEN, &max_len.to_be_bytes()))?;
        let flags = if fail_open { CFG_F_FAIL_OPEN } else { 0 };
        q.configure(|b| {
            attr(b, CFG_MASK, &CFG_F_FAIL_OPEN.to_be_bytes());
            attr(b, CFG_FLAGS, &flags.to_be_bytes());
        })?;
        let mut conntrack = q.configure(|b| {
            attr(b, CFG_MASK, &CFG_F_CONNTRACK.to_be_bytes());
            attr(b, CFG_FLAGS, &CFG_F_CONNTRACK.to_be_bytes());
        });
        if conntrack.as_ref().is_err_and(|e| e.raw_os_error() == Some(nix::libc::EAGAIN)) {
            conntrack = q.configure(|b| {
                attr(b, CFG_MASK, &CFG_F_CONNTRACK.to_be_bytes());
                attr(b, CFG_FLAGS, &CFG_F_CONNTRACK.to_be_bytes());
            });
        }
        if let Err(e) = conntrack {
            tracing::warn!(
                queue = num,
                error = %e,
                "NFQUEUE without conntrack information: a rejected flow to a ClusterIP or NodePort is refused from its backend's address, which its client ignores (it times out)"
            );
        }
        Ok(q)
    }

    /// The queue `num` bound on `fd` by another process (the previous agent, issue #23):
    /// read as it is, not configured again (a configuration's answer would be read among
    /// the packets waiting on the socket, which must all get a verdict).
    ///
    /// Reads wait at most [`PARK_CHECK`] (`SO_RCVTIMEO`), so that a reader blocked on an
    /// idle queue can notice that it is to stop reading; an idle wait returns no packet.
    ///
    /// # Errors
    /// When the timeout cannot be set on `fd`.
    pub fn adopt(num: u16, fd: OwnedFd, copy_range: u32) -> io::Result<Queue> {
        socket2::SockRef::from(&fd).set_read_timeout(Some(PARK_CHECK))?;
        Ok(Queue {
            fd,
            num,
            // A packet message: headers (~100 bytes) + the copied payload.
            recv_buf: vec![0u8; 65_536 + copy_range as usize],
            send_buf: Vec::with_capacity(4096),
            seq: 0,
        })
    }

    /// The queue number.
    pub fn num(&self) -> u16 {
        self.num
    }

    /// A duplicate of the netlink socket's descriptor, to hand the queue over: the same
    /// socket, bound to the same queue, with the packets waiting on it.
    ///
    /// # Errors
    /// `dup` failing (open files).
    pub fn duplicate(&self) -> io::Result<OwnedFd> {
        self.fd.try_clone()
    }

    /// Sends one config request and waits for its ACK.
    fn configure(&mut self, attrs: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let mut buf = Vec::with_capacity(64);
        let start = begin(&mut buf, MSG_CONFIG, NLM_F_ACK, self.seq, self.num);
        attrs(&mut buf);
        finish(&mut buf, start);
        send(std::os::fd::AsRawFd::as_raw_fd(&self.fd), &buf, MsgFlags::empty())?;
        loop {
            let n = recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                &mut self.recv_buf,
                MsgFlags::empty(),
            )?;
            if parse_datagram(&self.recv_buf[..n], |_| {})? {
                return Ok(());
            }
        }
    }

    /// Waits for at least one packet, takes up to `max_batch` that are pending, asks
    /// `decide` for each, and answers them all with one `send(2)`. Returns how many packets
    /// were answered.
    ///
    /// # Errors
    /// A failed `recv`/`send` (EINTR is retried; ENOBUFS — the kernel dropped messages
    /// because this reader fell behind — is reported so the caller can count it).
    pub fn process(
        &mut self,
        max_batch: usize,
        mut decide: impl FnMut(Packet<'_>) -> Answer,
    ) -> io::Result<usize> {
        let mut answers: Vec<(u32, Answer)> = Vec::with_capacity(max_batch.min(256));
        let raw = std::os::fd::AsRawFd::as_raw_fd(&self.fd);
        let mut flags = MsgFlags::empty();
        while answers.len() < max_batch {
            let n = match recv(raw, &mut self.recv_buf, flags) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => break,
                Err(e) if !answers.is_empty() => {
                    // Answer what we have; the error comes back on the next call.
                    tracing::debug!(error = %e, "NFQUEUE recv in a batch");
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            if let Err(e) = parse_datagram(&self.recv_buf[..n], |p| answers.push((p.id, decide(p))))
            {
                // The kernel's answer to an earlier verdict (ENOENT: the packet was gone,
                // e.g. its queue was flushed) or a malformed message: nothing to undo, and
                // no reason to stop reading.
                tracing::debug!(queue = self.num, error = %e, "NFQUEUE message");
            }
            // After the first (blocking) read, take only what is already there.
            flags = MsgFlags::MSG_DONTWAIT;
        }
        answers.sort_unstable_by_key(|(id, _)| *id);
        self.send_buf.clear();
        self.seq = self.seq.wrapping_add(1);
        encode_verdicts(&mut self.send_buf, self.num, self.seq, &answers);
        if !self.send_buf.is_empty() {
            loop {
                match send(raw, &self.send_buf, MsgFlags::empty()) {
                    Ok(_) => break,
                    Err(Errno::EINTR) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(answers.len())
    }
}

impl AsFd for Queue {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::netlink::{NLMSG_ERROR, NLMSG_HDRLEN};

    /// A message: its type and its attributes (type, value).
    type Message = (u16, Vec<(u16, Vec<u8>)>);

    fn messages(buf: &[u8]) -> Vec<Message> {
        let mut out = Vec::new();
        let mut data = buf;
        while data.len() >= NLMSG_HDRLEN {
            let len = u32::from_ne_bytes(data[0..4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes(data[4..6].try_into().unwrap());
            assert_eq!(data[16 + 2..16 + 4], 7u16.to_be_bytes(), "queue number");
            let mut attrs = &data[NLMSG_HDRLEN + NFGEN_HDRLEN..len];
            let mut list = Vec::new();
            while attrs.len() >= 4 {
                let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
                let atype = u16::from_ne_bytes([attrs[2], attrs[3]]);
                list.push((atype, attrs[4..alen].to_vec()));
                attrs = &attrs[alen.next_multiple_of(4)..];
            }
            out.push((kind & 0xff, list));
            data = &data[len..];
        }
        out
    }

    fn verdict_hdr(code: u32, id: u32) -> Vec<u8> {
        [code.to_be_bytes(), id.to_be_bytes()].concat()
    }

    #[test]
    fn equal_answers_become_one_batch_verdict_for_the_highest_id() {
        let allow = Answer { verdict: NfVerdict::Repeat, mark: Some(0x1000) };
        let mut buf = Vec::new();
        encode_verdicts(&mut buf, 7, 1, &[(10, allow), (11, allow), (14, allow)]);
        let m = messages(&buf);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].0, MSG_VERDICT_BATCH);
        assert_eq!(
            m[0].1,
            vec![(A_VERDICT_HDR, verdict_hdr(4, 14)), (A_MARK, 0x1000u32.to_be_bytes().to_vec())]
        );
    }

    #[test]
    fn mixed_answers_become_one_verdict_each_in_one_datagram() {
        let allow = Answer { verdict: NfVerdict::Repeat, mark: Some(0x1000) };
        let deny = Answer { verdict: NfVerdict::Drop, mark: None };
        let mut buf = Vec::new();
        encode_verdicts(&mut buf, 7, 1, &[(3, allow), (4, deny)]);
        let m = messages(&buf);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].0, MSG_VERDICT);
        assert_eq!(m[0].1[0], (A_VERDICT_HDR, verdict_hdr(4, 3)));
        assert_eq!(m[1].1, vec![(A_VERDICT_HDR, verdict_hdr(0, 4))]);
        // A single answer is a plain verdict.
        let mut buf = Vec::new();
        encode_verdicts(&mut buf, 7, 1, &[(9, deny)]);
        assert_eq!(messages(&buf)[0].0, MSG_VERDICT);
        let mut buf = Vec::new();
        encode_verdicts(&mut buf, 7, 1, &[]);
        assert!(buf.is_empty());
    }

    fn packet_message(id: u32, mark: Option<u32>, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        let start = begin(&mut b, MSG_PACKET, 0, 0, 7);
        attr(&mut b, A_PACKET_HDR, &[id.to_be_bytes().as_slice(), &[0x08, 0x00, 0]].concat());
        if let Some(m) = mark {
            attr(&mut b, A_MARK, &m.to_be_bytes());
        }
        // NLA_F_NET_BYTEORDER set on an attribute type must be ignored.
        attr(&mut b, A_PAYLOAD | 0x4000, payload);
        finish(&mut b, start);
        b
    }

    proptest::proptest! {
        /// A datagram from the socket is parsed or rejected, never a panic.
        #[test]
        fn arbitrary_datagrams_never_panic(bytes in proptest::collection::vec(0u8.., 0..200)) {
            let _ = parse_datagram(&bytes, |_| {});
            // The same bytes behind a well-formed packet header.
            let mut d = packet_message(1, None, &bytes);
            let _ = parse_datagram(&d, |_| {});
            d.truncate(d.len() / 2);
            let _ = parse_datagram(&d, |_| {});
        }
    }

    #[test]
    fn packets_acks_and_errors_are_parsed() {
        let mut d = packet_message(5, Some(0x80), &[0x45, 1, 2]);
        d.extend(packet_message(6, None, &[0x60]));
        let mut seen = Vec::new();
        let acked = parse_datagram(&d, |p| seen.push((p.id, p.mark, p.payload.to_vec()))).unwrap();
        assert!(!acked);
        assert_eq!(seen, vec![(5, 0x80, vec![0x45, 1, 2]), (6, 0, vec![0x60])]);

        let error = |code: i32| {
            let mut b = Vec::new();
            b.extend_from_slice(&36u32.to_ne_bytes());
            b.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
            b.extend_from_slice(&[0; 10]);
            b.extend_from_slice(&code.to_ne_bytes());
            b.extend_from_slice(&[0; 16]);
            b
        };
        assert!(parse_datagram(&error(0), |_| {}).unwrap());
        let e = parse_datagram(&error(-1), |_| {}).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(1));
        // Truncated: a length beyond the datagram.
        let mut bad = packet_message(1, None, &[]);
        bad[0] = 0xff;
        assert!(parse_datagram(&bad, |_| {}).is_err());
    }
}
