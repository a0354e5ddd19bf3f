//! Constant-time "first matching rule" for one policy and direction.
//!
//! A rule matches a flow when one of its peers matches the peer endpoint and one of its
//! port entries matches the destination port. Walking rules × peers per packet costs up to
//! 100 × 100 selector lookups per policy (the CRD limits); instead, each rule becomes one
//! bit of a [`RuleMask`], and the matcher precomputes, for every way a peer or a port can
//! be seen, the set of rules it satisfies:
//!
//! - pods → interned mask classes (a table by pod id when the policy reaches at least half
//!   the pods, a presence bitmap with ranks down to a twentieth, sorted ids below that;
//!   one-byte classes while they fit);
//! - nodes → sorted pairs;
//! - IPv4 / IPv6 addresses → disjoint intervals (a sweep over every `networks` / `ipBlock`
//!   range, `except` ranges carved out), looked up by binary search;
//! - ports → disjoint intervals per protocol, their masks inline; named ports → a mask per
//!   name, resolved on the destination pod at decision time.
//!
//! Masks are stored in 64 bits while they fit (a direction of at most 64 rules: every
//! Antrea policy and nearly every NetworkPolicy), else in 128.
//!
//! The first matching rule is then `(peer_mask & port_mask).trailing_zeros()`. Antrea
//! rules that depend on the subject fit too: a rule-level `appliedTo` is one more class
//! table, by subject pod, that masks the port mask; a rule with subject-relative peers
//! (`namespaces.match: Self`, `sameLabels`) is a bit the caller checks one by one, only
//! when it sits below the first masked hit (antrea-model.md §6–§7).
//! Policies with more than [`MAX_RULES`] rules in a direction keep the linear evaluation in
//! `eval.rs` (NetworkPolicy has no rule limit; ANP has 100, CNP 25), and so does a direction
//! whose rules split pods, addresses and ports into more distinct masks than a class id
//! numbers (65,535; [`Matcher::build`]).

use std::net::IpAddr;

use compact_str::CompactString;

use super::cidr::Block;
use super::model::{Endpoint, Rule, SetId};
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

/// Port intervals with their rule masks inline: one allocation and one search, as ports
/// are checked for every candidate policy. The interval starts come first, four 16-bit
/// ports to a word (the starts of 32 intervals fill one cache line, where the search's
/// steps no longer miss one by one), then the masks, one word each while every mask fits
/// in 64 bits (most directions have at most 64 rules), else two. Interval `i` covers ports
/// `start(i)..start(i + 1)`; ports below the first start have none.
#[derive(Debug, Clone, Default)]
struct PortMasks {
    /// Number of intervals.
    len: u32,
    /// Masks of two words each.
    wide: bool,
    /// `len` starts (u16, four per word), then `len` masks.
    data: Box<[u64]>,
}

impl PortMasks {
    /// From interval starts (ascending) and their masks. A start past the last port
    /// (65,536: the end of a range reaching 65,535) is dropped: no port lies after it.
    fn new(intervals: impl Iterator<Item = (u32, RuleMask)> + Clone) -> Self {
        let intervals = intervals.filter(|&(s, _)| s <= u16::MAX as u32);
        let len = intervals.clone().count();
        let wide = intervals.clone().any(|(_, m)| m > u64::MAX as RuleMask);
        let start_words = len.div_ceil(4);
        let mut data = vec![0u64; start_words + len * (1 + wide as usize)];
        for (i, (s, m)) in intervals.enumerate() {
            data[i / 4] |= (s as u64) << (16 * (i % 4));
            if wide {
                data[start_words + 2 * i] = m as u64;
                data[start_words + 2 * i + 1] = (m >> 64) as u64;
            } else {
                data[start_words + i] = m as u64;
            }
        }
        PortMasks { len: len as u32, wide, data: data.into_boxed_slice() }
    }

    #[inline]
    fn start(&self, i: usize) -> u16 {
        (self.data[i / 4] >> (16 * (i % 4))) as u16
    }

