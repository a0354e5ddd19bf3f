//! The nftables backend: table `inet <prefix>` with its address, interface and
//! allowed-class sets, three base chains (`prerouting`, `input`, `forward`) and the regular
//! chain `decide`; the source check (chain S: base chain `source` at raw - 10, `pod_source`)
//! and, unless [`RedirectConfig::upstream_zone`] is 0, the base chains `zone_in` and
//! `zone_out` at priority raw (-300, before conntrack) for the upstream legs' conntrack
//! zone (rule 0); `proxied` right after the DNAT (rule 3); and the refusal chains
//! `refuse_input` and `refuse_forward` at -149 with `refuse` (rule 8). Built with the
//! `nftables` crate's typed JSON API and applied by `nft -j -f -` as one transaction
//! (libnftables-json(5)). The iptables backend's table `inet <prefix>-dnat`
//! (`after_dnat_batch`) holds the same chains S, 0, 3 and 8.
//!
//! Re-applying is atomic: the batch adds the table (a no-op when it exists), deletes it and
//! creates it anew, so the kernel swaps the old table for the new one in one commit and
//! nothing else in the ruleset is touched. The base chains hook at priority `mangle` (-150),
//! after conntrack (-200), so `ct state` is known; `prerouting` runs before a `dstnat`
//! chain's DNAT (-100) and routing, `input` and `forward` after both. A REPEAT verdict
//! restarts the hook, so one chain serves both walks of a decided packet.
//!
//! Needs CONFIG_NFT_QUEUE (`queue`), CONFIG_NFT_TPROXY (`tproxy`), CONFIG_NFT_SOCKET
//! (`socket`) and CONFIG_NFT_REJECT_INET (`reject`); [`check_kernel_support`] asks the
//! kernel without changing anything.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use ::nftables::batch::Batch;
use ::nftables::expr::{
    BinaryOperation, CT, Expression, Fib, FibFlag, FibResult, Meta, MetaKey, NamedExpression,
    NgMode, Numgen, Payload, PayloadField, Range, SetItem, Socket, SocketAttr,
};
use ::nftables::schema::{
    Chain, Element, FlushObject, NfCmd, NfListObject, Nftables, Rule, Set, SetFlag, SetType,
    SetTypeValue, Table,
};
use ::nftables::stmt::{
    Counter, JumpTarget, Mangle, Match, Operator, Queue, QueueFlag, Reject, RejectType, SetOp,
    Statement, TProxy,
};
use ::nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook, RejectCode};

use super::exec::Cmd;
use super::{
    ALLOWED_CACHE_MAX, ALLOWED_CACHE_SECS, Backend, BackendKind, COMMENT_ENFORCED,
    COMMENT_ESTABLISHED_TCP, COMMENT_LOCAL_PODS_NO_SOCKET, COMMENT_LOCAL_PODS_SYN,
    COMMENT_LOCAL_PODS_TCP, COMMENT_NODE_SOURCE, COMMENT_POD_SOURCE, COMMENT_STRAY_TCP,
    COMMENT_TCP_PAST_SYN, DropCounts, Names, QUEUED_PROTOCOLS, QueueWhen, RedirectError,
    RulesetSpec, by_family, routing, tproxy_protocols,
};
use crate::config::{Mark, RedirectConfig, UdpPath};

/// Name of the base chain in tierproxy's table that intercepts (hook prerouting).
pub const CHAIN: &str = "prerouting";
/// Name of the base chain hooked at input, jumping to [`DECIDE_CHAIN`].
pub const INPUT_CHAIN: &str = "input";
/// Name of the base chain hooked at forward, jumping to [`DECIDE_CHAIN`].
pub const FORWARD_CHAIN: &str = "forward";
/// Name of the regular chain that queues the undecided packets of pod flows.
pub const DECIDE_CHAIN: &str = "decide";
/// Name of the base chain hooked at prerouting, priority raw, that puts the replies to the
/// proxy's upstream sockets into their conntrack zone (rule 0).
pub const ZONE_IN_CHAIN: &str = "zone_in";
/// Name of the base chain hooked at output, priority raw, that puts the packets of the
/// proxy's upstream sockets into their conntrack zone (rule 0).
pub const ZONE_OUT_CHAIN: &str = "zone_out";
/// Name of the regular chain [`ZONE_IN_CHAIN`] jumps to for a reply from elsewhere to an
/// upstream socket: untracked from an enforcing node's pod, else the zone (rule 0).
pub const ZONE_LEG_CHAIN: &str = "zone_leg";
/// Name of the base chain hooked at prerouting, priority raw - 10, that drops packets with
/// sources their interface cannot own (chain S).
pub const SOURCE_CHAIN: &str = "source";
/// Name of the regular chain chain S sends a pod interface's packets to: the reverse-path
/// check.
pub const POD_SOURCE_CHAIN: &str = "pod_source";
/// Name of the base chain hooked at prerouting right after a `dstnat` chain's DNAT
/// (priority -99) that takes the later packets of proxied connections to a ClusterIP
/// (rule 3, DNAT'd): their socket, or the listener for the ACK of a SYN cookie.
pub const PROXIED_CHAIN: &str = "proxied";
/// Name of the base chain hooked at input right after the decision (priority -149) whose
/// kernel reject answers the rejected packets the queue accepted with the reject mark.
pub const REFUSE_INPUT_CHAIN: &str = "refuse_input";
/// As [`REFUSE_INPUT_CHAIN`], hooked at forward.
pub const REFUSE_FORWARD_CHAIN: &str = "refuse_forward";
/// Name of the regular chain the refusal base chains jump to with a marked packet.
pub const REFUSE_CHAIN: &str = "refuse";
/// Regular chain of rule 7 that spares the new events of all but one in n flows of cached
/// UDP classes ([`RulesetSpec::with_cached_udp_sample`] n ≥ 2).
pub const CACHED_UDP_CHAIN: &str = "cached_udp";

/// TCP header flag bits (RFC 9293 §3.1).
const TCP_FIN: u32 = 0x01;
const TCP_SYN: u32 = 0x02;
const TCP_RST: u32 = 0x04;
const TCP_ACK: u32 = 0x10;

/// nftables' `mangle` priority (nft(8), "Standard priority names").
const PRIORITY_MANGLE: i32 = -150;
/// nftables' `raw` priority: before conntrack (-200), where `ct zone set` must run.
const PRIORITY_RAW: i32 = -300;
/// Right after nftables' `dstnat` priority (-100), where kube-proxy's nftables mode and
/// iptables' nat PREROUTING DNAT: the header is the backend's. `tproxy` may run at any
/// priority of the prerouting hook (nft(8), "TPROXY STATEMENT"), which xt TPROXY, bound
/// to the mangle table (-150), cannot.
const PRIORITY_AFTER_DSTNAT: i32 = -99;
/// Right after the decision (the iptables backend's mangle INPUT and FORWARD, the nftables
/// backend's `input` and `forward`, all at `mangle`, -150): a packet the queue accepted
/// meets the refusal chains before any other chain of the hook can take it.
const PRIORITY_AFTER_DECIDE: i32 = PRIORITY_MANGLE + 1;

/// Set names inside the table (no prefix needed: the table is tierproxy's own).
const PODS_V4: &str = "pods-v4";
const PODS_V6: &str = "pods-v6";
const NODES_V4: &str = "nodes-v4";
const NODES_V6: &str = "nodes-v6";
/// The local pods' interfaces (chain S, rule 3), one set for both families.
const PODIF: &str = "podif";
/// Pods on other nodes whose agent enforces (rule 6: not proxied a second time).
const ENFORCED_V4: &str = "enforced-v4";
const ENFORCED_V6: &str = "enforced-v6";
/// The kernel-side cache of allowed classes (rule 7): `saddr . l4proto . th dport . daddr`
/// (TCP, and UDP on the kernel path).
const ALLOWED_V4: &str = "allowed-v4";
const ALLOWED_V6: &str = "allowed-v6";

/// The nftables backend (see the module docs of `redirect` for the rules).
#[derive(Debug, Clone)]
pub struct NftablesBackend {
    nft: String,
    ip: String,
}

impl Default for NftablesBackend {
    fn default() -> Self {
        NftablesBackend { nft: "nft".into(), ip: "ip".into() }
    }
}

/// One IP family as nftables names it.
#[derive(Debug, Clone, Copy)]
struct Fam {
    /// Payload protocol and `tproxy` family: `ip` or `ip6`.
    proto: &'static str,
    /// `meta nfproto` value: `ipv4` or `ipv6`.
    nfproto: &'static str,
    pods: &'static str,
    nodes: &'static str,
    enforced: &'static str,
    allowed: &'static str,
    addr: SetType,
}

const V4: Fam = Fam {
    proto: "ip",
    nfproto: "ipv4",
    pods: PODS_V4,
    nodes: NODES_V4,
    enforced: ENFORCED_V4,
    allowed: ALLOWED_V4,
    addr: SetType::Ipv4Addr,
};
const V6: Fam = Fam {
    proto: "ip6",
    nfproto: "ipv6",
    pods: PODS_V6,
    nodes: NODES_V6,
    enforced: ENFORCED_V6,
    allowed: ALLOWED_V6,
    addr: SetType::Ipv6Addr,
};

/// A class of TCP SYN in the kernel-side cache: `saddr . tcp dport . daddr` of `fam`.
fn allowed_class(fam: Fam) -> Expression<'static> {
    Expression::Named(NamedExpression::Concat(vec![
        payload(fam.proto, "saddr"),
        meta(MetaKey::L4proto),
        payload("th", "dport"),
        payload(fam.proto, "daddr"),
    ]))
}

/// Adds (or refreshes) the packet's class in the kernel-side cache of `fam` (rule 7).
fn cache_class(fam: Fam) -> Statement<'static> {
    Statement::Set(::nftables::stmt::Set {
        op: SetOp::Update,
        elem: allowed_class(fam),
        set: format!("@{}", fam.allowed).into(),
    })
}

/// Whether the packet's class is in the kernel-side cache of `fam` (rule 7).
fn class_cached(fam: Fam) -> Statement<'static> {
    is(allowed_class(fam), Operator::EQ, str_expr(format!("@{}", fam.allowed)))
}

