//! Netfilter netlink framing shared by the NFQUEUE client ([`super::nfqueue`]) and the
//! ctnetlink client ([`super::conntrack`]): the netlink header, the nfgenmsg header that
//! follows it, and attributes.
//!
//! Layouts: netlink(7) and include/uapi/linux/netlink.h (`nlmsghdr`, native byte order;
//! `NLMSG_ERROR`, `NLMSG_DONE`; attributes aligned to 4 bytes, whose type carries the
//! `NLA_F_NESTED` and `NLA_F_NET_BYTEORDER` flags), include/uapi/linux/netfilter/nfnetlink.h
//! (`nfgenmsg`: family, version, big-endian resource id; the message type is the subsystem
//! in the high byte and the message in the low one).

use std::io;

/// `NLM_F_REQUEST`.
pub const NLM_F_REQUEST: u16 = 1;
/// `NLM_F_ACK`: the kernel answers with an error message of code 0.
pub const NLM_F_ACK: u16 = 4;
/// `NLMSG_HDRLEN`: bytes of the netlink header.
pub const NLMSG_HDRLEN: usize = 16;
/// Bytes of the nfgenmsg header after it.
pub const NFGEN_HDRLEN: usize = 4;
/// `NLMSG_ERROR`: an error (or, with code 0, an ACK).
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`: the end of a dump.
pub const NLMSG_DONE: u16 = 3;
/// Attribute type bits that are flags (`NLA_F_NESTED`, `NLA_F_NET_BYTEORDER`).
const NLA_TYPE_MASK: u16 = 0x3fff;

/// Appends a netlink header (`NLM_F_REQUEST` | `flags`, sequence `seq`, port id 0: the
/// kernel) for message `msg` of netfilter subsystem `subsys`, and an nfgenmsg of `family`
/// and resource id `res_id`. Returns the message's start, for [`finish`].
pub fn begin(
    buf: &mut Vec<u8>,
    subsys: u16,
    msg: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by `finish`
    buf.extend_from_slice(&((subsys << 8) | msg).to_ne_bytes());
    buf.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.extend_from_slice(&[family, 0 /* NFNETLINK_V0 */]);
    buf.extend_from_slice(&res_id.to_be_bytes());
    start
}

/// Appends attribute `kind` with `value`, padded to 4 bytes.
pub fn attr(buf: &mut Vec<u8>, kind: u16, value: &[u8]) {
    buf.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(value);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Writes the length of the message that starts at `start` and ends at the buffer's end.
pub fn finish(buf: &mut [u8], start: usize) {
    let len = (buf.len() - start) as u32;
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

/// One message of a datagram the kernel sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    /// `NLMSG_ERROR`: the errno the kernel answered a request with, 0 for an ACK.
    Error(i32),
    /// `NLMSG_DONE`: the end of a dump.
    Done,
    /// Any other message: its type and what follows the netlink header.
    Other {
        /// The message type (subsystem << 8 | message).
        kind: u16,
        /// The message after the netlink header (the nfgenmsg, then attributes).
        body: &'a [u8],
    },
}

/// The messages of one datagram, in order. A malformed one (a length that does not fit, a
/// short error message) ends the walk with an `InvalidData` error.
pub fn messages(mut data: &[u8]) -> impl Iterator<Item = io::Result<Message<'_>>> {
    let invalid = |what| io::Error::new(io::ErrorKind::InvalidData, what);
    std::iter::from_fn(move || {
        if data.len() < NLMSG_HDRLEN {
            return None;
        }
        let len = u32::from_ne_bytes(data[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(data[4..6].try_into().expect("2 bytes"));
        if len < NLMSG_HDRLEN || len > data.len() {
            data = &[];
            return Some(Err(invalid("malformed netlink message")));
        }
        let body = &data[NLMSG_HDRLEN..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(match kind {
            NLMSG_ERROR => match body.get(0..4) {
                Some(b) => Ok(Message::Error(-i32::from_ne_bytes(b.try_into().expect("4 bytes")))),
                None => {
                    data = &[];
                    Err(invalid("short netlink error message"))
                }
            },
            NLMSG_DONE => Ok(Message::Done),
            kind => Ok(Message::Other { kind, body }),
        })
    })
}

/// The attributes of `data` as (type without its flags, value). A malformed attribute ends
/// the walk.
pub fn attrs(mut data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([data[0], data[1]]) as usize;
        let kind = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            return None;
        }
        let value = &data[4..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some((kind, value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_message_walks_back_with_its_attributes() {
        let mut b = Vec::new();
        let start = begin(&mut b, 1, 2, NLM_F_ACK, 7, 2, 9);
        attr(&mut b, 3, &[1, 2, 3]);
        attr(&mut b, 4 | 0x8000, &[5]);
        finish(&mut b, start);
        let got: Vec<_> = messages(&b).collect::<io::Result<_>>().unwrap();
        let [Message::Other { kind, body }] = got[..] else { panic!("{got:?}") };
        assert_eq!(kind, (1 << 8) | 2);
        assert_eq!(&body[..NFGEN_HDRLEN], &[2, 0, 0, 9]);
        let a: Vec<_> = attrs(&body[NFGEN_HDRLEN..]).collect();
        assert_eq!(a, vec![(3, &[1u8, 2, 3][..]), (4, &[5u8][..])]);
    }

    #[test]
    fn errors_acks_and_bad_lengths() {
        let mut b = Vec::new();
        b.extend_from_slice(&36u32.to_ne_bytes());
        b.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        b.extend_from_slice(&[0; 10]);
        b.extend_from_slice(&(-2i32).to_ne_bytes());
        b.extend_from_slice(&[0; 16]);
        assert_eq!(messages(&b).next().unwrap().unwrap(), Message::Error(2));
        let mut bad = b.clone();
        bad[0] = 200;
        assert!(messages(&bad).next().unwrap().is_err());
        assert_eq!(messages(&bad).count(), 1, "a bad length ends the walk");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(0u8.., 0..300)) {
            for m in messages(&bytes) {
                if let Ok(Message::Other { body, .. }) = m {
                    let _ = attrs(body).count();
                }
            }
        }
    }
}