    #[inline]
    fn get(&self, port: u16) -> RuleMask {
        // The number of starts at or below `port`.
        let (mut lo, mut hi) = (0usize, self.len as usize);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.start(mid) <= port {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let Some(i) = lo.checked_sub(1) else { return 0 };
        let masks = (self.len as usize).div_ceil(4);
        if self.wide {
            self.data[masks + 2 * i] as RuleMask | (self.data[masks + 2 * i + 1] as RuleMask) << 64
        } else {
            self.data[masks + i] as RuleMask
        }
    }
}

/// A vector of `W` values kept as the narrower `N` while every value fits, widened to `W`
/// on demand (never narrowed again): class ids (one byte while a matcher has at most 255
/// classes, most have a few dozen) and rule masks (64 bits while a direction has at most
/// 64 rules).
#[derive(Debug, Clone)]
enum Widening<N, W> {
    Narrow(Vec<N>),
    Wide(Vec<W>),
}

/// Class ids ([`Widening`]).
type ClassVec = Widening<u8, Class>;

/// A matcher's mask table, by [`Class`] ([`Widening`]); class 0 is the empty mask.
type MaskTable = Widening<u64, RuleMask>;

impl<N, W> Widening<N, W>
where
    N: Copy + Default + PartialEq + Into<W> + TryFrom<W>,
    W: Copy + PartialEq,
{
    /// `values`, narrow if they all fit; no spare capacity either way.
    fn new(values: Vec<W>) -> Self {
        // Checked in one pass without an early exit, then converted in another: both
        // vectorize (a dense class table has a value per pod).
        if values.iter().fold(true, |fits, &v| fits & N::try_from(v).is_ok()) {
            Widening::Narrow(values.iter().map(|&v| N::try_from(v).unwrap_or_default()).collect())
        } else {
            let mut wide = values;
            wide.shrink_to_fit();
            Widening::Wide(wide)
        }
    }

    #[inline]
    fn get(&self, i: usize) -> W {
        match self {
            Widening::Narrow(v) => v[i].into(),
            Widening::Wide(v) => v[i],
        }
    }

    /// The address of entry `i` (not bounds-checked: for [`prefetch`] only).
    #[inline]
    fn addr(&self, i: usize) -> *const u8 {
        match self {
            Widening::Narrow(v) => v.as_ptr().wrapping_add(i).cast(),
            Widening::Wide(v) => v.as_ptr().wrapping_add(i).cast(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Widening::Narrow(v) => v.len(),
            Widening::Wide(v) => v.len(),
        }
    }

    /// The first index holding `x`.
    fn position(&self, x: W) -> Option<usize> {
        match self {
            Widening::Narrow(v) => N::try_from(x).ok().and_then(|n| v.iter().position(|&y| y == n)),
            Widening::Wide(v) => v.iter().position(|&y| y == x),
        }
    }

    /// `x` as stored, the table widened first if it does not fit.
    fn widen_for(&mut self, x: W) -> Result<N, W> {
        if let Widening::Narrow(v) = self {
            match N::try_from(x) {
                Ok(n) => return Ok(n),
                Err(_) => *self = Widening::Wide(v.iter().map(|&n| n.into()).collect()),
            }
        }
        Err(x)
    }

    fn set(&mut self, i: usize, x: W) {
        match (self.widen_for(x), self) {
            (Ok(n), Widening::Narrow(v)) => v[i] = n,
            (_, Widening::Wide(v)) => v[i] = x,
            (Err(_), Widening::Narrow(_)) => unreachable!("widened above"),
        }
    }

    fn insert(&mut self, i: usize, x: W) {
        match (self.widen_for(x), self) {
            (Ok(n), Widening::Narrow(v)) => v.insert(i, n),
            (_, Widening::Wide(v)) => v.insert(i, x),
            (Err(_), Widening::Narrow(_)) => unreachable!("widened above"),
        }
    }

    fn push(&mut self, x: W) {
        let len = self.len();
        self.insert(len, x);
    }

    fn remove(&mut self, i: usize) {
        match self {
            Widening::Narrow(v) => {
                v.remove(i);
            }
            Widening::Wide(v) => {
                v.remove(i);
            }
        }
    }
}

/// The class of each pod a matcher knows (pod ids absent have class 0), in the smallest of
/// three layouts for how many pods that is:
/// - `Dense`: a class per pod id, when at least half the pods have one;
/// - `Ranked`: a presence bit per pod id, 64 to a block with the number of present pods
///   before it, and the classes of the present pods in id order (a block word, a popcount
///   and a class: two loads), down to a twentieth of the pods;
/// - `Sparse`: the present pods' ids, sorted, and their classes (a binary search).
#[derive(Debug, Clone)]
enum PodClasses {
    Dense(ClassVec),
    Ranked { blocks: Vec<(u64, u32)>, classes: ClassVec },
    Sparse { pods: Vec<u32>, classes: ClassVec },
}

/// Pod addresses sorted for range scans: single-address pods by family. A pod with more
/// than one address (dual-stack) is not here: its address matches depend on which address
/// a flow uses, so they are looked up per flow.
#[derive(Debug, Clone, Default)]
pub(crate) struct PodAddrs {
    v4: Vec<(u32, u32)>,
    v6: Vec<(u128, u32)>,
}

impl PodAddrs {
    /// From each pod's addresses, by pod id.
    pub(crate) fn new(pod_ips: &[Vec<IpAddr>]) -> Self {
        let mut out = PodAddrs::default();
        for (pod, ips) in pod_ips.iter().enumerate() {
            match ips.as_slice() {
                [IpAddr::V4(a)] => out.v4.push((u32::from(*a), pod as u32)),
                [IpAddr::V6(a)] => out.v6.push((u128::from(*a), pod as u32)),
                _ => {}
            }
        }
        out.v4.sort_unstable();
        out.v6.sort_unstable();
        out
    }
}

/// Adds, for every single-address pod inside an interval, that interval's rules to the
/// pod's mask in `scratch`.
fn fold_addresses<K: Copy + Ord + Into<u128>>(
    iv: &Intervals,
    addrs: &[(K, u32)],
    masks: &[RuleMask],
    scratch: &mut Scratch,
) {
    for (i, &start) in iv.starts.iter().enumerate() {
        let m = masks[iv.classes[i] as usize];
        if m == 0 {
            continue;
        }
        let end = iv.starts.get(i + 1).copied();
        let from = addrs.partition_point(|(a, _)| (*a).into() < start);
        let inside = addrs[from..].iter().take_while(|(a, _)| end.is_none_or(|e| (*a).into() < e));
        scratch.add_pods(inside.map(|&(_, pod)| pod), m);
    }
}

/// A pod set as [`Matcher::build`] walks it: [`FlatSets`]' ids or presence words, or the
/// snapshot's own bitmap (a patch that builds one matcher).
#[derive(Debug, Clone, Copy)]
pub(crate) enum PodList<'a> {
    /// Pod ids, ascending.
    Ids(&'a [u32]),
    /// Bit `p % 64` of word `p / 64` set for pod `p`.
    Words(&'a [u64]),
    Bitmap(&'a roaring::RoaringBitmap),
}

/// What [`Matcher::build`] reads pod sets from, by [`SetId`].
pub(crate) trait PodSets: Sync {
    /// Set `id`'s pods.
    fn pods(&self, id: SetId) -> PodList<'_>;
}

impl PodSets for [std::sync::Arc<roaring::RoaringBitmap>] {
    fn pods(&self, id: SetId) -> PodList<'_> {
        PodList::Bitmap(&self[id as usize])
    }
}

/// The snapshot's pod sets copied out of their bitmaps for a full compile's matcher builds:
/// every set is walked there once per rule that names it (about twenty million pods for the
/// Antrea benchmark set, from under six thousand distinct sets), and a roaring iterator
/// costs several times the OR it feeds. A set keeps its ids (4 bytes a pod) or, when that
/// is larger, a presence bit per pod id.
#[derive(Debug)]
pub(crate) struct FlatSets {
    sets: Vec<FlatSet>,
}

#[derive(Debug)]
enum FlatSet {
    Ids(Box<[u32]>),
    Words(Box<[u64]>),
}

impl FlatSets {
    /// Copies `sets` (pod ids below `pods`).
    pub(crate) fn new(sets: &[std::sync::Arc<roaring::RoaringBitmap>], pods: usize) -> Self {
        let words = pods.div_ceil(64);
        let sets = (sets.iter())
            .map(|set| {
                if set.len() as usize * 32 > pods {
                    let mut out = vec![0u64; words];
                    set.iter().for_each(|p| out[p as usize / 64] |= 1 << (p % 64));
                    FlatSet::Words(out.into_boxed_slice())
                } else {
                    FlatSet::Ids(set.iter().collect())
                }
            })
            .collect();
        FlatSets { sets }
    }
}

impl PodSets for FlatSets {
    fn pods(&self, id: SetId) -> PodList<'_> {
        match &self.sets[id as usize] {
            FlatSet::Ids(ids) => PodList::Ids(ids),
            FlatSet::Words(words) => PodList::Words(words),
        }
    }
}

/// The per-pod working memory of [`Matcher::build`], kept between builds (one per compile
/// thread).
///
/// Each pod holds a *working class*: an id for the OR of the rule masks added to it so
/// far (0 for none). Adding a mask to a set's pods moves each pod from its class to the
/// class of that OR, and the move is computed once per class and step, not per pod: a
/// step is one array read per pod where a mask per pod would need a hash lookup per pod
/// to number at the end (the walks of the Antrea benchmark set visit twenty million pods
/// in a compile). [`classes`] then numbers only the working classes pods ended in.
///
/// Empty outside a build: every build drains what it added.
#[derive(Debug)]
pub(crate) struct Scratch {
    /// Working class by pod id.
    class: Vec<u32>,
    /// Bit `p % 64` of word `p / 64`: pod `p`'s working class is not 0.
    touched: Vec<u64>,
    /// Mask by working class; 0 is the empty mask.
    masks: Vec<RuleMask>,
    ids: rustc_hash::FxHashMap<RuleMask, u32>,
    /// By working class: the step `.0` last moved it, to class `.1`.
    moves: Vec<(u32, u32)>,
    /// The current step. Every walk starts a new one first, so the moves of step 0 (a
    /// class never moved yet) are never current.
    step: u32,
}

impl Default for Scratch {
    fn default() -> Self {
        Scratch::new(0)
    }
}

impl Scratch {
    /// Empty memory for pod ids `0..pods`.
    pub(crate) fn new(pods: usize) -> Self {
        Scratch {
            class: vec![0; pods],
            touched: vec![0; pods.div_ceil(64)],
            masks: vec![0],
            ids: [(0, 0)].into_iter().collect(),
            moves: vec![(0, 0)],
            step: 0,
        }
    }

    /// Grows or shrinks to pod ids `0..pods`, still empty.
    pub(crate) fn resize(&mut self, pods: usize) {
        self.class.resize(pods, 0);
        self.touched.resize(pods.div_ceil(64), 0);
    }

    /// The number of pod ids this covers.
    fn pods(&self) -> usize {
        self.class.len()
    }

    /// Starts a step: the moves of the last one no longer apply.
    fn next_step(&mut self) {
        self.step = self.step.wrapping_add(1);
        if self.step == 0 {
            self.moves.fill((0, 0));
            self.step = 1;
        }
    }

    /// ORs `mask` into the mask of every pod of `set`.
    fn add_set(&mut self, set: PodList<'_>, mask: RuleMask) {
        match set {
            PodList::Ids(ids) => self.add_pods(ids.iter().copied(), mask),
            PodList::Words(words) => {
                let pods = words.iter().enumerate().flat_map(|(w, &word)| {
                    let mut bits = word;
                    std::iter::from_fn(move || {
                        let bit = (bits != 0).then(|| bits.trailing_zeros())?;
                        bits &= bits - 1;
                        Some((w * 64) as u32 + bit)
                    })
                });
                self.add_pods(pods, mask)
            }
            // `for_each`: roaring's `fold` walks container by container, where `next`
            // re-checks which container it is in for every pod.
            PodList::Bitmap(b) => self.add_pods(b.iter(), mask),
        }
    }

    /// ORs `mask` into the mask of every pod of `pods`, as one step.
    fn add_pods(&mut self, pods: impl Iterator<Item = u32>, mask: RuleMask) {
        if mask == 0 {
            return;
        }
        self.next_step();
        let Scratch { class, touched, masks, ids, moves, step } = self;
        step_pods(pods, mask, *step, class, touched, &mut Moves { masks, ids, moves });
    }

    /// The number of pods whose mask is not zero.
    fn count(&self) -> usize {
        self.touched.iter().map(|w| w.count_ones() as usize).sum()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.class.iter().all(|&c| c == 0)
            && self.touched.iter().all(|&w| w == 0)
            && self.masks == [0]
            && self.ids.len() == 1
    }

    /// Calls `f` with every pod whose mask is not zero and that mask's class in `interner`
    /// (interned once per working class), in pod id order, and empties the scratch.
    fn drain(&mut self, interner: &mut Interner, f: impl FnMut(u32, Class)) {
        let mut class_of = vec![UNSET; self.masks.len()];
        let Scratch { class, touched, masks, .. } = self;
        drain_pods(touched, class, masks, &mut class_of, interner, f);
        self.masks.truncate(1);
        self.moves.truncate(1);
        self.ids.clear();
        self.ids.insert(0, 0);
    }
}

/// A working class not numbered yet ([`drain_pods`]).
const UNSET: u32 = u32::MAX;

/// The walk of [`Scratch::drain`], its tables slices of their own (as in [`step_pods`]):
/// `class_of` holds each working class's number in `interner`, [`UNSET`] until its first
/// pod.
#[inline]
fn drain_pods(
    touched: &mut [u64],
    class: &mut [u32],
    masks: &[RuleMask],
    class_of: &mut [u32],
    interner: &mut Interner,
    mut f: impl FnMut(u32, Class),
) {
    for (w, word) in touched.iter_mut().enumerate() {
        let mut bits = std::mem::take(word);
        while bits != 0 {
            let pod = w * 64 + bits.trailing_zeros() as usize;
            let c = std::mem::take(&mut class[pod]) as usize;
            if class_of[c] == UNSET {
                class_of[c] = interner.intern(masks[c]) as u32;
            }
            f(pod as u32, class_of[c] as Class);
            bits &= bits - 1;
        }
    }
}

/// A [`Scratch`]'s working classes, borrowed apart from its per-pod tables.
struct Moves<'a> {
    masks: &'a mut Vec<RuleMask>,
    ids: &'a mut rustc_hash::FxHashMap<RuleMask, u32>,
    moves: &'a mut Vec<(u32, u32)>,
}

/// The walk of [`Scratch::add_pods`]: each pod moves to the working class its class moves
/// to in step `step` (which adds `mask`). The per-pod tables are slices of their own here,
/// so the loop keeps their addresses in registers across its stores.
#[inline]
fn step_pods(
    pods: impl Iterator<Item = u32>,
    mask: RuleMask,
    step: u32,
    class: &mut [u32],
    touched: &mut [u64],
    work: &mut Moves<'_>,
) {
    pods.for_each(|pod| {
        let c = class[pod as usize];
        let (moved, to) = work.moves[c as usize];
        let to = if moved == step { to } else { first_move(work, c, mask, step) };
        class[pod as usize] = to;
        touched[pod as usize / 64] |= 1 << (pod % 64);
    });
}

/// Where working class `c` moves in step `step` (which adds `mask`): computed when the
/// step meets a pod of `c` for the first time.
#[inline(never)]
fn first_move(work: &mut Moves<'_>, c: u32, mask: RuleMask, step: u32) -> u32 {
    let m = work.masks[c as usize] | mask;
    let to = *work.ids.entry(m).or_insert_with(|| {
        work.masks.push(m);
        work.moves.push((0, 0));
        (work.masks.len() - 1) as u32
    });
    work.moves[c as usize] = (step, to);
    to
}

/// The precompiled rule masks of one policy direction.
///
/// The fields [`Matcher::first_rule`] reads for every flow come first, in one run of five
/// lines that [`Matcher::prefetch_header`] asks for whole (`repr(C)` keeps the order); the
/// tables of node and address peers, read only for such peers, come last. In the order the
/// compiler chose, those fields lay on five lines spread over seven, one of them never
/// warmed; ordered, the bench's Antrea flows took 0.97x the simulated first-level misses
/// and 0.98x the last-level ones (callgrind, `TIERPROXY_DECIDE_SIM=antrea`), their
/// latency unchanged within the noise of alternated runs.
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct Matcher {
    /// Rules that match every protocol and port.
    all_ports: RuleMask,
    /// Rules scoped to their own subjects (Antrea rule-level `appliedTo`); 0 for every
    /// policy kind but Antrea's.
    scoped: RuleMask,
    /// Rules that match every peer.
    all_peers: RuleMask,
    /// Rules with subject-relative peers (Antrea `namespaces.match: Self`,
    /// `namespaces.sameLabels`): a pod peer may match them beyond what
    /// [`Matcher::pods`] says, which the caller checks rule by rule
    /// ([`Matcher::first_rule`]'s `relative`).
    relative: RuleMask,
    /// Per protocol (TCP, UDP, SCTP), by destination port.
    ports: [PortMasks; 3],
    /// Named ports: (name, protocol of the entry if any, rules). A name is kept in place
    /// (`CompactString`, up to 24 bytes; a valid `IANA_SVC_NAME` has at most 15), so a
    /// candidate on a named port reads no string line beyond this list; a longer one (only
    /// where validation was skipped) is on the heap, compared all the same.
    named: Vec<(CompactString, Option<Protocol>, RuleMask)>,
    /// Mask table; class 0 is the empty mask.
    masks: MaskTable,
    pods: PodClasses,
    /// Per subject pod, the [`Matcher::scoped`] rules whose appliedTo holds it (empty when
    /// no rule is scoped).
    subjects: PodClasses,
    nodes: Vec<(u32, Class)>,
    v4: Intervals,
    v6: Intervals,
}

/// A matcher's class table is full: [`Matcher::set_pod`] cannot add a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooManyClasses;

/// Protocol index into per-protocol tables: TCP 0, UDP 1, SCTP 2.
pub(crate) fn protocol_index(p: Protocol) -> usize {
    match p {
        Protocol::Tcp => 0,
        Protocol::Udp => 1,
        Protocol::Sctp => 2,
    }
}

/// Rule masks numbered as [`Class`]es, in order of first appearance; mask 0 is class 0.
struct Interner {
    masks: Vec<RuleMask>,
    ids: rustc_hash::FxHashMap<RuleMask, Class>,
    /// The last mask interned and its class: one interval after another mostly repeats
    /// it, and this skips the table.
    last: (RuleMask, Class),
    /// A mask found no class id (more than [`Class::MAX`] distinct masks).
    full: bool,
}

impl Interner {
    fn new() -> Self {
        Interner { masks: vec![0], ids: [(0, 0)].into_iter().collect(), last: (0, 0), full: false }
    }