fn meta(key: MetaKey) -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn payload(proto: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(PayloadField {
        protocol: proto.into(),
        field: field.into(),
    })))
}

fn is(left: Expression<'static>, op: Operator, right: Expression<'static>) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

/// `<fam> <field> @<set>`: the packet's address `field` (`saddr`, `daddr`) is in `set`.
fn in_set(fam: Fam, field: &'static str, set: &'static str) -> Statement<'static> {
    is(payload(fam.proto, field), Operator::EQ, str_expr(format!("@{set}")))
}

fn str_expr(s: impl Into<Cow<'static, str>>) -> Expression<'static> {
    Expression::String(s.into())
}

fn masked_mark(m: Mark) -> Expression<'static> {
    Expression::BinaryOperation(Box::new(BinaryOperation::AND(
        meta(MetaKey::Mark),
        Expression::Number(m.mask),
    )))
}

/// `meta mark & mask == value`.
fn mark_set(m: Mark) -> Statement<'static> {
    is(masked_mark(m), Operator::EQ, Expression::Number(m.value))
}

/// `meta mark set meta mark & ~mask | value`, iptables' `--set-xmark value/mask` for a value
/// within its mask.
fn set_mark(m: Mark) -> Statement<'static> {
    Statement::Mangle(Mangle {
        key: meta(MetaKey::Mark),
        value: Expression::BinaryOperation(Box::new(BinaryOperation::OR(vec![
            Expression::BinaryOperation(Box::new(BinaryOperation::AND(
                meta(MetaKey::Mark),
                Expression::Number(!m.mask),
            ))),
            Expression::Number(m.value),
        ]))),
    })
}

fn socket(key: SocketAttr, value: u32) -> Statement<'static> {
    is(
        Expression::Named(NamedExpression::Socket(Socket { key: Cow::Owned(key) })),
        Operator::EQ,
        Expression::Number(value),
    )
}

/// `ct state`.
fn ct_state() -> Expression<'static> {
    Expression::Named(NamedExpression::CT(CT { key: "state".into(), family: None, dir: None }))
}

/// `ct state { STATES }`: the packet's conntrack state is one of `states` (nft(8), "CT
/// EXPRESSION": `ct state` is a bitmask, so the set is a test of any of its bits).
fn ct_state_in(states: &[&'static str]) -> Statement<'static> {
    let items = states.iter().map(|s| SetItem::Element(str_expr(*s))).collect();
    is(ct_state(), Operator::IN, Expression::Named(NamedExpression::Set(items)))
}

/// `ct status` (a bit set: `expected`, `seen-reply`, `assured`, `confirmed`, ...).
fn ct_status() -> Expression<'static> {
    Expression::Named(NamedExpression::CT(CT { key: "status".into(), family: None, dir: None }))
}

fn l4proto_in(protos: &[&'static str]) -> Statement<'static> {
    is(meta(MetaKey::L4proto), Operator::EQ, l4protos(protos))
}

/// `meta l4proto != { protos }`.
fn l4proto_not_in(protos: &[&'static str]) -> Statement<'static> {
    is(meta(MetaKey::L4proto), Operator::NEQ, l4protos(protos))
}

/// One protocol name, or an anonymous set of them.
fn l4protos(protos: &[&'static str]) -> Expression<'static> {
    match protos {
        [one] => str_expr(*one),
        many => Expression::Named(NamedExpression::Set(
            many.iter().map(|p| SetItem::Element(str_expr(*p))).collect(),
        )),
    }
}

/// `queue num N` to the kernel-forwarded flows' queue
/// ([`RedirectConfig::kernel_forwarded_queue`]), with `bypass` in fail-open mode (while no
/// agent reads it).
fn forwarded_queue(config: &RedirectConfig) -> Statement<'static> {
    let num = Expression::Number(u32::from(config.kernel_forwarded_queue().unwrap_or(u16::MAX)));
    let flags = config.queue_bypass.then(|| HashSet::from([QueueFlag::Bypass]));
    Statement::Queue(Queue { num, flags })
}

fn queue(config: &RedirectConfig) -> Statement<'static> {
    let first = u32::from(config.queue_first);
    let num = match config.queue_last() {
        Some(last) if last != config.queue_first => Expression::Range(Box::new(Range {
            range: [Expression::Number(first), Expression::Number(u32::from(last))],
        })),
        _ => Expression::Number(first),
    };
    // No `fanout`: like iptables' `--queue-balance`, flows are spread by hash, which keeps
    // every packet of a flow on one queue.
    let flags = config.queue_bypass.then(|| HashSet::from([QueueFlag::Bypass]));
    Statement::Queue(Queue { num, flags })
}

/// `tcp flags & (fin|syn|rst|ack) == syn` (`op` EQ), iptables' `--syn`, or its negation
/// (`op` NEQ).
fn tcp_syn(op: Operator) -> Statement<'static> {
    is(
        Expression::BinaryOperation(Box::new(BinaryOperation::AND(
            payload("tcp", "flags"),
            Expression::Number(TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK),
        ))),
        op,
        Expression::Number(TCP_SYN),
    )
}

fn ct(key: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::CT(CT { key: key.into(), family: None, dir: None }))
}

/// An anonymous `counter`: [`NftablesBackend::drop_counts`] reads it back.
fn counter() -> Statement<'static> {
    Statement::Counter(Counter::Anonymous(None))
}

/// `fib saddr . iif oif missing`: no route back to the source through the interface the
/// packet came in on (nft(8), "FIB EXPRESSIONS"; the reverse-path filter).
fn reverse_path_missing() -> Statement<'static> {
    is(
        Expression::Named(NamedExpression::Fib(Fib {
            result: FibResult::Oif,
            flags: HashSet::from([FibFlag::Saddr, FibFlag::Iif]),
        })),
        Operator::EQ,
        Expression::Boolean(false),
    )
}

/// `ct mark & mask == value`.
fn ct_mark_set(m: Mark) -> Statement<'static> {
    is(
        Expression::BinaryOperation(Box::new(BinaryOperation::AND(
            ct("mark"),
            Expression::Number(m.mask),
        ))),
        Operator::EQ,
        Expression::Number(m.value),
    )
}

/// `ct event set destroy`: the packet's (unconfirmed) conntrack entry reports only its
/// destroy event, not its new one (nft(8), "CONNTRACK EXPRESSIONS", `event`;
/// `nft_ct_set_eval`'s `NFT_CT_EVENTMASK`, which sets the entry's event mask).
fn ct_events_destroy_only() -> Statement<'static> {
    Statement::Mangle(Mangle { key: ct("event"), value: str_expr("destroy") })
}

/// `numgen inc mod n != 0`: every packet that reaches it but one in `n` (a counter shared
/// by every CPU; nft(8), "NUMGEN EXPRESSION").
fn numgen_not_first_of(n: u32) -> Statement<'static> {
    is(
        Expression::Named(NamedExpression::Numgen(Numgen {
            mode: NgMode::Inc,
            ng_mod: n,
            offset: None,
        })),
        Operator::NEQ,
        Expression::Number(0),
    )
}

/// Rule 7's spared new events, for the iptables backend (whose xt targets cannot set a
/// conntrack entry's event mask after conntrack has made it) in table `inet
/// <prefix>-dnat`'s base chains after the decision: a new UDP entry of a pod flow reports
/// only its destroy event when its first datagram was decided at the queue (the packet
/// carries the decided mark: the agent knows the flow already) or when its class was
/// cached (the entry carries the decided mark), but for one cached flow in
/// [`RulesetSpec::cached_udp_sample`]'s `n` (none when 0; every one when 1, and then no
/// rule for cached flows). Nothing on the proxy path, where no agent reads the events.
fn spared_events_rules(b: &mut Builder<'_>, spec: &RulesetSpec) {
    let c = spec.config();
    if c.udp_path != UdpPath::Kernel {
        return;
    }
    let n = spec.cached_udp_sample();
    for chain in [REFUSE_INPUT_CHAIN, REFUSE_FORWARD_CHAIN] {
        let new_udp = || vec![l4proto_in(&["udp"]), ct_state_in(&["new"])];
        let mut queued = new_udp();
        queued.extend([mark_set(c.decided_mark), ct_events_destroy_only()]);
        b.rule(chain, COMMENT_DECIDED_SPARED, queued);
        if n != 1 {
            let mut cached = new_udp();
            cached.push(ct_mark_set(c.decided_mark));
            if n >= 2 {
                cached.push(numgen_not_first_of(n));
            }
            cached.push(ct_events_destroy_only());
            b.rule(chain, COMMENT_CACHED_SPARED, cached);
        }
    }
}

/// Comment of the rule that spares a queue-decided UDP flow's new event.
const COMMENT_DECIDED_SPARED: &str = "tierproxy: UDP flow decided at the queue, new event spared";
/// Comment of the rule that spares a cached UDP flow's new event (all but the sample).
const COMMENT_CACHED_SPARED: &str = "tierproxy: UDP flow of a cached class, new event spared";

/// `ct mark set ct mark & ~mask | value`, iptables' `CONNMARK --set-xmark value/mask`.
fn set_ct_mark(m: Mark) -> Statement<'static> {
    Statement::Mangle(Mangle {
        key: ct("mark"),
        value: Expression::BinaryOperation(Box::new(BinaryOperation::OR(vec![
            Expression::BinaryOperation(Box::new(BinaryOperation::AND(
                ct("mark"),
                Expression::Number(!m.mask),
            ))),
            Expression::Number(m.value),
        ]))),
    })
}

/// Route and decided mark, accept: a packet of an established transparent socket.
fn divert(c: &RedirectConfig) -> Vec<Statement<'static>> {
    vec![set_mark(c.route_mark), set_mark(c.decided_mark), Statement::Accept(None)]
}

/// `tproxy` to the listener of `fam`, route mark, accept.
fn tproxy(c: &RedirectConfig, fam: Fam) -> [Statement<'static>; 3] {
    tproxy_to(c, fam, c.tproxy_port)
}

/// `tproxy` to the listener of `fam` for TCP between local pods
/// ([`RedirectConfig::local_pods_port`]), route mark, accept.
fn tproxy_local(c: &RedirectConfig, fam: Fam) -> [Statement<'static>; 3] {
    tproxy_to(c, fam, c.local_pods_port().unwrap_or(c.tproxy_port))
}

