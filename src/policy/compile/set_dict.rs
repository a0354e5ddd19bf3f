//! Worker-local dictionaries of the pod sets that policy peers and Antrea `appliedTo`
//! entries name, keyed by the selectors as written.
//!
//! A large input names a few thousand distinct sets in a million peers. A worker of the
//! admin or Antrea pass looks each peer up here by an encoding of its selectors (one
//! pass over their strings gives the hash and the equality check), and compiles the
//! selectors into a [`SetKey`] only the first time it meets them. The pass then interns
//! each worker's keys in the [`Cluster`](super::cluster::Cluster), in worker order, so
//! set ids do not depend on thread timing; keys of two workers naming the same set meet
//! there. The worker hashes each key it marks used for the interner, so the calling
//! thread does not read the key's strings again but to compare it with an equal one.

use std::hash::BuildHasher;

use super::cluster::{Cluster, Interner, SetKey};
use super::selector;
use crate::policy::api::SelectorRef;
use crate::policy::labels::LabelSet;
use crate::policy::model::SetId;

/// The distinct pod sets one worker met, by content. Keys are dense `u32`s in the order
/// first met.
pub(super) struct SetDict {
    /// Keys by their encoding ([`encode`]).
    ids: rustc_hash::FxHashMap<Box<[u8]>, u32>,
    /// Per key, the pod set it names; `None` when a selector does not compile (an
    /// unknown operator, possible only where validation was skipped), so whatever named
    /// it fails closed.
    pub(super) sets: Vec<Option<SetKey>>,
    /// Per key, whether what the pass keeps uses it ([`SetDict::mark_used`]).
    used: Vec<bool>,
    /// Per key marked used that names a set, its hash in the interner the dict was made
    /// for ([`Interner::hash`]); 0 for the others.
    hashes: Vec<u64>,
    /// That interner's hasher.
    hasher: foldhash::fast::RandomState,
    buf: Vec<u8>,
}

/// The selector that selects everything (`{}`): Antrea's stand-in for an absent
/// namespace or pod selector where the other one is given.
pub(super) const EVERYTHING: SelectorRef<'static> =
    SelectorRef { match_labels: None, match_expressions: None };