    fn intern(&mut self, m: RuleMask) -> Class {
        if m == self.last.0 {
            return self.last.1;
        }
        let c = match self.ids.get(&m) {
            Some(&c) => c,
            None if self.masks.len() > Class::MAX as usize => {
                // No class id left: the build fails ([`Matcher::build`]).
                self.full = true;
                return 0;
            }
            None => {
                let c = self.masks.len() as Class;
                self.masks.push(m);
                self.ids.insert(m, c);
                c
            }
        };
        self.last = (m, c);
        c
    }
}

/// `(start, end_inclusive, rule)`: a range of addresses or ports a rule matches.
type Range = (u128, u128, u32);

/// What [`sweep_ranges`] reports.
enum Sweep {
    /// Id `.0` now covers the current position (`true`) or no longer does (`false`).
    Toggle(u32, bool),
    /// All changes at this position are reported; it starts a new interval.
    At(u128),
}

/// Sweeps inclusive ranges `(first, last, id)` from low to high: at each distinct boundary
/// it reports every id whose coverage starts or ends there, then the position. Overlapping
/// ranges of one id count once. A range ending at `u128::MAX` never closes.
fn sweep_ranges(ranges: impl Iterator<Item = Range>, ids: usize, f: impl FnMut(Sweep)) {
    // Events sort by (position, close before open, id). Ports and IPv4 addresses put every
    // position below 2^64, so their events pack into one integer (position << 64 |
    // open << 32 | id) that sorts much faster than a tuple; IPv6 ranges use tuples.
    // Two events a range at most; reserved up front, not grown by doubling.
    let mut packed: Vec<u128> = Vec::with_capacity(2 * ranges.size_hint().0);
    let mut wide: Vec<(u128, bool, u32)> = Vec::new();
    let pack = |pos: u128, open: bool, id: u32| pos << 64 | (open as u128) << 32 | id as u128;
    let unpack = |e: u128| (e >> 64, (e >> 32) & 1 == 1, e as u32);
    for (lo, hi, id) in ranges {
        let end = hi.checked_add(1);
        if wide.is_empty() && end.is_some_and(|e| e <= u64::MAX as u128) {
            packed.push(pack(lo, true, id));
            packed.extend(end.map(|e| pack(e, false, id)));
        } else {
            if wide.is_empty() {
                wide.extend(packed.drain(..).map(unpack));
            }
            wide.push((lo, true, id));
            wide.extend(end.map(|e| (e, false, id)));
        }
    }
    if wide.is_empty() {
        packed.sort_unstable();
        sweep_sorted(packed.into_iter().map(unpack), ids, f);
    } else {
        wide.sort_unstable();
        sweep_sorted(wide.into_iter(), ids, f);
    }
}

/// The sweep of [`sweep_ranges`] over its sorted events `(position, open, id)`.
fn sweep_sorted(
    events: impl Iterator<Item = (u128, bool, u32)>,
    ids: usize,
    mut f: impl FnMut(Sweep),
) {
    let mut counts = vec![0u32; ids];
    let mut events = events.peekable();
    while let Some(&(pos, _, _)) = events.peek() {
        while let Some((_, open, id)) = events.next_if(|e| e.0 == pos) {
            let c = &mut counts[id as usize];
            if open {
                *c += 1;
                if *c == 1 {
                    f(Sweep::Toggle(id, true));
                }
            } else {
                *c -= 1;
                if *c == 0 {
                    f(Sweep::Toggle(id, false));
                }
            }
        }
        f(Sweep::At(pos));
    }
}

/// Builds disjoint intervals of rule masks from rule ranges.
fn sweep(ranges: &mut Vec<Range>, interner: &mut Interner) -> Intervals {
    let mut mask: RuleMask = 0;
    let mut out = Intervals::default();
    sweep_ranges(ranges.drain(..), MAX_RULES, |e| match e {
        Sweep::Toggle(r, true) => mask |= 1 << r,
        Sweep::Toggle(r, false) => mask &= !(1 << r),
        Sweep::At(pos) => {
            let class = interner.intern(mask);
            if out.classes.last() != Some(&class) {
                out.starts.push(pos);
                out.classes.push(class);
            }
        }
    });
    out
}

/// The address ranges of a block: `net` minus every `except`, as inclusive `u128` ranges.
pub(crate) fn block_ranges(b: &Block, out: &mut Vec<(u128, u128)>) {
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
    /// snapshot's interned pod sets; `addrs` its single-address pods; `scratch` covers
    /// every pod id, empty, and is left empty.
    ///
    /// # Errors
    /// [`TooManyClasses`] when the rules split pods, addresses and ports into more distinct
    /// rule masks than a [`Class`] can number (65,535: possible only with that many pods,
    /// each in its own combination of the rules' peer sets). The policy direction is then
    /// evaluated rule by rule, as one above [`MAX_RULES`] is: slower, never wrong.
    pub(crate) fn build(
        rules: &[Rule],
        pod_sets: &(impl PodSets + ?Sized),
        addrs: &PodAddrs,
        scratch: &mut Scratch,
    ) -> Result<Matcher, TooManyClasses> {
        debug_assert!(rules.len() <= MAX_RULES);
        let mut interner = Interner::new();
        let mut all_peers: RuleMask = 0;
        let mut all_ports: RuleMask = 0;
        let mut node_mask: rustc_hash::FxHashMap<u32, RuleMask> = Default::default();
        let (mut v4, mut v6): (Vec<Range>, Vec<Range>) = (Vec::new(), Vec::new());
        let mut ports: [Vec<Range>; 3] = Default::default();
        let mut named: Vec<(CompactString, Option<Protocol>, RuleMask)> = Vec::new();
        let mut ranges = Vec::new();
        // The rules of one direction name the same few pod sets over and over (a million
        // peers, a few hundred distinct selectors): gather each set's rule mask first, then
        // walk each distinct set's pods once.
        let mut set_masks: rustc_hash::FxHashMap<SetId, RuleMask> = Default::default();
        for (r, rule) in rules.iter().enumerate() {
            let bit: RuleMask = 1 << r;
            let peers = &rule.peers;
            if peers.all {
                all_peers |= bit;
            }
            for &s in &peers.pod_sets {
                *set_masks.entry(s).or_default() |= bit;
            }
            for node in peers.nodes.iter().flat_map(|n| n.iter()) {
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
                            None => named.push((CompactString::from(n.as_str()), p, bit)),
                        }
                    }
                    (PortSpec::Any, Some(p)) => {
                        ports[protocol_index(p)].push((0, u16::MAX as u128, r as u32))
                    }
                    (PortSpec::Range(lo, hi), Some(p)) => {
                        ports[protocol_index(p)].push((*lo as u128, *hi as u128, r as u32))
                    }
                    // Numeric entries always carry a protocol (defaulted to TCP).
                    (_, None) => {}
                }
            }
        }
        for (&s, &mask) in &set_masks {
            scratch.add_set(pod_sets.pods(s), mask);
        }
        // Pod peers never search the address intervals: a single-address pod's matches by
        // address (`networks`, `ipBlock`) are folded into its class here.
        let v4 = sweep(&mut v4, &mut interner);
        let v6 = sweep(&mut v6, &mut interner);
        fold_addresses(&v4, &addrs.v4, &interner.masks, scratch);
        fold_addresses(&v6, &addrs.v6, &interner.masks, scratch);
        let pods = classes(scratch, &mut interner);
        // Rule-level appliedTo: the same walk over each distinct set, now by subject.
        let mut scoped: RuleMask = 0;
        let mut relative: RuleMask = 0;
        set_masks.clear();
        for (r, rule) in rules.iter().enumerate() {
            if let Some(s) = rule.applied_to {
                scoped |= 1 << r;
                *set_masks.entry(s).or_default() |= 1 << r;
            }
            if !rule.peers.relative.is_empty() {
                relative |= 1 << r;
            }
        }
        for (&s, &mask) in &set_masks {
            scratch.add_set(pod_sets.pods(s), mask);
        }
        let subjects = classes(scratch, &mut interner);
        let mut nodes: Vec<(u32, Class)> =
            node_mask.iter().map(|(n, m)| (*n, interner.intern(*m))).collect();
        nodes.sort_unstable();
        // Port intervals keep their masks inline: interned apart, they leave the class
        // table to the classes lookups use.
        let mut port_interner = Interner::new();
        let ports = ports.map(|mut p| {
            let iv = sweep(&mut p, &mut port_interner);
            PortMasks::new(
                iv.starts
                    .iter()
                    .zip(&iv.classes)
                    .map(|(s, c)| (*s as u32, port_interner.masks[*c as usize])),
            )
        });
        if interner.full || port_interner.full {
            return Err(TooManyClasses);
        }
        Ok(Matcher {
            masks: MaskTable::new(interner.masks),
            all_peers,
            all_ports,
            pods,
            nodes,
            v4,
            v6,
            ports,
            named,
            scoped,
            subjects,
            relative,
        })
    }

    /// Sets the class of pod `pod` to what [`Matcher::build`] would give it now: the rules
    /// of `rules` (this matcher's) with a pod set in `pod_sets` that holds the pod, plus,
    /// for a single-address pod (`addr`), the rules whose address ranges hold `addr`. Used
    /// to patch a snapshot after the pod's labels (or its namespace's) changed.
    ///
    /// # Errors
    /// [`TooManyClasses`] when the pod's new mask would need a class beyond what
    /// [`Class`] can number; the matcher is unchanged then, and the caller builds it again.
    pub(crate) fn set_pod(
        &mut self,
        pod: u32,
        rules: &[Rule],
        pod_sets: &[std::sync::Arc<roaring::RoaringBitmap>],
        addr: Option<IpAddr>,
    ) -> Result<(), TooManyClasses> {
        let mut mask: RuleMask = 0;
        for (r, rule) in rules.iter().enumerate() {
            if rule.peers.pod_sets.iter().any(|&s| pod_sets[s as usize].contains(pod)) {
                mask |= 1 << r;
            }
        }
        mask |= match addr {
            Some(IpAddr::V4(a)) => self.mask(self.v4.get(u32::from(a) as u128)),
            Some(IpAddr::V6(a)) => self.mask(self.v6.get(u128::from(a))),
            None => 0,
        };
        let mut subject: RuleMask = 0;
        for (r, rule) in rules.iter().enumerate() {
            if rule.applied_to.is_some_and(|s| pod_sets[s as usize].contains(pod)) {
                subject |= 1 << r;
            }
        }
        let (class, subject) = (self.class_of(mask)?, self.class_of(subject)?);
        self.pods.set(pod, class);
        self.subjects.set(pod, subject);
        Ok(())
    }

    /// The class of `mask`, added to the table if new.
    fn class_of(&mut self, mask: RuleMask) -> Result<Class, TooManyClasses> {
        match self.masks.position(mask) {
            Some(c) => Ok(c as Class),
            None if self.masks.len() > Class::MAX as usize => Err(TooManyClasses),
            None => {
                self.masks.push(mask);
                Ok((self.masks.len() - 1) as Class)
            }
        }
    }

    /// Starts loading the header lines [`Matcher::first_rule`] reads for a flow, without
    /// waiting for them (`decide`'s warming, in `eval`): every line from the first field
    /// to the end of [`Matcher::pods`] (five lines).
    #[inline]
    pub(crate) fn prefetch_header(&self) {
        let start = (self as *const Matcher).cast::<u8>();
        let end = std::mem::offset_of!(Matcher, pods) + std::mem::size_of::<PodClasses>();
        for at in (0..end).step_by(64) {
            prefetch(start.wrapping_add(at));
        }
        prefetch(start.wrapping_add(end - 1));
    }

    /// Starts loading the data lines [`Matcher::first_rule`] reads first for a flow with
    /// `protocol` between subject pod `subject` and `peer`: the port table's starts and
    /// masks, the peer's and the subject's class entries. It reads the header (which
    /// [`Matcher::prefetch_header`] should have asked for a little earlier) and waits for
    /// none of the data.
    #[inline]
    pub(crate) fn prefetch_data(&self, subject: u32, peer: Endpoint, protocol: Protocol) {
        let ports = &self.ports[protocol_index(protocol)];
        prefetch(ports.data.as_ptr());
        prefetch(ports.data.as_ptr().wrapping_add((ports.len as usize).div_ceil(4)));
        if let Endpoint::Pod(p) = peer {
            self.pods.prefetch(p);
        }
        if self.scoped != 0 {
            self.subjects.prefetch(subject);
        }
    }

    #[inline]
    fn mask(&self, c: Class) -> RuleMask {
        self.masks.get(c as usize)
    }

    /// The index of the first rule matching the flow, if any. `subject` is the subject
    /// pod's id; `multi_address` says that `peer` is a pod with more than one address (its
    /// address matches are not folded). `relative(rule)` says whether a rule's
    /// subject-relative peers hold the pod `peer` (antrea-model.md §7); it is asked only
    /// for such rules that could still be the first match, lowest first.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn first_rule(
        &self,
        subject: u32,
        peer: Endpoint,
        multi_address: bool,
        ip: IpAddr,
        protocol: Protocol,
        port: u16,
        dst_ports: &[NamedPort],
        relative: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut port_mask = self.all_ports | self.ports[protocol_index(protocol)].get(port);
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
        if self.scoped != 0 {
            // A scoped rule exists only for the subjects its appliedTo selects.
            port_mask &= !self.scoped | self.mask(self.subjects.get(subject));
        }
        if port_mask == 0 {
            return None;
        }
        let mut peer_mask = self.all_peers;
        let by_address = match peer {
            Endpoint::Pod(p) => {
                peer_mask |= self.mask(self.pods.get(p));
                multi_address
            }
            Endpoint::Node(n) => {
                peer_mask |= self.mask(
                    self.nodes.binary_search_by_key(&n, |e| e.0).map_or(0, |i| self.nodes[i].1),
                );
                true
            }
            Endpoint::External => true,
        };
        // `networks` / `ipBlock` match any address, pod and node IPs included.
        if by_address {
            peer_mask |= match ip {
                IpAddr::V4(a) => self.mask(self.v4.get(u32::from(a) as u128)),
                IpAddr::V6(a) => self.mask(self.v6.get(u128::from(a))),
            };
        }
        let hit = port_mask & peer_mask;
        if self.relative != 0 && matches!(peer, Endpoint::Pod(_)) {
            // Relative rules below the first hit that the masks did not already match.
            let below = if hit == 0 { RuleMask::MAX } else { (hit & hit.wrapping_neg()) - 1 };
            let mut open = self.relative & port_mask & !peer_mask & below;
            while open != 0 {
                let r = open.trailing_zeros();
                if relative(r) {
                    return Some(r);
                }
                open &= open - 1;
            }
        }
        (hit != 0).then(|| hit.trailing_zeros())
    }
}

