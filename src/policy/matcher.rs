//! Constant-time "first matching rule" for one policy and direction.
//!
//! A rule matches a flow when one of its peers matches the peer endpoint and one of its
//! port entries matches the destination port. Walking rules × peers per packet costs up to
//! 100 × 100 selector lookups per policy (the CRD limits); instead, each rule becomes one
//! bit of a [`RuleMask`], and the matcher precomputes, for every way a peer or a port can
//! be seen, the set of rules it satisfies:
//!
//! - pods → interned mask classes (dense table when the policy reaches many pods, sorted
//!   pairs otherwise);
//! - nodes → sorted pairs;
//! - IPv4 / IPv6 addresses → disjoint intervals (a sweep over every `networks` / `ipBlock`
//!   range, `except` ranges carved out), looked up by binary search;
//! - ports → disjoint intervals per protocol; named ports → a mask per name, resolved on
//!   the destination pod at decision time.
//!
//! The first matching rule is then `(peer_mask & port_mask).trailing_zeros()`.
//! Policies with more than [`MAX_RULES`] rules in a direction keep the linear evaluation in
//! `eval.rs` (NetworkPolicy has no rule limit; ANP has 100, CNP 25).

use std::net::IpAddr;

use super::cidr::Block;
use super::compile::{Endpoint, Rule};
use super::ports::{NamedPort, PortSpec, Protocol};

/// One bit per rule of a policy direction, rule `i` = bit `i`.
pub(crate) type RuleMask = u128;

/// Most rules per policy direction a [`Matcher`] handles.
pub(crate) const MAX_RULES: usize = RuleMask::BITS as usize;

/// Index into [`Matcher::masks`]; 0 is the empty mask.
type Class = u16;

/// Interval table: `starts[i]..starts[i+1]` has mask class `classes[i]`; positions before
/// `starts[0]` have none.
#[derive(Debug, Clone, Default)]
struct Intervals {
    starts: Vec<u128>,
    classes: Vec<Class>,
}

impl Intervals {
    #[inline]
    fn get(&self, x: u128) -> Class {
        let i = self.starts.partition_point(|&s| s <= x);
        if i == 0 { 0 } else { self.classes[i - 1] }
    }
}

#[derive(Debug, Clone)]
enum PodClasses {
    /// Indexed by pod id.
    Dense(Vec<Class>),
    /// Sorted by pod id.
    Sparse(Vec<(u32, Class)>),
}

/// The precompiled rule masks of one policy direction.
#[derive(Debug, Clone)]
pub(crate) struct Matcher {
    /// Mask table; `masks[0] == 0`.
    masks: Vec<RuleMask>,
    /// Rules that match every peer.
    all_peers: RuleMask,
    /// Rules that match every protocol and port.
    all_ports: RuleMask,
    pods: PodClasses,
    nodes: Vec<(u32, Class)>,
    v4: Intervals,
    v6: Intervals,
    /// Per protocol (TCP, UDP, SCTP), by destination port.
    ports: [Intervals; 3],
    /// Named ports: (name, protocol of the entry if any, rules).
    named: Vec<(String, Option<Protocol>, RuleMask)>,
}

fn proto_index(p: Protocol) -> usize {
    match p {
        Protocol::Tcp => 0,
        Protocol::Udp => 1,
        Protocol::Sctp => 2,
    }
}

#[derive(Default)]
struct Interner {
    masks: Vec<RuleMask>,
    ids: rustc_hash::FxHashMap<RuleMask, Class>,
}

impl Interner {
    fn new() -> Self {
        let mut i = Interner::default();
        i.intern(0);
        i
    }

    fn intern(&mut self, m: RuleMask) -> Class {
        if let Some(&c) = self.ids.get(&m) {
            return c;
        }
        let c = self.masks.len() as Class;
        self.masks.push(m);
        self.ids.insert(m, c);
        c
    }
}

/// `(start, end_inclusive, rule)`: a range of addresses or ports a rule matches.
type Range = (u128, u128, u32);

