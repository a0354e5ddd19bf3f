//! The data path in user space: first-packet decisions read from NFQUEUE, the transparent
//! TCP proxy, the byte relay and the registry of live connections.
//!
//! ```text
//! NFQUEUE ─► queue (threads, nfqueue batches) ─► packet::parse ─► Decider::first_packet
//!                                                      ─► drop | repeat+mark (one send per batch)
//!                                                      │ (rejected: reject::Refuser, then drop)
//!                                                      │ (allowed: decision kept by 5-tuple)
//! TPROXY ─► tcp::serve ─► Lifecycle::admit (Registry, then Decider::take_or_decide)
//!              ─► upstream connect ─► relay (auto) ─► end record (Lifecycle, once)
//! ```
//!
//! Imports `policy` only (DESIGN §4); the redirect ruleset that feeds it lives in
//! `redirect`, and the agent wires the two together.
pub mod busy_poll;
pub mod conntrack;
pub mod decider;
pub mod forwarded;
pub mod handover;
pub mod icmp;
pub mod lifecycle;
pub mod netlink;
pub mod nfqueue;
pub mod packet;
pub mod queue;
pub mod registry;
pub mod reject;
pub mod relay;
pub mod tcp;
pub mod udp;