impl PodClasses {
    /// Starts loading the line [`PodClasses::get`] reads first for `pod`.
    #[inline]
    fn prefetch(&self, pod: u32) {
        match self {
            PodClasses::Dense(d) => prefetch(d.addr(pod as usize)),
            PodClasses::Ranked { blocks, .. } => {
                prefetch(blocks.as_ptr().wrapping_add(pod as usize / 64))
            }
            PodClasses::Sparse { pods, .. } => prefetch(pods.as_ptr().wrapping_add(pods.len() / 2)),
        }
    }

    /// The class of pod `pod` (0 when it has none).
    #[inline]
    fn get(&self, pod: u32) -> Class {
        match self {
            PodClasses::Dense(d) => match d {
                Widening::Narrow(v) => v.get(pod as usize).map_or(0, |&c| c as Class),
                Widening::Wide(v) => v.get(pod as usize).copied().unwrap_or(0),
            },
            PodClasses::Ranked { blocks, classes } => {
                let Some(&(word, rank)) = blocks.get(pod as usize / 64) else { return 0 };
                let bit = 1u64 << (pod % 64);
                if word & bit == 0 {
                    return 0;
                }
                classes.get(rank as usize + (word & (bit - 1)).count_ones() as usize)
            }
            PodClasses::Sparse { pods, classes } => {
                pods.binary_search(&pod).map_or(0, |i| classes.get(i))
            }
        }
    }