/// `tproxy` to `port` on the listener address of `fam`, route mark, accept.
fn tproxy_to(c: &RedirectConfig, fam: Fam, port: u16) -> [Statement<'static>; 3] {
    let addr = match fam.proto {
        "ip" => c.tproxy_addr_v4.to_string(),
        _ => c.tproxy_addr_v6.to_string(),
    };
    [
        Statement::TProxy(TProxy { family: Some(fam.proto.into()), port, addr: Some(addr.into()) }),
        set_mark(c.route_mark),
        Statement::Accept(None),
    ]
}

/// Rule 3 for connections a DNAT after interception rewrote (a ClusterIP): base chain
/// [`PROXIED_CHAIN`] at [`PRIORITY_AFTER_DSTNAT`] in `b`'s table. A later packet of such a
/// connection (TCP, not a SYN, original direction, conntrack mark = route mark, `ct status
/// dnat`) goes to its transparent socket, now found by the rewritten header, or, when no
/// socket has it (the ACK of a SYN cookie), is tproxied to the listener.
fn after_dnat_rules(b: &mut Builder<'_>, c: &RedirectConfig) {
    let later = || {
        vec![
            l4proto_in(&["tcp"]),
            tcp_syn(Operator::NEQ),
            is(ct("direction"), Operator::EQ, str_expr("original")),
            ct_mark_set(c.route_mark),
            is(ct("status"), Operator::IN, str_expr("dnat")),
        ]
    };
    b.batch.add(NfListObject::Chain(b.base_chain_at(
        PROXIED_CHAIN,
        NfHook::Prerouting,
        PRIORITY_AFTER_DSTNAT,
    )));
    let mut expr = later();
    expr.extend([socket(SocketAttr::Transparent, 1), socket(SocketAttr::Wildcard, 0)]);
    expr.extend(divert(c));
    b.rule(PROXIED_CHAIN, "tierproxy: proxied connection after DNAT", expr);
    for fam in [V4, V6] {
        let mut expr = later();
        expr.insert(0, is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)));
        expr.extend(tproxy(c, fam));
        b.rule(PROXIED_CHAIN, "tierproxy: no socket yet after DNAT (SYN cookie)", expr);
    }
}

/// The refusal chains (issue #22, "Reject"): base chains [`REFUSE_INPUT_CHAIN`] and
/// [`REFUSE_FORWARD_CHAIN`] at [`PRIORITY_AFTER_DECIDE`] in `b`'s table, jumping to
/// [`REFUSE_CHAIN`]. A packet carrying the reject mark ([`RedirectConfig::reject_mark`],
/// set only by a queue verdict on a rejected first packet) is refused by the kernel: TCP
/// with a RST (`reject with tcp reset`), anything else with ICMP destination unreachable
/// code 10, host administratively prohibited, or ICMPv6 code 1, administratively
/// prohibited, Antrea's answers (`proxy::reject`). nft's reject drops the packet and
/// attaches its conntrack entry to the answer (`nf_send_reset`, `icmp_send`), so NAT
/// un-does a DNAT on the answer: it comes from the ClusterIP or NodePort the client used,
/// which the agent cannot know where the queue passes no conntrack entry (nft(8), "REJECT
/// STATEMENT").
fn refusal_rules(b: &mut Builder<'_>, c: &RedirectConfig) {
    // Every packet of the hooks meets the base chains: one mark test each, the rest in
    // the regular chain.
    b.batch.add(NfListObject::Chain(b.regular_chain(REFUSE_CHAIN)));
    let reject = |ty: RejectType, code: Option<RejectCode>| {
        Statement::Reject(Some(Reject::new(Some(ty), code)))
    };
    let comment = "tierproxy: rejected, refused by the kernel";
    b.rule(REFUSE_CHAIN, comment, vec![l4proto_in(&["tcp"]), reject(RejectType::TCPReset, None)]);
    for (nfproto, ty, code) in [
        ("ipv4", RejectType::ICMP, RejectCode::HostProhibited),
        ("ipv6", RejectType::ICMPv6, RejectCode::AdminProhibited),
    ] {
        b.rule(
            REFUSE_CHAIN,
            comment,
            vec![
                is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(nfproto)),
                reject(ty, Some(code)),
            ],
        );
    }
    for (chain, hook) in
        [(REFUSE_INPUT_CHAIN, NfHook::Input), (REFUSE_FORWARD_CHAIN, NfHook::Forward)]
    {
        b.batch.add(NfListObject::Chain(b.base_chain_at(chain, hook, PRIORITY_AFTER_DECIDE)));
        b.rule(
            chain,
            "tierproxy: rejected",
            vec![
                mark_set(c.refused_mark()),
                Statement::Jump(JumpTarget { target: REFUSE_CHAIN.into() }),
            ],
        );
    }
}

/// The transaction the iptables backend adds when the kernel has nft's `tproxy`, `socket`,
/// `reject` and `fib` (xt TPROXY cannot run after the DNAT, xt REJECT not in the mangle
/// table): table `inet <prefix>-dnat` ([`Names::dnat_table`]) replaced by one holding
/// [`after_dnat_rules`], [`refusal_rules`] and the raw-priority chains ([`raw_rules`],
/// with their sets), which then take the place of the raw table's xt rules: native set
/// lookups and a native reverse-path check cost a packet less than their xt matches
/// through iptables-nft (docs/architecture.md, "The raw chains in nft").
pub(crate) fn after_dnat_batch(spec: &RulesetSpec) -> Nftables<'static> {
    let config = spec.config();
    let mut b = Builder { table: Names::new(config).dnat_table, batch: Batch::new() };
    b.batch.add(NfListObject::Table(b.table()));
    b.batch.delete(NfListObject::Table(b.table()));
    b.batch.add(NfListObject::Table(b.table()));
    raw_sets(&mut b, spec);
    after_dnat_rules(&mut b, config);
    refusal_rules(&mut b, config);
    spared_events_rules(&mut b, spec);
    raw_rules(&mut b, config);
    b.batch.to_nftables()
}

/// The transaction that replaces table `inet <table>` with one holding [`refusal_rules`]
/// alone.
pub(crate) fn refusal_batch(config: &RedirectConfig, table: &str) -> Nftables<'static> {
    let mut b = Builder { table: table.to_owned(), batch: Batch::new() };
    b.batch.add(NfListObject::Table(b.table()));
    b.batch.delete(NfListObject::Table(b.table()));
    b.batch.add(NfListObject::Table(b.table()));
    refusal_rules(&mut b, config);
    b.batch.to_nftables()
}

/// The transaction that removes table `inet <table>` if it exists.
pub(crate) fn remove_table_batch(table: &str) -> Nftables<'static> {
    let mut b = Builder { table: table.to_owned(), batch: Batch::new() };
    b.batch.add(NfListObject::Table(b.table()));
    b.batch.delete(NfListObject::Table(b.table()));
    b.batch.to_nftables()
}

/// `input` as the JSON `nft -j -f -` reads (flags sorted, so renderings are stable).
pub(crate) fn json(input: &Nftables<'_>) -> String {
    to_json(input, false)
}

/// Whether the kernel runs nft's `tproxy`, `socket`, `reject` and `fib` (CONFIG_NFT_TPROXY,
/// CONFIG_NFT_SOCKET, CONFIG_NFT_REJECT with CONFIG_NFT_REJECT_INET, CONFIG_NFT_FIB_INET),
/// without `queue`: what the iptables backend needs for [`after_dnat_batch`]. Checked as
/// [`check_kernel_support`] does, with `nft -c`.
///
/// # Errors
/// The failing `nft` command with its standard error.
pub fn check_tproxy_support(nft: &str) -> Result<(), RedirectError> {
    let mut b = Builder { table: "tierproxy-probe".into(), batch: Batch::new() };
    b.batch.add(NfListObject::Table(b.table()));
    after_dnat_rules(&mut b, &RedirectConfig::default());
    refusal_rules(&mut b, &RedirectConfig::default());
    // The spared new events too (`ct event set`, `numgen`: CONFIG_NF_CONNTRACK_EVENTS,
    // CONFIG_NFT_NUMGEN), with a sample so that both rules are checked.
    let spec = RulesetSpec::new(RedirectConfig::default(), [], [])?.with_cached_udp_sample(2);
    spared_events_rules(&mut b, &spec);
    // The raw-priority chains (`fib`, `socket mark`, `notrack`, `ct zone set`) and sets.
    raw_sets(&mut b, &spec);
    raw_rules(&mut b, spec.config());
    Cmd::new(nft, ["-c", "-j", "-f", "-"]).run(Some(&to_json(&b.batch.to_nftables(), false)))?;
    Ok(())
}

struct Builder<'s> {
    table: String,
    batch: Batch<'s>,
}