/// Builds disjoint intervals from ranges with a sweep.
fn sweep(ranges: &mut Vec<Range>, interner: &mut Interner) -> Intervals {
    // Events: (position, +1/-1, rule). A range ending at u128::MAX never closes.
    let mut events: Vec<(u128, i8, u32)> = Vec::with_capacity(ranges.len() * 2);
    for &(lo, hi, r) in ranges.iter() {
        events.push((lo, 1, r));
        if let Some(end) = hi.checked_add(1) {
            events.push((end, -1, r));
        }
    }
    ranges.clear();
    events.sort_unstable();
    let mut counts = [0u32; MAX_RULES];
    let mut mask: RuleMask = 0;
    let mut out = Intervals::default();
    let mut i = 0;
    while i < events.len() {
        let pos = events[i].0;
        while i < events.len() && events[i].0 == pos {
            let (_, delta, r) = events[i];
            let c = &mut counts[r as usize];
            if delta > 0 {
                *c += 1;
            } else {
                *c -= 1;
            }
            if *c > 0 {
                mask |= 1 << r;
            } else {
                mask &= !(1 << r);
            }
            i += 1;
        }
        let class = interner.intern(mask);
        if out.classes.last() != Some(&class) {
            out.starts.push(pos);
            out.classes.push(class);
        }
    }
    out
}

/// The address ranges of a block: `net` minus every `except`, as inclusive `u128` ranges.
fn block_ranges(b: &Block, out: &mut Vec<(u128, u128)>) {
    let range = |n: &ipnet::IpNet| -> (u128, u128) {
        match n {
            ipnet::IpNet::V4(n) => {
                (u32::from(n.network()) as u128, u32::from(n.broadcast()) as u128)
            }
            ipnet::IpNet::V6(n) => (u128::from(n.network()), u128::from(n.broadcast())),
        }
    };
    let (lo, hi) = range(&b.net);
    let mut holes: Vec<(u128, u128)> = b
        .except
        .iter()
        .filter(|e| e.addr().is_ipv4() == b.net.addr().is_ipv4())
        .map(range)
        .collect();
    holes.sort_unstable();
    let mut next = lo;
    for (hlo, hhi) in holes {
        if hhi < next || hlo > hi {
            continue;
        }
        if hlo > next {
            out.push((next, hlo - 1));
        }
        match hhi.checked_add(1) {
            Some(n) => next = next.max(n),
            None => return,
        }
        if next > hi {
            return;
        }
    }
    out.push((next, hi));
}

impl Matcher {
    /// Compiles `rules` (≤ [`MAX_RULES`]) of one policy direction. `pod_sets` are the
    /// snapshot's interned pod sets; `scratch` holds one zeroed mask per pod and is left
    /// zeroed.
    pub(crate) fn build(
        rules: &[Rule],
        pod_sets: &[roaring::RoaringBitmap],
        scratch: &mut [RuleMask],
    ) -> Matcher {
        let pod_count = scratch.len();
        debug_assert!(rules.len() <= MAX_RULES);
        let mut interner = Interner::new();
        let mut all_peers: RuleMask = 0;
        let mut all_ports: RuleMask = 0;
        let mut touched: Vec<u32> = Vec::new();
        let mut node_mask: rustc_hash::FxHashMap<u32, RuleMask> = Default::default();
        let (mut v4, mut v6): (Vec<Range>, Vec<Range>) = (Vec::new(), Vec::new());
        let mut ports: [Vec<Range>; 3] = Default::default();
        let mut named: Vec<(String, Option<Protocol>, RuleMask)> = Vec::new();
        let mut ranges = Vec::new();
        for (r, rule) in rules.iter().enumerate() {
            let bit: RuleMask = 1 << r;
            let peers = &rule.peers;
            if peers.all {
                all_peers |= bit;
            }
            for &s in &peers.pod_sets {
                for pod in &pod_sets[s as usize] {
                    let m = &mut scratch[pod as usize];
                    if *m == 0 {
                        touched.push(pod);
                    }
                    *m |= bit;
                }
            }
            for node in peers.nodes.iter().flatten() {
                *node_mask.entry(node).or_default() |= bit;
            }
            for b in &peers.blocks {
                block_ranges(b, &mut ranges);
                let target = if b.net.addr().is_ipv4() { &mut v4 } else { &mut v6 };
                target.extend(ranges.drain(..).map(|(lo, hi)| (lo, hi, r as u32)));
            }
            if rule.ports.0.is_empty() {
                all_ports |= bit;
            }
            for m in &rule.ports.0 {
                match (&m.ports, m.protocol) {
                    (PortSpec::Named(n), p) => {
                        match named.iter_mut().find(|(nn, pp, _)| nn == n && *pp == p) {
                            Some(e) => e.2 |= bit,
                            None => named.push((n.clone(), p, bit)),
                        }
                    }
                    (PortSpec::Any, Some(p)) => {
                        ports[proto_index(p)].push((0, u16::MAX as u128, r as u32))
                    }
                    (PortSpec::Range(lo, hi), Some(p)) => {
                        ports[proto_index(p)].push((*lo as u128, *hi as u128, r as u32))
                    }
                    // Numeric entries always carry a protocol (defaulted to TCP).
                    (_, None) => {}
                }
            }
        }
        let pods = if touched.len() * 8 >= pod_count {
            let mut dense = vec![0 as Class; pod_count];
            for &pod in &touched {
                dense[pod as usize] = interner.intern(std::mem::take(&mut scratch[pod as usize]));
            }
            PodClasses::Dense(dense)
        } else {
            touched.sort_unstable();
            let sparse = touched
                .iter()
                .map(|&p| (p, interner.intern(std::mem::take(&mut scratch[p as usize]))))
                .collect();
            PodClasses::Sparse(sparse)
        };
        let mut nodes: Vec<(u32, Class)> =
            node_mask.iter().map(|(n, m)| (*n, interner.intern(*m))).collect();
        nodes.sort_unstable();
        let v4 = sweep(&mut v4, &mut interner);
        let v6 = sweep(&mut v6, &mut interner);
        let ports = ports.map(|mut p| sweep(&mut p, &mut interner));
        Matcher { masks: interner.masks, all_peers, all_ports, pods, nodes, v4, v6, ports, named }
    }