    /// Sets the class of pod `pod` (a pod id below the pod count the table was built for).
    fn set(&mut self, pod: u32, class: Class) {
        match self {
            PodClasses::Dense(d) => d.set(pod as usize, class),
            PodClasses::Ranked { blocks, classes } => {
                let b = pod as usize / 64;
                let bit = 1u64 << (pod % 64);
                let (word, rank) = blocks[b];
                let at = rank as usize + (word & (bit - 1)).count_ones() as usize;
                match (word & bit != 0, class) {
                    (true, 0) => {
                        classes.remove(at);
                        blocks[b].0 &= !bit;
                        blocks[b + 1..].iter_mut().for_each(|e| e.1 -= 1);
                    }
                    (true, c) => classes.set(at, c),
                    (false, 0) => {}
                    (false, c) => {
                        classes.insert(at, c);
                        blocks[b].0 |= bit;
                        blocks[b + 1..].iter_mut().for_each(|e| e.1 += 1);
                    }
                }
            }
            PodClasses::Sparse { pods, classes } => match (pods.binary_search(&pod), class) {
                (Ok(i), 0) => {
                    pods.remove(i);
                    classes.remove(i);
                }
                (Ok(i), c) => classes.set(i, c),
                (Err(_), 0) => {}
                (Err(i), c) => {
                    pods.insert(i, pod);
                    classes.insert(i, c);
                }
            },
        }
    }
}

/// The classes of the pods whose mask in `scratch` is not zero (the scratch emptied), in
/// the layout [`PodClasses`] picks for how many of the scratch's pods that is.
fn classes(scratch: &mut Scratch, interner: &mut Interner) -> PodClasses {
    let (touched, pod_count) = (scratch.count(), scratch.pods());
    if touched * 2 >= pod_count {
        // One byte per pod unless a class needs two ([`Widening::new`]). Each working
        // class becomes one class at most, so when the classes so far and the working
        // ones number at most 256 the bytes are written directly, without a table of
        // two-byte classes to narrow after (a pass and a copy per pod).
        if interner.masks.len() + scratch.masks.len() <= 256 {
            let mut dense: Vec<u8> = vec![0; pod_count];
            let slots = dense.as_mut_slice();
            scratch.drain(interner, |pod, c| slots[pod as usize] = c as u8);
            return PodClasses::Dense(Widening::Narrow(dense));
        }
        let mut dense: Vec<Class> = vec![0; pod_count];
        let slots = dense.as_mut_slice();
        scratch.drain(interner, |pod, c| slots[pod as usize] = c);
        return PodClasses::Dense(ClassVec::new(dense));
    }
    let mut ids = Vec::with_capacity(touched);
    if touched * 20 >= pod_count {
        // The presence bits are the scratch's own, with their ranks.
        let mut rank = 0;
        let blocks = (scratch.touched.iter())
            .map(|&word| {
                let block = (word, rank);
                rank += word.count_ones();
                block
            })
            .collect();
        scratch.drain(interner, |_, c| ids.push(c));
        PodClasses::Ranked { blocks, classes: ClassVec::new(ids) }
    } else {
        let mut pods = Vec::with_capacity(touched);
        scratch.drain(interner, |pod, c| {
            pods.push(pod);
            ids.push(c);
        });
        PodClasses::Sparse { pods, classes: ClassVec::new(ids) }
    }
}

/// Which policies can match a destination port at all: disjoint port intervals of one
/// protocol and direction, each with the bitset (by policy index) of policies that have a
/// rule for some port in it. `decide` tests one bit per policy here before touching the
/// policy's own [`Matcher`], so policies without a rule on the flow's port cost no memory
/// traffic beyond this small table.
#[derive(Debug, Clone, Default)]
pub(crate) struct PortIndex {
    starts: Vec<u32>,
    /// `sets[i]` covers `starts[i]..starts[i+1]`; words of 64 policy bits.
    sets: Vec<Box<[u64]>>,
}

/// Sets (`on`) or clears bit `bit` of a bitset of 64-bit words.
fn set_bit(words: &mut [u64], bit: u32, on: bool) {
    let (w, b) = (bit as usize / 64, bit % 64);
    if on {
        words[w] |= 1 << b;
    } else {
        words[w] &= !(1 << b);
    }
}

impl PortIndex {
    /// Builds the index from `(first_port, last_port, policy)` ranges over `policies`
    /// policies.
    pub(crate) fn build(ranges: &mut [(u32, u32, u32)], policies: usize) -> PortIndex {
        let mut words = vec![0u64; policies.div_ceil(64)];
        let mut out = PortIndex::default();
        let ranges = ranges.iter().map(|&(lo, hi, p)| (lo as u128, hi as u128, p));
        sweep_ranges(ranges, policies, |e| match e {
            Sweep::Toggle(p, on) => set_bit(&mut words, p, on),
            Sweep::At(pos) => {
                if out.sets.last().is_none_or(|last| **last != *words) {
                    out.starts.push(pos as u32);
                    out.sets.push(words.clone().into_boxed_slice());
                }
            }
        });
        out
    }