impl<'s> Builder<'s> {
    fn table(&self) -> Table<'s> {
        Table { family: NfFamily::INet, name: self.table.clone().into(), handle: None }
    }

    /// A base chain: filter type, `hook` at mangle priority, policy accept.
    fn base_chain(&self, name: &'static str, hook: NfHook) -> Chain<'s> {
        self.base_chain_at(name, hook, PRIORITY_MANGLE)
    }

    /// A base chain: filter type, `hook` at `prio`, policy accept.
    fn base_chain_at(&self, name: &'static str, hook: NfHook, prio: i32) -> Chain<'s> {
        Chain {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: name.into(),
            _type: Some(NfChainType::Filter),
            hook: Some(hook),
            prio: Some(prio),
            policy: Some(NfChainPolicy::Accept),
            ..Chain::default()
        }
    }

    /// The prerouting base chain.
    fn prerouting(&self) -> Chain<'s> {
        self.base_chain(CHAIN, NfHook::Prerouting)
    }

    /// A regular chain (no hook), reached by `jump`.
    fn regular_chain(&self, name: &'static str) -> Chain<'s> {
        Chain {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: name.into(),
            ..Chain::default()
        }
    }

    fn rule(&mut self, chain: &'static str, comment: &'static str, expr: Vec<Statement<'s>>) {
        self.batch.add(NfListObject::Rule(Rule {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            chain: chain.into(),
            expr: expr.into(),
            handle: None,
            index: None,
            comment: Some(comment.into()),
        }));
    }

    fn set(&mut self, name: &'static str, ty: SetType, members: &BTreeSet<IpAddr>) {
        let set = self.ip_set(name, ty, members);
        self.batch.add(NfListObject::Set(Box::new(set)));
    }

    /// The address set `name` of type `ty`, with `members` as its elements.
    fn ip_set(&self, name: &'static str, ty: SetType, members: &BTreeSet<IpAddr>) -> Set<'s> {
        let elem: Vec<Expression<'s>> = members.iter().map(|a| str_expr(a.to_string())).collect();
        Set {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: name.into(),
            handle: None,
            set_type: SetTypeValue::Single(ty),
            policy: None,
            flags: None,
            elem: (!elem.is_empty()).then(|| elem.into()),
            timeout: None,
            gc_interval: None,
            size: None,
            comment: None,
        }
    }

    /// The kernel-side cache of allowed TCP classes of `fam` (empty; elements are added by
    /// the ruleset itself, with a timeout).
    fn allowed_set(&self, fam: Fam) -> Set<'s> {
        Set {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: fam.allowed.into(),
            handle: None,
            set_type: SetTypeValue::Concatenated(
                vec![fam.addr, SetType::InetProto, SetType::InetService, fam.addr].into(),
            ),
            policy: None,
            // `timeout` only: nft 1.0.6's JSON parser refuses `dynamic`, and a set that the
            // ruleset updates from the packet path gets it from the kernel anyway.
            flags: Some(HashSet::from([SetFlag::Timeout])),
            elem: None,
            timeout: Some(ALLOWED_CACHE_SECS),
            gc_interval: None,
            size: Some(ALLOWED_CACHE_MAX),
            comment: None,
        }
    }

    /// The `ifname` set of the local pods' interfaces, with `members` as its elements.
    fn ifname_set(&self, members: &BTreeSet<String>) -> Set<'s> {
        let elem: Vec<Expression<'s>> = members.iter().map(|i| str_expr(i.clone())).collect();
        Set {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: PODIF.into(),
            handle: None,
            set_type: SetTypeValue::Single(SetType::Ifname),
            policy: None,
            flags: None,
            elem: (!elem.is_empty()).then(|| elem.into()),
            timeout: None,
            gc_interval: None,
            size: None,
            comment: None,
        }
    }

    fn elements(&self, name: &'static str, members: &BTreeSet<IpAddr>) -> NfListObject<'s> {
        NfListObject::Element(Element {
            family: NfFamily::INet,
            table: self.table.clone().into(),
            name: name.into(),
            elem: members.iter().map(|a| str_expr(a.to_string())).collect::<Vec<_>>().into(),
        })
    }
}

/// The sets [`raw_rules`] reads, holding `spec`'s addresses and interfaces: the local pods,
/// the node's addresses and the enforced pods (IPv4 and IPv6 each), and the pod interfaces.
fn raw_sets(b: &mut Builder<'_>, spec: &RulesetSpec) {
    let (pods4, pods6) = by_family(spec.local_pods());
    let (nodes4, nodes6) = by_family(spec.node_addrs());
    let (enforced4, enforced6) = by_family(spec.enforced_pods());
    b.set(PODS_V4, SetType::Ipv4Addr, &pods4);
    b.set(PODS_V6, SetType::Ipv6Addr, &pods6);
    b.set(NODES_V4, SetType::Ipv4Addr, &nodes4);
    b.set(NODES_V6, SetType::Ipv6Addr, &nodes6);
    b.set(ENFORCED_V4, SetType::Ipv4Addr, &enforced4);
    b.set(ENFORCED_V6, SetType::Ipv6Addr, &enforced6);
    b.batch.add(NfListObject::Set(Box::new(b.ifname_set(spec.pod_interfaces()))));
}

/// The raw-priority chains, before conntrack: chain S (`source`, sources a pod cannot own)
/// and, unless [`RedirectConfig::upstream_zone`] is 0, rule 0 (`zone_in`, `zone_out`,
/// `zone_leg`: the upstream legs' conntrack zone); see the module docs of `redirect`.
/// They read the sets of pods, node addresses, enforced pods and pod interfaces, which
/// the table must hold ([`raw_sets`]). The nftables backend's table has them, and so does
/// the iptables backend's table `inet <prefix>-dnat` ([`after_dnat_batch`]), where they
/// replace the xt rules of the raw table.
fn raw_rules(b: &mut Builder<'_>, c: &RedirectConfig) {
    // Chain S: sources a pod cannot own (see `redirect`), before conntrack and the zones.
    // With the source check, a packet from a pod's interface goes to the reverse-path
    // check and ends the chain there (`goto`): the check drops a node's own address as
    // well (its reverse route is not through the pod's interface), so a pod's packet costs
    // one set lookup here, not two, as in the iptables backend's xt rules.
    b.batch.add(NfListObject::Chain(b.base_chain_at(
        SOURCE_CHAIN,
        NfHook::Prerouting,
        PRIORITY_RAW - 10,
    )));
    b.rule(
        SOURCE_CHAIN,
        "tierproxy: the node itself, over loopback",
        vec![is(meta(MetaKey::Iifname), Operator::EQ, str_expr("lo")), Statement::Return(None)],
    );
    if c.source_check {
        b.batch.add(NfListObject::Chain(b.regular_chain(POD_SOURCE_CHAIN)));
        b.rule(
            POD_SOURCE_CHAIN,
            COMMENT_POD_SOURCE,
            vec![reverse_path_missing(), counter(), Statement::Drop(None)],
        );
        b.rule(
            SOURCE_CHAIN,
            "tierproxy: from a local pod interface",
            vec![
                is(meta(MetaKey::Iifname), Operator::EQ, str_expr(format!("@{PODIF}"))),
                Statement::Goto(JumpTarget { target: POD_SOURCE_CHAIN.into() }),
            ],
        );
    }
    for fam in [V4, V6] {
        b.rule(
            SOURCE_CHAIN,
            COMMENT_NODE_SOURCE,
            vec![in_set(fam, "saddr", fam.nodes), counter(), Statement::Drop(None)],
        );
    }

    // Rule 0: the upstream legs in a conntrack zone of their own (see `redirect`).
    if c.upstream_zone != 0 {
        let zone = || {
            Statement::Mangle(Mangle {
                key: ct("zone"),
                value: Expression::Number(u32::from(c.upstream_zone)),
            })
        };
        b.batch.add(NfListObject::Chain(b.base_chain_at(
            ZONE_IN_CHAIN,
            NfHook::Prerouting,
            PRIORITY_RAW,
        )));
        b.batch.add(NfListObject::Chain(b.base_chain_at(
            ZONE_OUT_CHAIN,
            NfHook::Output,
            PRIORITY_RAW,
        )));
        b.rule(
            ZONE_IN_CHAIN,
            "tierproxy: proxy upstream sockets (bypass mark)",
            vec![mark_set(c.bypass_mark), Statement::Return(None)],
        );
        // On the kernel UDP path no upstream leg is UDP: a UDP packet leaves here, before
        // the rules below look its addresses up in the pod sets (two or three lookups a
        // datagram from or to a local pod, for rules its protocol then fails).
        if c.udp_path == UdpPath::Kernel {
            b.rule(
                ZONE_IN_CHAIN,
                "tierproxy: UDP, no upstream leg on the kernel UDP path",
                vec![l4proto_in(&["udp"]), Statement::Return(None)],
            );
        }
        // TCP between two local pods is the client leg of a connection this node's proxy
        // holds or its upstream leg (the SYN of every such connection is tproxied), both
        // untracked: nothing reads their conntrack state (see `redirect`, rule 0), and a
        // packet of either leaves here before the socket lookups below.
        for fam in [V4, V6] {
            b.rule(ZONE_IN_CHAIN, COMMENT_LOCAL_PODS_TCP, local_pods_tcp(fam, Statement::Notrack));
        }
        // `socket mark` reads the found socket's SO_MARK; the packet's mark is left alone.
        let socket_mark = is(
            Expression::BinaryOperation(Box::new(BinaryOperation::AND(
                Expression::Named(NamedExpression::Socket(Socket {
                    key: Cow::Owned(SocketAttr::Mark),
                })),
                Expression::Number(c.bypass_mark.mask),
            ))),
            Operator::EQ,
            Expression::Number(c.bypass_mark.value),
        );
        b.batch.add(NfListObject::Chain(b.regular_chain(ZONE_LEG_CHAIN)));
        for fam in [V4, V6] {
            for (field, comment) in [
                ("saddr", "tierproxy: upstream leg from a local pod, untracked"),
                ("daddr", "tierproxy: upstream leg to a local pod"),
            ] {
                // Any socket, not only transparent ones: see the iptables backend.
                let mut expr = vec![in_set(fam, field, fam.pods)];
                if field == "daddr" {
                    // From a local pod as well: the rule before looked its socket up.
                    expr.push(is(
                        payload(fam.proto, "saddr"),
                        Operator::NEQ,
                        str_expr(format!("@{}", fam.pods)),
                    ));
                }
                // Replies from a local pod: of a leg to that pod, untracked; from elsewhere:
                // the leg chain tells an enforcing node's pod from the rest after this one
                // socket lookup (see the iptables backend).
                let then = if field == "saddr" {
                    Statement::Notrack
                } else {
                    Statement::Jump(JumpTarget { target: ZONE_LEG_CHAIN.into() })
                };
                expr.extend([socket_mark.clone(), then]);
                b.rule(ZONE_IN_CHAIN, comment, expr);
            }
        }
        for fam in [V4, V6] {
            b.rule(
                ZONE_LEG_CHAIN,
                "tierproxy: upstream leg from a pod of an enforcing node, untracked",
                vec![
                    in_set(fam, "saddr", fam.enforced),
                    Statement::Notrack,
                    Statement::Return(None),
                ],
            );
        }
        b.rule(ZONE_LEG_CHAIN, "tierproxy: upstream leg from elsewhere, own zone", vec![zone()]);
        // Not the agent's ICMP errors, which belong to the client's flow: see the iptables
        // backend. A leg to a local pod or to a pod of an enforcing node is untracked, and
        // returns: `ct zone set` would put an untracked packet in the zone again (it skips
        // only a packet with an entry).
        for (enforced, comment) in [
            (false, "tierproxy: proxy upstream sockets to a local pod, untracked"),
            (true, "tierproxy: proxy upstream sockets to a pod of an enforcing node, untracked"),
        ] {
            for fam in [V4, V6] {
                let set = if enforced { fam.enforced } else { fam.pods };
                b.rule(
                    ZONE_OUT_CHAIN,
                    comment,
                    vec![
                        mark_set(c.bypass_mark),
                        l4proto_not_in(&["icmp", "ipv6-icmp"]),
                        in_set(fam, "daddr", set),
                        Statement::Notrack,
                        Statement::Return(None),
                    ],
                );
            }
        }
        b.rule(
            ZONE_OUT_CHAIN,
            "tierproxy: proxy upstream sockets, own zone",
            vec![mark_set(c.bypass_mark), l4proto_not_in(&["icmp", "ipv6-icmp"]), zone()],
        );
    }
}

/// `meta l4proto tcp <fam> saddr @pods <fam> daddr @pods`, then `then` and return: TCP
/// between two local pods (rule 0's notrack in `zone_in`).
fn local_pods_tcp(fam: Fam, then: Statement<'static>) -> Vec<Statement<'static>> {
    vec![
        l4proto_in(&["tcp"]),
        in_set(fam, "saddr", fam.pods),
        in_set(fam, "daddr", fam.pods),
        then,
        Statement::Return(None),
    ]
}

/// Untracked TCP between two local pods of `fam` (rule 0 untracks it), its SYN (`syn` =
/// `==`) or past it (`!=`): the matches of rules 3 and 6 that send it to the local pods'
/// listener, and of the drops after them.
fn untracked_local_pods_tcp(fam: Fam, syn: Operator) -> Vec<Statement<'static>> {
    vec![
        is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
        l4proto_in(&["tcp"]),
        tcp_syn(syn),
        ct_state_in(&["untracked"]),
        in_set(fam, "saddr", fam.pods),
        in_set(fam, "daddr", fam.pods),
    ]
}

/// Rules 3 and 6 for untracked TCP between two local pods, past its SYN (`syn` = `!=`,
/// counted with the stray drops) or its SYN (`==`): to the local pods' listener, and
/// without one (fail-closed) dropped after nft's `tproxy`, which goes on when no
/// listener takes the packet. Only with an upstream zone, which untracks them (rule 0).
fn untracked_local_pods_to_listener(
    b: &mut Builder<'_>,
    c: &RedirectConfig,
    syn: Operator,
    comment: &'static str,
) {
    if c.upstream_zone == 0 {
        return;
    }
    for fam in [V4, V6] {
        let mut expr = untracked_local_pods_tcp(fam, syn);
        if syn == Operator::NEQ {
            expr.push(counter());
        }
        expr.extend(tproxy_local(c, fam));
        b.rule(CHAIN, comment, expr);
        if !c.queue_bypass {
            let mut expr = untracked_local_pods_tcp(fam, syn);
            expr.push(Statement::Drop(None));
            b.rule(CHAIN, "tierproxy: no proxy listener", expr);
        }
    }
}

/// The transaction [`NftablesBackend::apply`] sends: replace table `inet <prefix>` with
/// the sets and chains of `spec`.
fn apply_batch(spec: &RulesetSpec) -> Nftables<'static> {
    let c = spec.config();
    let mut b = Builder { table: spec.names().table, batch: Batch::new() };
    // Delete-if-exists: `add table` is a no-op on an existing table, so the delete that
    // follows always succeeds, and the new table replaces the old one in the same commit.
    b.batch.add(NfListObject::Table(b.table()));
    b.batch.delete(NfListObject::Table(b.table()));
    b.batch.add(NfListObject::Table(b.table()));
    raw_sets(&mut b, spec);
    for fam in [V4, V6] {
        b.batch.add(NfListObject::Set(Box::new(b.allowed_set(fam))));
    }
    b.batch.add(NfListObject::Chain(b.prerouting()));
    b.batch.add(NfListObject::Chain(b.regular_chain(DECIDE_CHAIN)));
    b.batch.add(NfListObject::Chain(b.base_chain(INPUT_CHAIN, NfHook::Input)));
    b.batch.add(NfListObject::Chain(b.base_chain(FORWARD_CHAIN, NfHook::Forward)));
    let divert = || divert(c);
    let tproxy = |fam: Fam| tproxy(c, fam);

    raw_rules(&mut b, c);

    // PREROUTING, rule 1: the proxy's own upstream packets are never touched (return =
    // chain policy).
    b.rule(
        CHAIN,
        "tierproxy: proxy upstream sockets (bypass mark)",
        vec![mark_set(c.bypass_mark), Statement::Return(None)],
    );
    if c.udp_path == UdpPath::Kernel {
        // Nothing below is for UDP on the kernel path (it is neither tproxied nor owned by a
        // proxy socket): spare every datagram the socket lookups and set matches.
        b.rule(
            CHAIN,
            "tierproxy: UDP, decided in INPUT and FORWARD",
            vec![l4proto_in(&["udp"]), Statement::Return(None)],
        );
    }
    // Rule 2: established transparent sockets (proxied flows, upstream replies) → local.
    // `socket wildcard 0` ignores listeners bound to the any-address, as xt socket does.
    // Not a TCP SYN: the socket lookup finds TIME_WAIT sockets too, and a SYN reusing the
    // 4-tuple of a client leg in TIME_WAIT must reach `tproxy` (rule 6), which hands it to
    // the listener; delivered to the TIME_WAIT socket it is answered with a bare ACK.
    for first in [
        vec![l4proto_in(&["tcp"]), tcp_syn(Operator::NEQ)],
        vec![is(meta(MetaKey::L4proto), Operator::NEQ, str_expr("tcp"))],
    ] {
        let mut expr = first;
        expr.extend([socket(SocketAttr::Transparent, 1), socket(SocketAttr::Wildcard, 0)]);
        expr.extend(divert());
        b.rule(CHAIN, "tierproxy: established transparent socket", expr);
    }
    // Rule 3: later packets of a TCP connection whose SYN rule 6 tproxied, that no socket
    // took in rule 2. Destination rewritten by a DNAT after this hook (a ClusterIP): in
    // chain `proxied`, after the DNAT, where the socket lookup and tproxy see the header
    // the connection's socket has. Otherwise to the listener here: the ACK that completes
    // a SYN cookie has no socket yet.
    let later = || {
        vec![
            l4proto_in(&["tcp"]),
            tcp_syn(Operator::NEQ),
            is(ct("direction"), Operator::EQ, str_expr("original")),
            ct_mark_set(c.route_mark),
        ]
    };
    after_dnat_rules(&mut b, c);
    refusal_rules(&mut b, c);
    for fam in [V4, V6] {
        let mut expr = later();
        expr.insert(0, is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)));
        expr.push(is(
            Expression::BinaryOperation(Box::new(BinaryOperation::AND(
                ct("status"),
                str_expr("dnat"),
            ))),
            Operator::EQ,
            Expression::Number(0),
        ));
        expr.extend(tproxy(fam));
        b.rule(CHAIN, "tierproxy: no socket yet (SYN cookie)", expr);
    }
    // Rule 3, untracked: TCP between two local pods past its SYN (rule 0 untracks it) that
    // no socket took in rule 2: a SYN cookie's ACK, or a segment of no connection the proxy
    // holds (a stray one, one of a connection older than the ruleset). To the listener,
    // which completes the cookie and resets or discards the rest; counted with the stray
    // drops. Without a listener, dropped (fail-closed) or passed (fail-open), as rule 6.
    untracked_local_pods_to_listener(&mut b, c, Operator::NEQ, COMMENT_LOCAL_PODS_NO_SOCKET);
    // Rule 3a: a later packet of an established TCP connection that rules 2 and 3 did not
    // take: nothing below acts on it (the stray-TCP drop takes only new or invalid TCP past
    // a SYN), so it returns before rule 6's set lookups.
    b.rule(
        CHAIN,
        COMMENT_ESTABLISHED_TCP,
        vec![
            l4proto_in(&["tcp"]),
            tcp_syn(Operator::NEQ),
            ct_state_in(&["established", "related", "untracked"]),
            Statement::Return(None),
        ],
    );
    // Rule 4: traffic the node sends itself over loopback (chain S dropped every other
    // packet with a node address as its source).
    let from_node = |fam: Fam| {
        vec![
            is(meta(MetaKey::Iifname), Operator::EQ, str_expr("lo")),
            in_set(fam, "saddr", fam.nodes),
            Statement::Return(None),
        ]
    };
    for fam in [V4, V6] {
        b.rule(CHAIN, "tierproxy: from the node itself", from_node(fam));
    }
    // Rule 5: UDP to the node's own addresses is forwarded by the kernel after its first
    // packet's decision (the proxy cannot take a hostNetwork server's address and port).
    // Its connection marked on its first datagram, before any DNAT: see the iptables
    // backend (a node port's answers, from a local pod, are not intercepted either).
    for fam in [V4, V6] {
        b.rule(
            CHAIN,
            super::COMMENT_UDP_TO_NODE,
            vec![
                l4proto_in(&["udp"]),
                in_set(fam, "daddr", fam.nodes),
                is(ct_state(), Operator::IN, str_expr("new")),
                set_ct_mark(c.route_mark),
            ],
        );
    }
    let udp_to_node = || {
        vec![
            l4proto_in(&["udp"]),
            ct_mark_set(c.route_mark),
            is(ct_state(), Operator::NEQ, str_expr("new")),
            Statement::Return(None),
        ]
    };
    b.rule(CHAIN, "tierproxy: UDP to the node itself, decided", udp_to_node());
    // Rules 6 and 7: packets of pod flows not owned by a proxy socket, egress then ingress:
    // TCP SYNs (their connection marked for rule 3) and UDP not to the node's own addresses
    // → the proxy's listener; then a drop for those nft's tproxy found no listener for (xt
    // TPROXY drops them itself). The decision follows after the DNAT, in `decide`.
    let intercepted = |fam: Fam, field: &'static str, proto: &'static str| {
        let mut expr = vec![
            is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
            in_set(fam, field, fam.pods),
            l4proto_in(&[proto]),
        ];
        match super::queue_when(proto, c.udp_path) {
            QueueWhen::Syn => expr.push(tcp_syn(Operator::EQ)),
            _ => expr.push(is(
                payload(fam.proto, "daddr"),
                Operator::NEQ,
                str_expr(format!("@{}", fam.nodes)),
            )),
        }
        expr
    };
    const DIRECTIONS: [(&str, &str); 2] = [
        ("saddr", "tierproxy: flow from a local pod, to the proxy"),
        ("daddr", "tierproxy: flow to a local pod, to the proxy"),
    ];
    // First, TCP that no decision allowed: not a SYN, new or invalid to conntrack.
    for fam in [V4, V6] {
        for (field, _) in DIRECTIONS {
            b.rule(
                CHAIN,
                COMMENT_STRAY_TCP,
                vec![
                    in_set(fam, field, fam.pods),
                    l4proto_in(&["tcp"]),
                    tcp_syn(Operator::NEQ),
                    ct_state_in(&["invalid", "new"]),
                    counter(),
                    Statement::Drop(None),
                ],
            );
        }
    }
    // TCP from a pod whose own node's agent proxied and decided the connection: decided on
    // its SYN in `decide` (the kernel-forwarded flows' queue), then forwarded by the
    // kernel, not proxied a second time.
    for fam in [V4, V6] {
        b.rule(
            CHAIN,
            COMMENT_ENFORCED,
            vec![
                in_set(fam, "daddr", fam.pods),
                in_set(fam, "saddr", fam.enforced),
                l4proto_in(&["tcp"]),
                Statement::Return(None),
            ],
        );
    }
    // The SYN of TCP between two local pods (untracked, rule 0) → the second listener,
    // whose sockets carry the bypass mark (`local_pods_port`); no connection mark (there
    // is no entry). nft's tproxy goes on without a listener: the drop after it.
    untracked_local_pods_to_listener(&mut b, c, Operator::EQ, COMMENT_LOCAL_PODS_SYN);
    for fam in [V4, V6] {
        for (field, comment) in DIRECTIONS {
            for &proto in tproxy_protocols(c.udp_path) {
                let mut expr = intercepted(fam, field, proto);
                if super::queue_when(proto, c.udp_path) == QueueWhen::Syn {
                    expr.push(set_ct_mark(c.route_mark));
                }
                expr.extend(tproxy(fam));
                b.rule(CHAIN, comment, expr);
            }
        }
    }
    // Fail-open keeps what no listener takes: with the agent gone, pod flows pass unchecked.
    for fam in [V4, V6].into_iter().filter(|_| !c.queue_bypass) {
        for (field, _) in DIRECTIONS {
            for &proto in tproxy_protocols(c.udp_path) {
                let mut expr = intercepted(fam, field, proto);
                expr.push(Statement::Drop(None));
                b.rule(CHAIN, "tierproxy: no proxy listener", expr);
            }
        }
    }

    // INPUT and FORWARD, rule 7: the decision, on the header after the DNAT of a ClusterIP
    // (nat prerouting, priority dstnat -100, after this table's -150).
    for chain in [INPUT_CHAIN, FORWARD_CHAIN] {
        b.rule(
            chain,
            "tierproxy: decide after DNAT",
            vec![Statement::Jump(JumpTarget { target: DECIDE_CHAIN.into() })],
        );
    }
    b.rule(
        DECIDE_CHAIN,
        "tierproxy: proxy upstream sockets (bypass mark)",
        vec![mark_set(c.bypass_mark), Statement::Return(None)],
    );
    // First: every later datagram of every UDP flow takes this chain.
    if c.udp_path == UdpPath::Kernel {
        // A datagram of a UDP flow whose conntrack entry exists (its first datagram was
        // allowed): forwarded by the kernel (see `QueueWhen::Unconfirmed`).
        b.rule(
            DECIDE_CHAIN,
            "tierproxy: UDP flow, decided",
            vec![
                l4proto_in(&["udp"]),
                is(ct_status(), Operator::IN, str_expr("confirmed")),
                Statement::Return(None),
            ],
        );
    }
    // Every TCP rule below is for SYNs: a TCP packet past its connection's SYN returns.
    b.rule(
        DECIDE_CHAIN,
        COMMENT_TCP_PAST_SYN,
        vec![l4proto_in(&["tcp"]), tcp_syn(Operator::NEQ), Statement::Return(None)],
    );
    // An allowed SYN, repeated with the decided mark: its class (client, port, server)
    // enters the kernel-side cache, so the class's next SYNs skip the queue (rule 7).
    for fam in [V4, V6] {
        b.rule(
            DECIDE_CHAIN,
            "tierproxy: allowed class, cached",
            vec![
                is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
                l4proto_in(&["tcp"]),
                tcp_syn(Operator::EQ),
                mark_set(c.decided_mark),
                cache_class(fam),
            ],
        );
    }
    if c.udp_path == UdpPath::Kernel {
        // The same for a UDP flow's first datagram, unless the queue answered "allowed,
        // not cached" (the decided and reject bits together, `proxy::queue`).
        for fam in [V4, V6] {
            b.rule(
                DECIDE_CHAIN,
                "tierproxy: allowed class, cached",
                vec![
                    is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
                    l4proto_in(&["udp"]),
                    mark_set(c.cacheable_mark()),
                    cache_class(fam),
                ],
            );
        }
        // The agent decided this flow at the queue: its entry's new event would tell it
        // nothing (only the destroy event is read for it).
        b.rule(
            DECIDE_CHAIN,
            COMMENT_DECIDED_SPARED,
            vec![l4proto_in(&["udp"]), mark_set(c.decided_mark), ct_events_destroy_only()],
        );
    }
    b.rule(
        DECIDE_CHAIN,
        "tierproxy: decided",
        vec![mark_set(c.decided_mark), Statement::Return(None)],
    );
    for fam in [V4, V6] {
        b.rule(DECIDE_CHAIN, "tierproxy: from the node itself", from_node(fam));
    }
    b.rule(DECIDE_CHAIN, "tierproxy: UDP to the node itself, decided", udp_to_node());

    // A SYN of a class the snapshot in force allowed (the cache is emptied at each new
    // snapshot): no queue trip. The proxy decides and audits it when it accepts it; a
    // kernel-forwarded one (from an enforced pod) was decided at its client's node.
    for fam in [V4, V6] {
        b.rule(
            DECIDE_CHAIN,
            "tierproxy: allowed class, cached",
            vec![
                is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
                l4proto_in(&["tcp"]),
                tcp_syn(Operator::EQ),
                class_cached(fam),
                Statement::Return(None),
            ],
        );
    }
    // A UDP flow of a cached class: no queue trip either. Its conntrack entry gets the
    // decided mark's bits as its connection mark, by which the agent, reading conntrack's
    // new events, decides, audits and tracks the flow (`proxy::forwarded::watch`): every
    // such flow ([`RulesetSpec::cached_udp_sample`] 1), none (0: the entry reports only its
    // destroy event), or one in n (the others' new events spared in chain `cached_udp`).
    if c.udp_path == UdpPath::Kernel {
        let n = spec.cached_udp_sample();
        if n >= 2 {
            b.batch.add(NfListObject::Chain(b.regular_chain(CACHED_UDP_CHAIN)));
            b.rule(
                CACHED_UDP_CHAIN,
                COMMENT_CACHED_SPARED,
                vec![numgen_not_first_of(n), ct_events_destroy_only()],
            );
        }
        for fam in [V4, V6] {
            let mut expr = vec![
                is(meta(MetaKey::Nfproto), Operator::EQ, str_expr(fam.nfproto)),
                l4proto_in(&["udp"]),
                class_cached(fam),
                set_ct_mark(c.decided_mark),
            ];
            match n {
                1 => expr.push(Statement::Return(None)),
                0 => expr.extend([ct_events_destroy_only(), Statement::Return(None)]),
                // Falling off the end of a chain entered by `goto` returns from the chain
                // that went there, as `return` here would.
                _ => expr.push(Statement::Goto(JumpTarget { target: CACHED_UDP_CHAIN.into() })),
            }
            b.rule(DECIDE_CHAIN, "tierproxy: allowed class, cached", expr);
        }
    }
    // Packets of pod flows, egress then ingress → queue (TCP SYNs, SCTP when new, every UDP
    // datagram: [`QueueWhen`]).
    for fam in [V4, V6] {
        for (field, comment) in [
            ("saddr", "tierproxy: flow from a local pod"),
            ("daddr", "tierproxy: flow to a local pod"),
        ] {
            for proto in QUEUED_PROTOCOLS {
                let mut expr = vec![l4proto_in(&[proto])];
                let target = match super::queue_when(proto, c.udp_path) {
                    QueueWhen::Syn => {
                        // A SYN without the route mark was not tproxied: one rule 6 lets
                        // the kernel forward (from an enforced pod). Its own queue: the
                        // balanced ones may fail open, and what they let through
                        // undecided must reach the proxy.
                        b.rule(
                            DECIDE_CHAIN,
                            comment,
                            vec![
                                l4proto_in(&[proto]),
                                tcp_syn(Operator::EQ),
                                is(
                                    Expression::BinaryOperation(Box::new(BinaryOperation::AND(
                                        meta(MetaKey::Mark),
                                        Expression::Number(c.route_mark.mask),
                                    ))),
                                    Operator::NEQ,
                                    Expression::Number(c.route_mark.value),
                                ),
                                in_set(fam, field, fam.pods),
                                forwarded_queue(c),
                            ],
                        );
                        expr.push(tcp_syn(Operator::EQ));
                        queue(c)
                    }
                    QueueWhen::Always => {
                        // UDP to the node is forwarded by the kernel once decided: its own
                        // queue, which never fails open when full. After the DNAT: a node
                        // port's flow by its connection mark (rule 5).
                        b.rule(
                            DECIDE_CHAIN,
                            comment,
                            vec![
                                l4proto_in(&[proto]),
                                ct_mark_set(c.route_mark),
                                in_set(fam, field, fam.pods),
                                forwarded_queue(c),
                            ],
                        );
                        queue(c)
                    }
                    // The chain returned confirmed UDP already.
                    // Balanced like TCP, unless the balanced queues fail open: what
                    // they let through undecided the kernel would forward.
                    QueueWhen::Unconfirmed if c.queue_bypass => forwarded_queue(c),
                    QueueWhen::Unconfirmed => queue(c),
                    QueueWhen::New => {
                        expr.push(is(ct_state(), Operator::IN, str_expr("new")));
                        forwarded_queue(c)
                    }
                };
                expr.extend([in_set(fam, field, fam.pods), target]);
                b.rule(DECIDE_CHAIN, comment, expr);
            }
        }
    }
    b.batch.to_nftables()
}