/// What a key names, before its selectors are compiled: the kinds of [`SetKey`] a
/// peer or an `appliedTo` entry can name.
#[derive(Clone, Copy)]
pub(super) enum RawSet<'a> {
    /// Pods in namespaces matching the selector ([`SetKey::Namespaces`]).
    Namespaces(SelectorRef<'a>),
    /// Pods matching the second selector in namespaces matching the first
    /// ([`SetKey::Pods`]).
    Pods(SelectorRef<'a>, SelectorRef<'a>),
    /// Pods matching the selector in the namespace of this id ([`SetKey::InNamespace`]).
    InNamespace(u32, SelectorRef<'a>),
}

impl SetDict {
    /// An empty dict whose keys [`intern_used`] will intern in `interner`.
    pub(super) fn new(interner: &Interner) -> Self {
        SetDict {
            ids: Default::default(),
            sets: Vec::new(),
            used: Vec::new(),
            hashes: Vec::new(),
            hasher: interner.hasher(),
            buf: Vec::new(),
        }
    }

    /// The key of `set`, added (its selectors compiled) the first time it is met.
    pub(super) fn key(&mut self, set: RawSet<'_>) -> u32 {
        self.buf.clear();
        encode(&mut self.buf, set);
        // FxHash: these keys come from the cluster's own objects, not from a remote peer.
        if let Some(&id) = self.ids.get(self.buf.as_slice()) {
            return id;
        }
        let id = self.sets.len() as u32;
        self.sets.push(match set {
            RawSet::Namespaces(ns) => selector(ns).map(SetKey::Namespaces),
            RawSet::Pods(ns, p) => selector(ns).zip(selector(p)).map(|(n, p)| SetKey::Pods(n, p)),
            RawSet::InNamespace(ns, p) => selector(p).map(|p| SetKey::InNamespace(ns, p)),
        });
        self.used.push(false);
        self.hashes.push(0);
        self.ids.insert(self.buf.as_slice().into(), id);
        id
    }

    /// Marks `keys` used by something the pass keeps (a valid object's rules), so that
    /// [`intern_used`] gives them a pod set. Called on the worker that made the keys,
    /// right after the object is compiled. (Marked on the calling thread afterwards, the
    /// keys were a serial read of every compiled rule: with the bench's Antrea set, about
    /// 6 ms a compile of the calling thread's time by perf samples.)
    ///
    /// A key is hashed for the interner when first marked, while its strings are in this
    /// worker's cache.
    pub(super) fn mark_used(&mut self, keys: impl IntoIterator<Item = u32>) {
        for k in keys {
            let k = k as usize;
            if !std::mem::replace(&mut self.used[k], true)
                && let Some(key) = &self.sets[k]
            {
                self.hashes[k] = self.hasher.hash_one(key);
            }
        }
    }

    /// Whether key `k` names a pod set (its selectors compile).
    pub(super) fn resolves(&self, k: u32) -> bool {
        self.sets[k as usize].is_some()
    }
}

/// The workers' results (per worker, what it made of its range of `items` items, and its
/// dict), joined: everything made, in item order, and the dicts, in worker order.
pub(super) fn gather<P>(results: Vec<(Vec<P>, SetDict)>, items: usize) -> (Vec<P>, Vec<SetDict>) {
    let mut made = Vec::with_capacity(items);
    let mut dicts = Vec::with_capacity(results.len());
    for (p, d) in results {
        made.extend(p);
        dicts.push(d);
    }
    (made, dicts)
}

/// Resolves and interns in `c` the pod set of every key of `dicts` marked used
/// ([`SetDict::mark_used`]), in worker order, so set ids do not depend on thread timing.
/// Returns, per worker, the set id of each of its keys: [`SetId::MAX`] for a key not
/// marked or whose selectors do not compile. Workers' keys naming the same set meet in
/// the interner. `dicts` must have been made for `c`'s interner ([`SetDict::new`]).
pub(super) fn intern_used(c: &mut Cluster, dicts: Vec<SetDict>) -> Vec<Vec<SetId>> {
    dicts
        .into_iter()
        .map(|d| {
            (d.sets.into_iter().zip(d.used).zip(d.hashes))
                .map(|((set, used), hash)| match set {
                    Some(key) if used => c.intern_hashed(hash, key),
                    _ => SetId::MAX,
                })
                .collect()
        })
        .collect()
}

/// Appends an injective byte encoding of `set` to `out`: equal encodings ⇔ equal
/// [`RawSet`]s, selector for selector (a tag byte per kind, every string length-prefixed,
/// every optional field with a presence byte).
pub(super) fn encode(out: &mut Vec<u8>, set: RawSet<'_>) {
    match set {
        RawSet::Namespaces(ns) => {
            out.push(0);
            encode_selector(out, ns);
        }
        RawSet::Pods(ns, p) => {
            out.push(1);
            encode_selector(out, ns);
            encode_selector(out, p);
        }
        RawSet::InNamespace(ns, p) => {
            out.push(2);
            out.extend_from_slice(&ns.to_le_bytes());
            encode_selector(out, p);
        }
    }
}

/// Appends an injective byte encoding of `sel` to `out` (see [`encode`]).
fn encode_selector(out: &mut Vec<u8>, sel: SelectorRef<'_>) {
    fn put(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let SelectorRef { match_labels, match_expressions } = sel;
    match match_labels {
        None => out.push(0),
        Some(labels) => {
            out.push(1);
            out.extend_from_slice(&(labels.len() as u32).to_le_bytes());
            for (k, v) in labels.pairs() {
                put(out, k);
                put(out, v);
            }
        }
    }
    match match_expressions {
        None => out.push(0),
        Some(exprs) => {
            out.push(1);
            out.extend_from_slice(&(exprs.len() as u32).to_le_bytes());
            for e in exprs {
                put(out, &e.key);
                put(out, &e.operator);
                match &e.values {
                    None => out.push(0),
                    Some(values) => {
                        out.push(1);
                        out.extend_from_slice(&(values.len() as u32).to_le_bytes());
                        for v in values {
                            put(out, v);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::api::LabelSelector;

    fn r(s: &LabelSelector) -> SelectorRef<'_> {
        s.into()
    }

    #[test]
    fn keys_are_equal_exactly_when_kind_and_selectors_are() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;
        let labels = |pairs: &[(&str, &str)]| LabelSelector {
            match_labels: Some(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            match_expressions: None,
        };
        let expr = |values: Option<Vec<&str>>| LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "k".into(),
                operator: "In".into(),
                values: values.map(|v| v.into_iter().map(String::from).collect()),
            }]),
        };
        let distinct = [
            labels(&[("ab", "c")]),
            labels(&[("a", "bc")]),
            labels(&[("a", "b"), ("c", "d")]),
            labels(&[]),
            LabelSelector::default(),
            expr(None),
            expr(Some(vec![])),
            expr(Some(vec!["a", "b"])),
            expr(Some(vec!["ab"])),
        ];
        let key = |set: RawSet<'_>| {
            let mut k = Vec::new();
            encode(&mut k, set);
            k
        };
        for (i, a) in distinct.iter().enumerate() {
            let copy = a.clone();
            assert_eq!(key(RawSet::Namespaces(r(a))), key(RawSet::Namespaces(r(&copy))));
            for (j, b) in distinct.iter().enumerate() {
                let same = |x: RawSet<'_>, y: RawSet<'_>| key(x) == key(y);
                assert_eq!(i == j, same(RawSet::Namespaces(r(a)), RawSet::Namespaces(r(b))));
                assert_eq!(i == j, same(RawSet::Pods(r(a), r(a)), RawSet::Pods(r(b), r(a))));
                assert_eq!(i == j, same(RawSet::Pods(r(a), r(a)), RawSet::Pods(r(a), r(b))));
                assert_eq!(
                    i == j,
                    same(RawSet::InNamespace(7, r(a)), RawSet::InNamespace(7, r(b))),
                    "{a:?} vs {b:?}"
                );
                // Kinds never share a key, nor do two namespaces.
                assert!(!same(RawSet::Namespaces(r(a)), RawSet::Pods(r(b), r(a))));
                assert!(!same(RawSet::Namespaces(r(a)), RawSet::InNamespace(0, r(b))));
                assert!(!same(RawSet::Pods(r(a), r(b)), RawSet::InNamespace(0, r(b))));
                assert!(!same(RawSet::InNamespace(1, r(a)), RawSet::InNamespace(2, r(a))));
            }
        }
        // The empty selector written out and the `EVERYTHING` stand-in are one key.
        assert_eq!(key(RawSet::Namespaces(EVERYTHING)), key(RawSet::Namespaces(r(&distinct[4]))));
    }

    #[test]
    fn a_dict_compiles_each_distinct_set_once_and_marks_those_that_do_not_compile() {
        let mut dict = SetDict::new(&Interner::default());
        let web =
            LabelSelector { match_labels: Some([("app", "web")].into()), match_expressions: None };
        let bad = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "k".into(),
                    operator: "Near".into(),
                    values: None,
                },
            ]),
        };
        let a = dict.key(RawSet::Pods(EVERYTHING, (&web).into()));
        let b = dict.key(RawSet::InNamespace(3, (&web).into()));
        assert_eq!(a, dict.key(RawSet::Pods(EVERYTHING, (&web.clone()).into())));
        assert_ne!(a, b);
        let c = dict.key(RawSet::Namespaces((&bad).into()));
        assert_eq!(dict.sets.len(), 3);
        assert!(dict.resolves(a) && dict.resolves(b));
        assert!(!dict.resolves(c), "an unknown operator names no set");
        assert!(matches!(dict.sets[b as usize], Some(SetKey::InNamespace(3, _))));
    }

    /// A key gets a pod set only when marked used (by a valid object's rules), and a
    /// key two workers share gets one set.
    #[test]
    fn only_keys_marked_used_are_interned() {
        let sel = |app: &str| LabelSelector {
            match_labels: Some([("app", app)].into()),
            match_expressions: None,
        };
        let (web, db) = (sel("web"), sel("db"));
        let mut cluster = Cluster::default();
        let mut one = SetDict::new(&cluster.interner);
        let a = one.key(RawSet::Namespaces((&web).into()));
        let b = one.key(RawSet::Namespaces((&db).into()));
        one.mark_used([a, a]);
        let mut two = SetDict::new(&cluster.interner);
        let c = two.key(RawSet::Namespaces((&db).into()));
        let d = two.key(RawSet::Namespaces((&web).into()));
        two.mark_used([d]);
        let ids = intern_used(&mut cluster, vec![one, two]);
        assert_eq!(ids[0][b as usize], SetId::MAX, "not marked");
        assert_eq!(ids[1][c as usize], SetId::MAX, "not marked");
        assert_ne!(ids[0][a as usize], SetId::MAX);
        assert_eq!(ids[0][a as usize], ids[1][d as usize], "one set for one key");
        assert_eq!(cluster.interner.sets.len(), 1);
    }
}