    /// Sets policy `policy`'s bit exactly where `ranges` (inclusive port ranges) say,
    /// and nowhere else: the index as [`PortIndex::build`] would give it for a policy whose
    /// rules changed after the build (a patched snapshot). `policies`: the number of
    /// policies it was built over. Intervals are split where a range starts or ends;
    /// equal neighbours are not merged again (lookups do not depend on it).
    pub(crate) fn set_policy(&mut self, policy: u32, ranges: &[(u32, u32)], policies: usize) {
        for set in &mut self.sets {
            set_bit(set, policy, false);
        }
        let words = policies.div_ceil(64);
        for &(lo, hi) in ranges {
            self.split_at(lo, words);
            if hi < u16::MAX as u32 {
                self.split_at(hi + 1, words);
            }
            let from = self.starts.partition_point(|&s| s < lo);
            let to = self.starts.partition_point(|&s| s <= hi);
            for set in &mut self.sets[from..to] {
                set_bit(set, policy, true);
            }
        }
    }

    /// Makes `at` the start of an interval (a copy of the one holding it).
    fn split_at(&mut self, at: u32, words: usize) {
        let i = self.starts.partition_point(|&s| s <= at);
        if i > 0 && self.starts[i - 1] == at {
            return;
        }
        let set = match i.checked_sub(1) {
            Some(prev) => self.sets[prev].clone(),
            None => vec![0; words].into_boxed_slice(),
        };
        self.starts.insert(i, at);
        self.sets.insert(i, set);
    }

    /// The policies with a rule for `port`, as bitset words; `None` if there are none.
    #[inline]
    pub(crate) fn candidates(&self, port: u16) -> Option<&[u64]> {
        let i = self.starts.partition_point(|&s| s <= port as u32);
        let set = &self.sets[i.checked_sub(1)?];
        set.iter().any(|&w| w != 0).then_some(&set[..])
    }
}

/// Which policies can match an external address at all, per address family: disjoint
/// address intervals, each with the sorted ids of policies that have a rule covering it (a
/// `networks`/`ipBlock` range, or a rule that matches every peer). An external peer can
/// match nothing else, so `decide` skips every other policy after one search here instead
/// of one search per policy.
#[derive(Debug, Clone, Default)]
pub(crate) struct AddrIndex {
    v4: Spans,
    v6: Spans,
    /// Policies that are candidates for every address, sorted: those whose address ranges
    /// changed after the build (a patched snapshot, until its next full compile). Their
    /// entries in the intervals may be stale, which only adds candidates.
    extra: Vec<u32>,
}

/// What [`AddrIndex::candidates`] finds for one address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AddrCandidates<'a> {
    ids: &'a [u32],
    extra: &'a [u32],
}

impl AddrCandidates<'_> {
    /// Whether policy `policy` may match the address.
    #[inline]
    pub(crate) fn contains(&self, policy: u32) -> bool {
        self.ids.binary_search(&policy).is_ok()
            || (!self.extra.is_empty() && self.extra.binary_search(&policy).is_ok())
    }
}

#[derive(Debug, Clone, Default)]
struct Spans {
    starts: Vec<u128>,
    /// `(offset, len)` into `ids` for each interval.
    spans: Vec<(u32, u32)>,
    ids: Vec<u32>,
}

impl Spans {
    fn build(ranges: &mut [(u128, u128, u32)], policies: usize) -> Spans {
        // The active policies as a bitset: sorted by construction, and a toggle is one
        // bit (a tree set cost a node walk per toggle).
        let mut active = vec![0u64; policies.div_ceil(64)];
        let mut changed = false;
        let mut out = Spans::default();
        sweep_ranges(ranges.iter().copied(), policies, |e| match e {
            Sweep::Toggle(p, on) => {
                set_bit(&mut active, p, on);
                changed = true;
            }
            // A position where only overlap counts changed continues the last interval.
            Sweep::At(_) if !changed && !out.starts.is_empty() => {}
            Sweep::At(pos) => {
                changed = false;
                let offset = out.ids.len() as u32;
                for (w, &word) in active.iter().enumerate() {
                    let mut bits = word;
                    while bits != 0 {
                        out.ids.push(w as u32 * 64 + bits.trailing_zeros());
                        bits &= bits - 1;
                    }
                }
                out.starts.push(pos);
                out.spans.push((offset, out.ids.len() as u32 - offset));
            }
        });
        out
    }

    #[inline]
    fn get(&self, x: u128) -> &[u32] {
        let i = self.starts.partition_point(|&s| s <= x);
        match i.checked_sub(1) {
            Some(i) => {
                let (off, len) = self.spans[i];
                &self.ids[off as usize..(off + len) as usize]
            }
            None => &[],
        }
    }
}

impl AddrIndex {
    /// Builds the index from `(first, last, policy)` address ranges of each family.
    pub(crate) fn build(
        v4: &mut [(u128, u128, u32)],
        v6: &mut [(u128, u128, u32)],
        policies: usize,
    ) -> AddrIndex {
        AddrIndex {
            v4: Spans::build(v4, policies),
            v6: Spans::build(v6, policies),
            extra: Vec::new(),
        }
    }

    /// The policies with a rule that can match `ip` as an external peer.
    #[inline]
    pub(crate) fn candidates(&self, ip: IpAddr) -> AddrCandidates<'_> {
        let ids = match ip {
            IpAddr::V4(a) => self.v4.get(u32::from(a) as u128),
            IpAddr::V6(a) => self.v6.get(u128::from(a)),
        };
        AddrCandidates { ids, extra: &self.extra }
    }

    /// Makes policy `policy` a candidate for every address (its ranges changed after the
    /// build).
    pub(crate) fn add_everywhere(&mut self, policy: u32) {
        if let Err(at) = self.extra.binary_search(&policy) {
            self.extra.insert(at, policy);
        }
    }

    /// Policies made candidates for every address ([`AddrIndex::add_everywhere`]).
    pub(crate) fn extra(&self) -> usize {
        self.extra.len()
    }
}

/// Asks the CPU to start loading the cache line holding `p` and not wait for it
/// (x86-64 `prefetcht0`, Intel SDM vol. 2 "PREFETCHh"; nothing elsewhere). A prefetch
/// never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    // SAFETY: `prefetcht0` is part of SSE, which every x86-64 CPU has; it changes no
    // register or memory and does not fault, whatever the address.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `true` if `policy`'s bit is set in `words`.
#[inline]
pub(crate) fn has(words: &[u64], policy: u32) -> bool {
    words.get(policy as usize / 64).is_some_and(|w| w & (1 << (policy % 64)) != 0)
}

#[cfg(test)]
mod tests {
    /// The ids covering each reported interval, by [`super::sweep_ranges`].
    fn swept(ranges: &[super::Range]) -> Vec<(u128, Vec<u32>)> {
        let mut active = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        super::sweep_ranges(ranges.iter().copied(), 8, |e| match e {
            super::Sweep::Toggle(id, true) => {
                active.insert(id);
            }
            super::Sweep::Toggle(id, false) => {
                active.remove(&id);
            }
            super::Sweep::At(pos) => out.push((pos, active.iter().copied().collect())),
        });
        out
    }

    #[test]
    fn sweeps_agree_whether_positions_fit_in_64_bits_or_not() {
        let narrow = [(10, 20, 0), (15, 30, 1), (15, 15, 2), (21, 21, 0), (0, u32::MAX as u128, 3)];
        // The same ranges, shifted above 2^64 (IPv6-sized positions).
        let shift = 1u128 << 100;
        let wide: Vec<super::Range> =
            narrow.iter().map(|&(lo, hi, id)| (lo + shift, hi + shift, id)).collect();
        let got: Vec<(u128, Vec<u32>)> =
            swept(&wide).into_iter().map(|(pos, ids)| (pos - shift, ids)).collect();
        assert_eq!(swept(&narrow), got);
        assert_eq!(
            swept(&narrow),
            vec![
                (0, vec![3]),
                (10, vec![0, 3]),
                (15, vec![0, 1, 2, 3]),
                (16, vec![0, 1, 3]),
                // Every boundary is reported, also where no id toggles.
                (21, vec![0, 1, 3]),
                (22, vec![1, 3]),
                (31, vec![3]),
                (1 << 32, vec![]),
            ]
        );
        // A range that never closes moves a sweep of narrow ranges to the wide path.
        let mut mixed = narrow.to_vec();
        mixed.push((40, u128::MAX, 4));
        let mut want = swept(&narrow);
        want.insert(7, (40, vec![3, 4]));
        want.last_mut().expect("non-empty").1 = vec![4];
        assert_eq!(swept(&mixed), want);
    }