/// The transaction that removes the table if it exists.
fn remove_batch(names: &Names) -> Nftables<'static> {
    remove_table_batch(&names.table)
}

/// The transaction that adds `add` to and removes `remove` from the pod sets. Addresses to
/// remove are first added, so that deleting an absent one cannot fail the transaction.
pub(crate) fn update_batch(table: &str, add: &[IpAddr], remove: &[IpAddr]) -> Nftables<'static> {
    let mut b = Builder { table: table.to_owned(), batch: Batch::new() };
    let (add4, add6) = by_family(add);
    let (rm4, rm6) = by_family(remove);
    for (set, rm, add) in [(PODS_V4, rm4, add4), (PODS_V6, rm6, add6)] {
        if !rm.is_empty() {
            b.batch.add(b.elements(set, &rm));
            b.batch.delete(b.elements(set, &rm));
        }
        if !add.is_empty() {
            b.batch.add(b.elements(set, &add));
        }
    }
    b.batch.to_nftables()
}

/// The transaction that makes the enforced pod sets hold exactly `addrs`: flush, then add,
/// in one commit (a packet never sees a half-filled set).
pub(crate) fn enforced_batch(table: &str, addrs: &BTreeSet<IpAddr>) -> Nftables<'static> {
    let mut b = Builder { table: table.to_owned(), batch: Batch::new() };
    let (v4, v6) = by_family(addrs);
    for (name, ty, members) in
        [(ENFORCED_V4, SetType::Ipv4Addr, v4), (ENFORCED_V6, SetType::Ipv6Addr, v6)]
    {
        let set = b.ip_set(name, ty, &BTreeSet::new());
        b.batch.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set))));
        if !members.is_empty() {
            b.batch.add(b.elements(name, &members));
        }
    }
    b.batch.to_nftables()
}