    #[inline]
    fn mask(&self, c: Class) -> RuleMask {
        self.masks[c as usize]
    }

    /// The index of the first rule matching the flow, if any.
    #[inline]
    pub(crate) fn first_rule(
        &self,
        peer: Endpoint,
        ip: IpAddr,
        protocol: Protocol,
        port: u16,
        dst_ports: &[NamedPort],
    ) -> Option<u32> {
        let mut port_mask =
            self.all_ports | self.mask(self.ports[proto_index(protocol)].get(port as u128));
        if !self.named.is_empty() {
            // "named ports resolve on the destination pod's declared container ports
            // (name and protocol must match)".
            for np in dst_ports.iter().filter(|np| np.port == port && np.protocol == protocol) {
                for (name, p, m) in &self.named {
                    if *name == np.name && p.is_none_or(|p| p == protocol) {
                        port_mask |= m;
                    }
                }
            }
        }
        if port_mask == 0 {
            return None;
        }
        let mut peer_mask = self.all_peers;
        match peer {
            Endpoint::Pod(p) => {
                peer_mask |= self.mask(match &self.pods {
                    PodClasses::Dense(d) => d.get(p as usize).copied().unwrap_or(0),
                    PodClasses::Sparse(s) => {
                        s.binary_search_by_key(&p, |e| e.0).map_or(0, |i| s[i].1)
                    }
                })
            }
            Endpoint::Node(n) => {
                peer_mask |= self.mask(
                    self.nodes.binary_search_by_key(&n, |e| e.0).map_or(0, |i| self.nodes[i].1),
                )
            }
            Endpoint::External => {}
        }
        // `networks` / `ipBlock` match any address, pod and node IPs included.
        peer_mask |= match ip {
            IpAddr::V4(a) => self.mask(self.v4.get(u32::from(a) as u128)),
            IpAddr::V6(a) => self.mask(self.v6.get(u128::from(a))),
        };
        let hit = port_mask & peer_mask;
        (hit != 0).then(|| hit.trailing_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::cidr::parse;

    #[test]
    fn block_minus_excepts() {
        let b = Block {
            net: parse("10.0.0.0/24").unwrap(),
            except: vec![
                parse("10.0.0.16/28").unwrap(),
                parse("10.0.0.0/30").unwrap(),
                parse("::/0").unwrap(),
            ],
        };
        let mut out = Vec::new();
        block_ranges(&b, &mut out);
        let base = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0)) as u128;
        assert_eq!(out, vec![(base + 4, base + 15), (base + 32, base + 255)]);
    }

    #[test]
    fn whole_ipv6_space_does_not_overflow() {
        let b = Block::new(parse("::/0").unwrap());
        let mut out = Vec::new();
        block_ranges(&b, &mut out);
        assert_eq!(out, vec![(0, u128::MAX)]);
        let mut i = Interner::new();
        let mut r = vec![(0, u128::MAX, 3)];
        let iv = sweep(&mut r, &mut i);
        assert_eq!(i.masks[iv.get(u128::MAX) as usize], 1 << 3);
    }

    #[test]
    fn sweep_merges_overlaps_per_rule() {
        let mut i = Interner::new();
        let mut r = vec![(10, 20, 0), (15, 30, 0), (18, 18, 1)];
        let iv = sweep(&mut r, &mut i);
        let m = |x| i.masks[iv.get(x) as usize];
        assert_eq!(m(9), 0);
        assert_eq!(m(10), 1);
        assert_eq!(m(18), 0b11);
        assert_eq!(m(19), 1);
        assert_eq!(m(30), 1);
        assert_eq!(m(31), 0);
    }
}