    /// A port index patched for one policy answers as one built with that policy's new
    /// ranges, at every port.
    #[test]
    fn a_port_index_patched_for_one_policy_answers_as_one_built_so() {
        let before = [(80, 80, 0), (0, 1000, 1), (443, 8080, 2), (53, 53, 1), (9000, 9000, 3)];
        let new_ranges = [(0, 0), (81, 442), (65535, 65535), (8000, 9000)];
        let mut patched = super::PortIndex::build(&mut before.to_vec(), 4);
        patched.set_policy(1, &new_ranges, 4);
        let mut after: Vec<(u32, u32, u32)> = before.iter().copied().filter(|r| r.2 != 1).collect();
        after.extend(new_ranges.iter().map(|&(lo, hi)| (lo, hi, 1)));
        let built = super::PortIndex::build(&mut after, 4);
        for port in 0..=u16::MAX {
            let bits = |i: &super::PortIndex| {
                (0..4)
                    .filter(|&p| i.candidates(port).is_some_and(|w| super::has(w, p)))
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(&patched), bits(&built), "port {port}");
        }
    }

    #[test]
    fn addr_index_lists_covering_policies() {
        let base = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0)) as u128;
        let mut v4 =
            vec![(base, base + 255, 3), (base + 16, base + 31, 1), (0, u32::MAX as u128, 7)];
        let mut v6 = vec![(0, u128::MAX, 7)];
        let idx = AddrIndex::build(&mut v4, &mut v6, 8);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(idx.candidates(ip("10.0.0.1")).ids, &[3, 7]);
        assert_eq!(idx.candidates(ip("10.0.0.20")).ids, &[1, 3, 7]);
        assert_eq!(idx.candidates(ip("11.0.0.1")).ids, &[7]);
        assert_eq!(idx.candidates(ip("::1")).ids, &[7]);
    }

    #[test]
    fn port_index_sets_cover_exactly_the_ranges() {
        let mut r = vec![(80, 80, 0), (1000, 2000, 1), (1500, 1500, 0), (0, 65535, 70)];
        let idx = PortIndex::build(&mut r, 71);
        let c = |p| idx.candidates(p).map(|w| (0..71).filter(|&i| has(w, i)).collect::<Vec<_>>());
        assert_eq!(c(80), Some(vec![0, 70]));
        assert_eq!(c(81), Some(vec![70]));
        assert_eq!(c(1500), Some(vec![0, 1, 70]));
        assert_eq!(c(2000), Some(vec![1, 70]));
        assert_eq!(c(65535), Some(vec![70]));
        let empty = PortIndex::build(&mut [], 3);
        assert_eq!(empty.candidates(1), None);
    }

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

    /// A set added from its flat copy (ids or presence words, whichever [`FlatSets`]
    /// picked) or from its bitmap gives every pod the mask a walk of the set gives it, and
    /// marks exactly those pods; draining yields them in id order with their mask's class
    /// and leaves the scratch empty for the next build.
    #[test]
    fn scratch_adds_flat_and_bitmap_sets_alike() {
        use std::sync::Arc;
        let pods = 1000usize;
        let sets: Vec<Arc<roaring::RoaringBitmap>> = [
            (0..64).collect::<roaring::RoaringBitmap>(),
            (64..65).chain([70, 200, 255, 256, 511]).collect(),
            (60..300).chain(320..390).chain(999..1000).collect(),
            (0..1000).filter(|p| p % 3 == 0 || p % 64 == 63).collect(),
            (0..1000).collect(),
            roaring::RoaringBitmap::new(),
        ]
        .into_iter()
        .map(Arc::new)
        .collect();
        let flat = FlatSets::new(&sets, pods);
        let kinds: Vec<&str> = (0..sets.len() as SetId)
            .map(|id| match flat.pods(id) {
                PodList::Ids(_) => "ids",
                PodList::Words(_) => "words",
                PodList::Bitmap(_) => "bitmap",
            })
            .collect();
        assert_eq!(kinds, ["words", "ids", "words", "words", "words", "ids"]);
        // One scratch each, reused as a compile thread does; one's step counter wraps.
        let (mut flat_scratch, mut bitmap_scratch) = (Scratch::new(pods), Scratch::new(pods));
        bitmap_scratch.step = u32::MAX - 20;
        for picks in 1u32..(1 << sets.len()) {
            let mut want = vec![0 as RuleMask; pods];
            let picked = (0..sets.len() as SetId).filter(|i| picks >> i & 1 == 1);
            for i in picked.clone() {
                sets[i as usize].iter().for_each(|p| want[p as usize] |= 1 << (i * 11));
            }
            for (from_flat, scratch) in [(true, &mut flat_scratch), (false, &mut bitmap_scratch)] {
                let list = |i| if from_flat { flat.pods(i) } else { sets.as_slice().pods(i) };
                picked.clone().for_each(|i| scratch.add_set(list(i), 1 << (i * 11)));
                assert_eq!(scratch.count(), want.iter().filter(|&&m| m != 0).count());
                let mut drained = Vec::new();
                let mut interner = Interner::new();
                scratch.drain(&mut interner, |pod, c| drained.push((pod, c)));
                assert!(drained.is_sorted(), "pods in id order");
                let mut got = vec![0 as RuleMask; pods];
                drained.iter().for_each(|&(pod, c)| got[pod as usize] = interner.masks[c as usize]);
                assert_eq!(got, want, "sets {picks:#b}");
                assert!(scratch.is_empty(), "drained to empty");
            }
        }
        assert!(bitmap_scratch.step < 1000, "the step counter wrapped");
    }

    /// Every layout of [`PodClasses`] (dense, ranked, sparse) answers as a plain map from
    /// pod to class, before and after pods gain, change and lose their class, including a
    /// class that needs two bytes.
    #[test]
    fn pod_class_layouts_read_and_patch_as_a_map() {
        let pods = 1000usize;
        for touched in [900usize, 200, 10] {
            let mut interner = Interner::new();
            let mut scratch = Scratch::new(pods);
            let mut truth = vec![0 as Class; pods];
            let picked: Vec<u32> = (0..touched as u32).map(|i| (i * 997) % pods as u32).collect();
            for &p in &picked {
                scratch.add_pods(std::iter::once(p), 1 << (p % 7));
            }
            let mut table = super::classes(&mut scratch, &mut interner);
            assert!(scratch.is_empty(), "scratch is left empty");
            for &p in &picked {
                truth[p as usize] = interner.intern(1 << (p % 7));
            }
            let layout = match &table {
                PodClasses::Dense(_) => "dense",
                PodClasses::Ranked { .. } => "ranked",
                PodClasses::Sparse { .. } => "sparse",
            };
            let expected = match touched {
                900 => "dense",
                200 => "ranked",
                _ => "sparse",
            };
            assert_eq!(layout, expected);
            let check = |table: &PodClasses, truth: &[Class]| {
                for p in 0..pods as u32 + 70 {
                    let want = truth.get(p as usize).copied().unwrap_or(0);
                    assert_eq!(table.get(p), want, "{layout}: pod {p}");
                }
            };
            check(&table, &truth);
            // Gain (first, middle, last pod), change, lose, and a class beyond one byte.
            for (p, c) in [(0u32, 3), (501, 5), (999, 2), (picked[1], 0), (picked[2], 300)] {
                table.set(p, c);
                truth[p as usize] = c;
                check(&table, &truth);
            }
            table.set(picked[2], 0);
            truth[picked[2] as usize] = 0;
            check(&table, &truth);
        }
    }

    /// A dense table is written in bytes only while every class it can get fits in one:
    /// classes the matcher numbered before it and the pods' own, around 256 in all.
    #[test]
    fn dense_classes_stay_exact_around_one_byte() {
        let pods = 1000usize;
        for total in 250..=262usize {
            let mut interner = Interner::new();
            // Classes numbered before the pods' (addresses', say): 1..before.
            let before = 40;
            (1..before).for_each(|i| _ = interner.intern((1 as RuleMask) << 100 | i as RuleMask));
            // Working classes the pods end in: `total - before` distinct masks.
            let working = (total - before) as u32;
            let mut scratch = Scratch::new(pods);
            let mask = |p: u32| (p % working + 1) as RuleMask;
            (0..900u32).for_each(|p| scratch.add_pods(std::iter::once(p), mask(p)));
            let table = super::classes(&mut scratch, &mut interner);
            assert!(matches!(table, PodClasses::Dense(_)), "{total}");
            for p in 0..pods as u32 {
                let want = if p < 900 { interner.intern(mask(p)) } else { 0 };
                assert_eq!(table.get(p), want, "{total} classes: pod {p}");
            }
        }
    }

    /// More distinct rule masks than a class id can number (17 rules, each holding the pods
    /// whose id has one bit set: every one of 70,000 pods its own mask) is refused, not
    /// wrapped into wrong classes; the caller then evaluates rule by rule.
    #[test]
    fn more_masks_than_class_ids_fail_the_build() {
        use crate::policy::model::{Action, Peers, Rule};
        use crate::policy::ports::Ports;
        let pods = 70_000u32;
        let sets: Vec<std::sync::Arc<roaring::RoaringBitmap>> = (0..17)
            .map(|bit| std::sync::Arc::new((0..pods).filter(|p| p >> bit & 1 == 1).collect()))
            .collect();
        let rule = |k: u32| Rule {
            name: None,
            index: k,
            action: Action::Allow,
            peers: Peers { pod_sets: Box::new([k]), ..Peers::default() },
            ports: Ports::any(),
            fail_closed: false,
            applied_to: None,
            enable_logging: false,
            log_label: None,
        };
        let mut scratch = Scratch::new(pods as usize);
        let addrs = PodAddrs::default();
        let rules: Vec<Rule> = (0..17).map(rule).collect();
        assert!(Matcher::build(&rules, sets.as_slice(), &addrs, &mut scratch).is_err());
        assert!(scratch.is_empty(), "scratch is left empty");
        // 16 rules: 65,536 masks, the empty one among them, fit.
        let m = Matcher::build(&rules[..16], sets.as_slice(), &addrs, &mut scratch).expect("fits");
        let hit = |p: u32| {
            m.first_rule(
                0,
                Endpoint::Pod(p),
                false,
                [0, 0, 0, 0].into(),
                Protocol::Tcp,
                80,
                &[],
                |_| false,
            )
        };
        assert_eq!(hit(0), None);
        assert_eq!(hit(0b1000), Some(3));
        assert_eq!(hit(65_535), Some(0));
        assert_eq!(hit(65_536 + 0b100), Some(2));
    }

    /// A matcher whose masks all fitted in 64 bits when built keeps them narrow; a pod
    /// that later matches a rule past the 64th (its labels changed: `set_pod`) widens the
    /// table. Port intervals of a rule past the 64th are wide from the start.
    #[test]
    fn narrow_masks_widen_when_a_rule_past_the_64th_matches() {
        use crate::policy::model::{Action, Peers, Rule};
        use crate::policy::ports::{PortMatch, PortSpec, Ports};
        let pods = 10u32;
        // Set k holds pod k for k < 10; the sets of rules 10..70 are empty for now.
        let mut sets: Vec<std::sync::Arc<roaring::RoaringBitmap>> = (0..70u32)
            .map(|k| std::sync::Arc::new((k < pods).then_some(k).into_iter().collect()))
            .collect();
        let rule = |k: u32, ports: Ports| Rule {
            name: None,
            index: k,
            action: Action::Allow,
            peers: Peers { pod_sets: Box::new([k]), ..Peers::default() },
            ports,
            fail_closed: false,
            applied_to: None,
            enable_logging: false,
            log_label: None,
        };
        let mut rules: Vec<Rule> = (0..70).map(|k| rule(k, Ports::any())).collect();
        let mut scratch = Scratch::new(pods as usize);
        let hit = |m: &Matcher, p: u32, port: u16| {
            m.first_rule(
                0,
                Endpoint::Pod(p),
                false,
                [0, 0, 0, 0].into(),
                Protocol::Tcp,
                port,
                &[],
                |_| false,
            )
        };
        let mut m = Matcher::build(&rules, sets.as_slice(), &PodAddrs::default(), &mut scratch)
            .expect("fits");
        assert!(matches!(m.masks, Widening::Narrow(_)), "every pod mask fits in 64 bits");
        assert_eq!(hit(&m, 3, 80), Some(3));
        // Pod 3 joins set 69 and leaves set 3: only rule 69 matches it now.
        sets[69] = std::sync::Arc::new([3].into_iter().collect());
        sets[3] = std::sync::Arc::new(roaring::RoaringBitmap::new());
        m.set_pod(3, &rules, &sets, None).expect("a class is free");
        assert!(matches!(m.masks, Widening::Wide(_)), "the new mask needs 128 bits");
        assert_eq!(hit(&m, 3, 80), Some(69));
        assert_eq!(hit(&m, 4, 80), Some(4), "the other classes kept their masks");

        // Rule 69 alone on port 9090.
        rules[69].ports = Ports(Box::new([PortMatch {
            protocol: Some(Protocol::Tcp),
            ports: PortSpec::Range(9090, 9090),
        }]));
        let m = Matcher::build(&rules, sets.as_slice(), &PodAddrs::default(), &mut scratch)
            .expect("fits");
        assert!(m.ports[0].wide, "rule 69's port needs 128 bits");
        assert_eq!(hit(&m, 3, 9090), Some(69));
        assert_eq!(hit(&m, 3, 80), None);
    }

    /// A named port matches a declared port of exactly its name (and protocol), whether
    /// the matcher keeps the name in place (up to 24 bytes) or on the heap (longer, only
    /// where validation was skipped): no prefix, extension or same-length other name.
    #[test]
    fn named_ports_match_by_whole_name_in_place_or_on_the_heap() {
        use crate::policy::model::{Action, Peers, Rule};
        use crate::policy::ports::{NamedPort, PortMatch, PortSpec, Ports};
        let names = [
            "metrics",
            "b23456789012345",
            "c234567890123456",
            "d2345678901234567",
            "x",
            "e234567890123456789012345",
        ];
        let rules: Vec<Rule> = (0..names.len() as u32)
            .map(|k| Rule {
                name: None,
                index: k,
                action: Action::Allow,
                peers: Peers { all: true, ..Peers::default() },
                ports: Ports(Box::new([PortMatch {
                    protocol: Some(Protocol::Tcp),
                    ports: PortSpec::Named(names[k as usize].into()),
                }])),
                fail_closed: false,
                applied_to: None,
                enable_logging: false,
                log_label: None,
            })
            .collect();
        let sets: Vec<std::sync::Arc<roaring::RoaringBitmap>> = Vec::new();
        let m = Matcher::build(&rules, sets.as_slice(), &PodAddrs::default(), &mut Scratch::new(4))
            .expect("fits");
        let hit = |declared: &str, protocol: Protocol| {
            let ports = [NamedPort { name: declared.into(), protocol, port: 9000 }];
            m.first_rule(
                0,
                Endpoint::Pod(1),
                false,
                [0, 0, 0, 0].into(),
                protocol,
                9000,
                &ports,
                |_| false,
            )
        };
        for (k, name) in names.iter().enumerate() {
            assert_eq!(hit(name, Protocol::Tcp), Some(k as u32), "{name}");
            assert_eq!(hit(name, Protocol::Udp), None, "{name} over UDP");
            assert_eq!(hit(&format!("{name}z"), Protocol::Tcp), None, "{name} extended");
            assert_eq!(hit(&name[..name.len() - 1], Protocol::Tcp), None, "{name} cut short")
        }
        assert_eq!(hit("b23456789012346", Protocol::Tcp), None, "same length, last byte");
        assert_eq!(hit("d2345678901234568", Protocol::Tcp), None, "17 bytes, last byte");
        assert_eq!(hit("e234567890123456789012346", Protocol::Tcp), None, "on the heap, last byte");
        assert!(m.named[..5].iter().all(|(n, _, _)| !n.is_heap_allocated()));
        assert!(m.named[5].0.is_heap_allocated());
    }

    /// Port intervals read back as a map, narrow and wide, with a start count that is not
    /// a multiple of four and a range that ends at the last port.
    #[test]
    fn port_masks_find_the_interval_of_every_port() {
        let intervals = [(0u32, 0b1), (80, 0b10), (81, 0), (1000, 0b100), (32000, 0b1000)];
        let expect = |port: u32| match port {
            0..80 => 0b1,
            80 => 0b10,
            81..1000 => 0,
            1000..32000 => 0b100,
            _ => 0b1000,
        };
        let narrow = PortMasks::new(intervals.iter().copied().chain([(65_536, 0)]));
        assert!(!narrow.wide);
        assert_eq!(narrow.len, 5, "the start past the last port is dropped");
        let wide = PortMasks::new(
            intervals.iter().map(|&(s, m)| (s, m | if s == 1000 { 1 << 100 } else { 0 })),
        );
        assert!(wide.wide);
        for port in [0u32, 1, 79, 80, 81, 999, 1000, 31_999, 32_000, 65_535] {
            assert_eq!(narrow.get(port as u16), expect(port), "port {port}");
            let high = if (1000..32000).contains(&port) { 1 << 100 } else { 0 };
            assert_eq!(wide.get(port as u16), expect(port) | high, "port {port}");
        }
        let late = PortMasks::new([(443u32, 0b1), (444, 0)].into_iter());
        assert_eq!((late.get(0), late.get(442), late.get(443), late.get(444)), (0, 0, 1, 0));
        assert_eq!(PortMasks::default().get(80), 0);
    }

    /// Regression: narrowed through `Option`, a table kept up to twice its length in spare
    /// capacity (the snapshot with the Antrea set grew from 77.0 to 78.3 MiB).
    #[test]
    fn widening_vectors_keep_no_spare_capacity() {
        let classes: Vec<Class> = (0..100).collect();
        let Widening::Narrow(n) = ClassVec::new(classes.clone()) else { panic!("fits a byte") };
        assert_eq!(n.capacity(), n.len());
        let mut wide = classes;
        wide.push(300);
        wide.reserve(1000);
        let Widening::Wide(w) = ClassVec::new(wide) else { panic!("300 needs two bytes") };
        assert_eq!(w.capacity(), w.len());
    }
}