/// The transaction that empties the kernel-side caches of allowed classes.
fn flush_allowed_batch(names: &Names) -> Nftables<'static> {
    let mut b = Builder { table: names.table.clone(), batch: Batch::new() };
    for fam in [V4, V6] {
        let set = b.allowed_set(fam);
        b.batch.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set))));
    }
    b.batch.to_nftables()
}

/// The transaction that makes the `podif` set hold exactly `interfaces`: flush, then add.
pub(crate) fn podif_batch(table: &str, interfaces: &BTreeSet<String>) -> Nftables<'static> {
    let mut b = Builder { table: table.to_owned(), batch: Batch::new() };
    let set = b.ifname_set(&BTreeSet::new());
    b.batch.add_cmd(NfCmd::Flush(FlushObject::Set(Box::new(set))));
    if !interfaces.is_empty() {
        b.batch.add(NfListObject::Element(Element {
            family: NfFamily::INet,
            table: table.to_owned().into(),
            name: PODIF.into(),
            elem: interfaces.iter().map(|i| str_expr(i.clone())).collect::<Vec<_>>().into(),
        }));
    }
    b.batch.to_nftables()
}

/// The counted drop rules' packets in table `inet <table>`, read with `<nft> -j list
/// table` ([`parse_counts`]).
///
/// # Errors
/// The failing `nft` command (no such table, no nf_tables), or output that is not JSON.
pub(crate) fn table_drop_counts(nft: &str, table: &str) -> Result<DropCounts, RedirectError> {
    let cmd = Cmd::new(nft, ["-j", "list", "table", "inet", table]);
    let out = cmd.run(None)?;
    let listing = serde_json::from_str(&out).map_err(|e| RedirectError::Output {
        command: cmd.line(),
        detail: format!("invalid JSON: {e}"),
    })?;
    Ok(parse_counts(&listing))
}

/// The packet counters of the counted drop rules in `listing` (`nft -j list table`):
/// each rule's `counter` statement, found by the rule's comment.
fn parse_counts(listing: &serde_json::Value) -> DropCounts {
    let mut counts = DropCounts::default();
    let items = listing["nftables"].as_array().map(Vec::as_slice).unwrap_or_default();
    for rule in items.iter().filter_map(|i| i.get("rule")) {
        let field = match rule["comment"].as_str() {
            Some(COMMENT_NODE_SOURCE) => &mut counts.node_source,
            Some(COMMENT_POD_SOURCE) => &mut counts.pod_source,
            Some(COMMENT_STRAY_TCP | COMMENT_LOCAL_PODS_NO_SOCKET) => &mut counts.stray_tcp,
            _ => continue,
        };
        let exprs = rule["expr"].as_array().map(Vec::as_slice).unwrap_or_default();
        *field += exprs.iter().filter_map(|e| e["counter"]["packets"].as_u64()).sum::<u64>();
    }
    counts
}

/// Sorts every `flags` list in `v`: the crate keeps flags in a `HashSet`, whose order
/// changes from run to run, and a rendering must be the same for the same spec (nft reads
/// flags in any order).
fn sort_flags(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                if let (true, Some(list)) = (k == "flags", item.as_array_mut()) {
                    list.sort_by(|a, b| a.as_str().cmp(&b.as_str()));
                }
                sort_flags(item);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(sort_flags),
        _ => {}
    }
}

/// Writes each `notrack` statement of `v`'s rules as the object nft reads,
/// `{"notrack": null}` (libnftables-json(5), "NOTRACK"): the crate serializes its unit
/// variant `Statement::Notrack` as the bare string `"notrack"`, which `nft -j` refuses
/// ("Unexpected expr array element of type string, expected object").
fn notrack_objects(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, item) in map.iter_mut() {
                if let (true, Some(list)) = (k == "expr", item.as_array_mut()) {
                    for e in list.iter_mut().filter(|e| e.as_str() == Some("notrack")) {
                        *e = serde_json::json!({ "notrack": null });
                    }
                }
                notrack_objects(item);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(notrack_objects),
        _ => {}
    }
}

fn to_json(n: &Nftables<'_>, pretty: bool) -> String {
    let mut value = match serde_json::to_value(n) {
        Ok(v) => v,
        Err(e) => return format!("{{\"error\": \"{e}\"}}"),
    };
    sort_flags(&mut value);
    notrack_objects(&mut value);
    let r =
        if pretty { serde_json::to_string_pretty(&value) } else { serde_json::to_string(&value) };
    // The schema types serialize plain data only (strings, numbers, sequences, maps with
    // string keys), which serde_json cannot fail on.
    r.unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

/// Asks the kernel whether it supports what this backend needs, without changing anything:
/// `nft -c` (check) sends a transaction with a throwaway table holding a `queue`, a `tproxy`
/// and a `socket transparent` rule, and the kernel aborts it after validation.
///
/// # Errors
/// The failing `nft` command with its standard error (on the development machines:
/// "Could not process rule: No such file or directory" at `queue`).
pub fn check_kernel_support(nft: &str) -> Result<(), RedirectError> {
    let mut b = Builder { table: "tierproxy-probe".into(), batch: Batch::new() };
    b.batch.add(NfListObject::Table(b.table()));
    b.batch.add(NfListObject::Chain(b.prerouting()));
    let probe = RedirectConfig::default();
    b.rule(CHAIN, "probe: queue", vec![l4proto_in(&["tcp"]), queue(&probe)]);
    b.rule(
        CHAIN,
        "probe: tproxy",
        vec![
            is(meta(MetaKey::Nfproto), Operator::EQ, str_expr("ipv4")),
            l4proto_in(&["tcp"]),
            Statement::TProxy(TProxy {
                family: Some("ip".into()),
                port: probe.tproxy_port,
                addr: Some("127.0.0.1".into()),
            }),
        ],
    );
    b.rule(
        CHAIN,
        "probe: socket",
        vec![socket(SocketAttr::Transparent, 1), Statement::Accept(None)],
    );
    refusal_rules(&mut b, &probe);
    Cmd::new(nft, ["-c", "-j", "-f", "-"]).run(Some(&to_json(&b.batch.to_nftables(), false)))?;
    Ok(())
}

impl NftablesBackend {
    /// The backend running `nft` and `ip` from `PATH`.
    pub fn new() -> Self {
        NftablesBackend::default()
    }

    /// The JSON transaction [`Backend::apply`] feeds to `nft -j -f -`, pretty-printed: add,
    /// delete and re-create table `inet <prefix>` with its sets, chain and rules.
    pub fn ruleset_json(&self, spec: &RulesetSpec) -> String {
        to_json(&apply_batch(spec), true)
    }

    fn nft_cmd(&self) -> Cmd {
        Cmd::new(&self.nft, ["-j", "-f", "-"])
    }
}

impl Backend for NftablesBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Nftables
    }

    fn refuses(&self) -> bool {
        true
    }

    fn render(&self, spec: &RulesetSpec) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "### {}", self.nft_cmd().line());
        o.push_str(&self.ruleset_json(spec));
        o.push('\n');
        for line in routing::render(spec.config(), &self.ip) {
            let _ = writeln!(o, "### {line}");
        }
        o
    }

    fn apply(&self, spec: &RulesetSpec) -> Result<(), RedirectError> {
        // Routing first: once the table exists, TPROXY'd packets need the route.
        routing::install(spec.config(), &self.ip)?;
        self.nft_cmd().run(Some(&to_json(&apply_batch(spec), false)))?;
        Ok(())
    }

    fn update_pods(
        &self,
        config: &RedirectConfig,
        add: &[IpAddr],
        remove: &[IpAddr],
    ) -> Result<(), RedirectError> {
        config.validate()?;
        if add.is_empty() && remove.is_empty() {
            return Ok(());
        }
        let batch = update_batch(&Names::new(config).table, add, remove);
        self.nft_cmd().run(Some(&to_json(&batch, false)))?;
        Ok(())
    }

    fn set_pod_interfaces(
        &self,
        config: &RedirectConfig,
        interfaces: &BTreeSet<String>,
    ) -> Result<(), RedirectError> {
        config.validate()?;
        let valid = super::valid_ifnames(interfaces.iter().cloned());
        let batch = podif_batch(&Names::new(config).table, &valid);
        self.nft_cmd().run(Some(&to_json(&batch, false)))?;
        Ok(())
    }

    fn set_enforced_pods(
        &self,
        config: &RedirectConfig,
        addrs: &BTreeSet<IpAddr>,
    ) -> Result<(), RedirectError> {
        config.validate()?;
        let batch = enforced_batch(&Names::new(config).table, addrs);
        self.nft_cmd().run(Some(&to_json(&batch, false)))?;
        Ok(())
    }

    fn flush_allowed(&self, config: &RedirectConfig) -> Result<(), RedirectError> {
        config.validate()?;
        let batch = flush_allowed_batch(&Names::new(config));
        self.nft_cmd().run(Some(&to_json(&batch, false)))?;
        Ok(())
    }

    fn pod_interfaces(&self, addrs: &[IpAddr]) -> Result<BTreeSet<String>, RedirectError> {
        routing::pod_interfaces(&self.ip, addrs)
    }

    fn drop_counts(&self, config: &RedirectConfig) -> Result<DropCounts, RedirectError> {
        config.validate()?;
        table_drop_counts(&self.nft, &Names::new(config).table)
    }

    fn remove(&self, config: &RedirectConfig) -> Result<(), RedirectError> {
        config.validate()?;
        self.nft_cmd().run(Some(&to_json(&remove_batch(&Names::new(config)), false)))?;
        routing::uninstall(config, &self.ip)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn json_of(n: &Nftables<'_>) -> Value {
        serde_json::from_str(&to_json(n, false)).unwrap()
    }

    /// The rules `n` adds, as (chain, comment, expressions as JSON text).
    fn rules_of(n: &Nftables<'_>) -> Vec<(String, String, String)> {
        let v = json_of(n);
        v["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|o| {
                let r = o.get("add")?.get("rule")?;
                let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                Some((s("chain"), s("comment"), r["expr"].to_string()))
            })
            .collect()
    }

    /// Issue #20, rule 7's spared new events: every new UDP entry the agent decided at the
    /// queue reports only its destroy event; of the cached flows, all report their new
    /// event with sample 1, none with 0, one in n otherwise (through chain `cached_udp`,
    /// which the cached rule goes to, so the class is looked up once); an "allowed, not
    /// cached" answer (decided and reject bits) adds nothing to the cache, and the refusal
    /// chains refuse the reject bit only without the decided one. The iptables backend's
    /// table has the same in its base chains after the decision.
    #[test]
    fn new_events_are_spared_for_queued_flows_and_all_but_the_sample_of_cached_ones() {
        let spec = |n| {
            RulesetSpec::new(RedirectConfig::default(), [], []).unwrap().with_cached_udp_sample(n)
        };
        let destroy = r#"{"mangle":{"key":{"ct":{"key":"event"}},"value":"destroy"}}"#;
        let cached_udp = |rules: &[(String, String, String)]| -> Vec<String> {
            rules
                .iter()
                .filter(|(ch, c, e)| {
                    ch == DECIDE_CHAIN
                        && c == "tierproxy: allowed class, cached"
                        && e.contains("\"udp\"")
                })
                .map(|(_, _, e)| e.clone())
                .collect()
        };
        for n in [0, 1, 4] {
            let rules = rules_of(&apply_batch(&spec(n)));
            let spared: Vec<_> =
                rules.iter().filter(|(_, c, _)| c == COMMENT_DECIDED_SPARED).collect();
            assert_eq!(spared.len(), 1, "{n}: {rules:?}");
            assert!(spared[0].2.contains(destroy), "{spared:?}");
            // Cache adds (the set update) and lookups (the ct mark) of UDP.
            let (adds, lookups): (Vec<String>, Vec<String>) =
                cached_udp(&rules).into_iter().partition(|e| e.contains("\"set\""));
            assert_eq!((adds.len(), lookups.len()), (2, 2), "{n}: {rules:?}");
            for add in &adds {
                // meta mark & (decided | reject) == decided
                assert!(add.contains(r#"{"&":[{"meta":{"key":"mark"}},4160]}"#), "{add}");
                assert!(add.contains(r#""right":4096"#), "{add}");
            }
            let sample_chain: Vec<_> =
                rules.iter().filter(|(ch, _, _)| ch == CACHED_UDP_CHAIN).collect();
            for l in &lookups {
                match n {
                    1 => assert!(l.contains(r#"{"return":null}"#) && !l.contains(destroy), "{l}"),
                    0 => assert!(l.contains(destroy) && l.contains(r#"{"return":null}"#), "{l}"),
                    _ => assert!(l.contains(r#"{"goto":{"target":"cached_udp"}}"#), "{l}"),
                }
            }
            if n >= 2 {
                assert_eq!(sample_chain.len(), 1, "{rules:?}");
                let e = &sample_chain[0].2;
                assert!(e.contains(r#""mod":4"#) && e.contains(r#""op":"!=""#), "{e}");
                assert!(e.contains(destroy), "{e}");
            } else {
                assert!(sample_chain.is_empty(), "{n}: {sample_chain:?}");
            }
            // Refused: the reject bit without the decided one.
            let refused: Vec<_> =
                rules.iter().filter(|(_, c, _)| c == "tierproxy: rejected").collect();
            assert_eq!(refused.len(), 2);
            for (_, _, e) in refused {
                assert!(e.contains(r#"{"&":[{"meta":{"key":"mark"}},4160]}"#), "{e}");
                assert!(e.contains(r#""right":64"#), "{e}");
            }

            // The iptables backend's table after the decision: per base chain, the queued
            // flows' rule, and the cached flows' unless every one reports.
            let aux = rules_of(&after_dnat_batch(&spec(n)));
            for chain in [REFUSE_INPUT_CHAIN, REFUSE_FORWARD_CHAIN] {
                let here: Vec<_> = aux.iter().filter(|(ch, _, _)| ch == chain).collect();
                let comments: Vec<&str> = here.iter().map(|(_, c, _)| c.as_str()).collect();
                let mut want = vec!["tierproxy: rejected", COMMENT_DECIDED_SPARED];
                if n != 1 {
                    want.push(COMMENT_CACHED_SPARED);
                }
                assert_eq!(comments, want, "{n}");
                for (_, _, e) in &here[1..] {
                    assert!(e.contains(destroy) && e.contains(r#""right":"udp""#), "{e}");
                }
                if n == 4 {
                    assert!(here[2].2.contains(r#""mod":4"#), "{}", here[2].2);
                }
            }
        }
        // The proxy path: no event is read, none is spared.
        let proxy = RedirectConfig { udp_path: UdpPath::Proxy, ..RedirectConfig::default() };
        let spec = RulesetSpec::new(proxy, [], []).unwrap().with_cached_udp_sample(4);
        let rules = rules_of(&after_dnat_batch(&spec));
        assert!(rules.iter().all(|(_, c, _)| !c.contains("spared")), "{rules:?}");
    }

    #[test]
    fn update_adds_before_deleting_removed_addresses() {
        let names = Names::new(&RedirectConfig::default());
        let add: Vec<IpAddr> = vec!["10.0.0.1".parse().unwrap()];
        let rm: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap(), "fd00::2".parse().unwrap()];
        let v = json_of(&update_batch(&names.table, &add, &rm));
        let elem = |set: &str, addr: &str| json!({"element": {"family": "inet", "table": "tierproxy", "name": set, "elem": [addr]}});
        assert_eq!(
            v["nftables"],
            json!([
                {"add": elem("pods-v4", "10.0.0.2")},
                {"delete": elem("pods-v4", "10.0.0.2")},
                {"add": elem("pods-v4", "10.0.0.1")},
                {"add": elem("pods-v6", "fd00::2")},
                {"delete": elem("pods-v6", "fd00::2")},
            ])
        );
    }

    #[test]
    fn drop_counters_are_read_by_comment() {
        let listing = json!({"nftables": [
            {"metainfo": {"version": "1.0.6"}},
            {"rule": {"chain": "source", "comment": COMMENT_NODE_SOURCE,
                      "expr": [{"match": {}}, {"counter": {"packets": 4, "bytes": 240}}, {"drop": null}]}},
            {"rule": {"chain": "source", "comment": COMMENT_NODE_SOURCE,
                      "expr": [{"counter": {"packets": 1, "bytes": 60}}]}},
            {"rule": {"chain": "prerouting", "comment": COMMENT_STRAY_TCP,
                      "expr": [{"counter": {"packets": 2, "bytes": 80}}]}},
            {"rule": {"chain": "prerouting", "comment": "other",
                      "expr": [{"counter": {"packets": 9, "bytes": 9}}]}},
        ]});
        assert_eq!(
            parse_counts(&listing),
            DropCounts { node_source: 5, pod_source: 0, stray_tcp: 2 }
        );
    }

    #[test]
    fn pod_interface_updates_flush_then_add() {
        let names = Names::new(&RedirectConfig::default());
        let v = json_of(&podif_batch(&names.table, &BTreeSet::from(["pod0".to_string()])));
        assert_eq!(v["nftables"][0]["flush"]["set"]["name"], "podif");
        assert_eq!(v["nftables"][1]["add"]["element"]["elem"], json!(["pod0"]));
        let v = json_of(&podif_batch(&names.table, &BTreeSet::new()));
        assert_eq!(v["nftables"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn remove_is_add_then_delete_table() {
        let v = json_of(&remove_batch(&Names::new(&RedirectConfig::default())));
        let t = json!({"table": {"family": "inet", "name": "tierproxy"}});
        assert_eq!(v["nftables"], json!([{"add": t}, {"delete": t}]));
    }

    #[test]
    fn queue_statement_shapes() {
        let mut c = RedirectConfig::default();
        let q = |c: &RedirectConfig| serde_json::to_value(queue(c)).unwrap();
        assert_eq!(q(&c), json!({"queue": {"num": {"range": [0, 1]}}}));
        c.queue_bypass = true;
        c.queue_count = 1;
        c.queue_first = 3;
        assert_eq!(q(&c), json!({"queue": {"num": 3, "flags": ["bypass"]}}));
    }
}
