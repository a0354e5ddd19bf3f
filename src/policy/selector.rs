//! Label selectors, compiled once and resolved through inverted label indexes.
//!
//! Source: `metav1.LabelSelector` ("A label selector is a label query over a set of
//! resources. The result of matchLabels and matchExpressions are ANDed. An empty label
//! selector matches all objects. A null label selector matches no objects.") and
//! `LabelSelectorRequirement` (operators In, NotIn, Exists, DoesNotExist; "NotIn" also
//! matches objects without the key, as `labels.Selector` does).
//!
//! Resolution never scans objects per selector: a [`LabelIndex`] maps each `key=value` and
//! each key to the set of object ids carrying it, and a selector becomes a few bitmap
//! intersections and differences.

use std::collections::HashMap;

use compact_str::CompactString;
use roaring::RoaringBitmap;

use super::api::SelectorRef;
use super::labels::LabelSet;

/// One compiled requirement of a selector. Keys and values are kept in place while they
/// fit (`CompactString`, up to 24 bytes; a label key's name part has at most 63, a value
/// at most 63, most are a few), and a single value needs no list: a compile makes tens of
/// thousands of selectors from the policies' peers, and each `String` was an allocation
/// to make, hash through and free.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Requirement {
    /// `key` has this value (a `matchLabels` entry, or `In` with one distinct value).
    Is(CompactString, CompactString),
    /// `key` has one of the values (two or more; none where validation was skipped,
    /// matching nothing).
    In(CompactString, Vec<CompactString>),
    /// `key` is absent or has none of the values.
    NotIn(CompactString, Vec<CompactString>),
    /// `key` is present.
    Exists(CompactString),
    /// `key` is absent.
    DoesNotExist(CompactString),
}

/// A compiled label selector: requirements ANDed, in a canonical order so that equal
/// selectors compare (and intern) equal. No requirements = matches everything.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Selector {
    reqs: Vec<Requirement>,
}

/// An operator outside In/NotIn/Exists/DoesNotExist. Validation reports it first; a
/// selector that still holds one is compiled to match nothing (fail closed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown label selector operator {0:?}")]
pub struct UnknownOperator(pub String);

impl Selector {
    /// The selector that matches everything (`{}`).
    pub fn everything() -> Self {
        Selector::default()
    }

    /// Compiles a `metav1.LabelSelector`: the policy CRDs' [`super::api::LabelSelector`] or
    /// k8s-openapi's (NetworkPolicy), as `(&sel).into()`.
    ///
    /// # Errors
    /// [`UnknownOperator`] for an operator this engine does not know.
    pub fn compile(sel: SelectorRef<'_>) -> Result<Self, UnknownOperator> {
        let SelectorRef { match_labels, match_expressions } = sel;
        let mut reqs = Vec::new();
        if let Some(labels) = match_labels {
            for (k, v) in labels.pairs() {
                reqs.push(Requirement::Is(k.into(), v.into()));
            }
        }
        for e in match_expressions.into_iter().flatten() {
            let mut values: Vec<CompactString> =
                e.values.iter().flatten().map(|v| v.as_str().into()).collect();
            values.sort();
            values.dedup();
            let key = CompactString::from(e.key.as_str());
            reqs.push(match e.operator.as_str() {
                "In" if values.len() == 1 => Requirement::Is(key, values.pop().expect("one value")),
                "In" => Requirement::In(key, values),
                "NotIn" => Requirement::NotIn(key, values),
                "Exists" => Requirement::Exists(key),
                "DoesNotExist" => Requirement::DoesNotExist(key),
                other => return Err(UnknownOperator(other.to_string())),
            });
        }
        reqs.sort();
        reqs.dedup();
        Ok(Selector { reqs })
    }

    /// `true` if the selector has no requirement and so matches every object.
    pub fn is_everything(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Matches one label set directly (used by tests and for single objects).
    pub fn matches(&self, labels: &impl LabelSet) -> bool {
        self.reqs.iter().all(|r| match r {
            Requirement::Is(k, v) => labels.label(k) == Some(v.as_str()),
            Requirement::In(k, vs) => labels.label(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            Requirement::NotIn(k, vs) => labels.label(k).is_none_or(|v| !vs.iter().any(|x| x == v)),
            Requirement::Exists(k) => labels.label(k).is_some(),
            Requirement::DoesNotExist(k) => labels.label(k).is_none(),
        })
    }
}

/// An inverted index from labels to object ids (pods, namespaces or nodes).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct LabelIndex {
    all: RoaringBitmap,
    by_key: ByLabel<RoaringBitmap>,
    /// Key → value → ids: looked up by `&str` without building an owned key.
    by_value: ByLabel<ByLabel<RoaringBitmap>>,
}

/// A map by label key or value, hashed with foldhash (randomly seeded per map): a compile
/// looks labels up for every pod and selector, and the standard SipHash took a few per cent
/// of it.
type ByLabel<V> = HashMap<String, V, foldhash::fast::RandomState>;

/// `map[key]`, inserting an empty value first if needed; clones `key` only then.
fn slot<'m, V: Default>(map: &'m mut ByLabel<V>, key: &str) -> &'m mut V {
    if !map.contains_key(key) {
        map.insert(key.to_owned(), V::default());
    }
    map.get_mut(key).expect("inserted above")
}

impl LabelIndex {
    /// Adds object `id` with `labels`. Ids need not be dense.
    pub fn insert(&mut self, id: u32, labels: &impl LabelSet) {
        self.all.insert(id);
        for (k, v) in labels.pairs() {
            slot(&mut self.by_key, k).insert(id);
            slot(slot(&mut self.by_value, k), v).insert(id);
        }
    }

    /// Removes object `id`, which was inserted with `labels`; entries left empty go, so
    /// the index is as if `id` had never been inserted.
    pub fn remove(&mut self, id: u32, labels: &impl LabelSet) {
        self.all.remove(id);
        for (k, v) in labels.pairs() {
            if let Some(ids) = self.by_key.get_mut(k) {
                ids.remove(id);
                if ids.is_empty() {
                    self.by_key.remove(k);
                }
            }
            if let Some(values) = self.by_value.get_mut(k) {
                if let Some(ids) = values.get_mut(v) {
                    ids.remove(id);
                    if ids.is_empty() {
                        values.remove(v);
                    }
                }
                if values.is_empty() {
                    self.by_value.remove(k);
                }
            }
        }
    }

    /// Adds every object of `other`, an index of other ids (a part of the objects indexed
    /// on another thread): the result is the index of both parts' objects.
    pub fn merge(&mut self, other: LabelIndex) {
        self.all |= other.all;
        for (k, ids) in other.by_key {
            *self.by_key.entry(k).or_default() |= ids;
        }
        for (k, values) in other.by_value {
            let mine = self.by_value.entry(k).or_default();
            for (v, ids) in values {
                *mine.entry(v).or_default() |= ids;
            }
        }
    }

    /// All indexed ids.
    pub fn all(&self) -> &RoaringBitmap {
        &self.all
    }

    /// Each value label `key` takes, with the ids that carry it (in no particular order;
    /// empty when no object has the key).
    pub fn values(&self, key: &str) -> impl Iterator<Item = (&str, &RoaringBitmap)> {
        self.by_value.get(key).into_iter().flatten().map(|(v, ids)| (v.as_str(), ids))
    }

    /// The ids carrying `key=value`.
    fn with_value(&self, key: &str, value: &str) -> Option<&RoaringBitmap> {
        self.by_value.get(key)?.get(value)
    }

    /// The ids `sel` matches.
    pub fn resolve(&self, sel: &Selector) -> RoaringBitmap {
        self.resolve_in(&self.all, sel)
    }

    /// The ids of `within` that `sel` matches: `within & resolve(sel)`, computed from
    /// `within` down, so that a selector applied to a few ids (a namespace's pods) costs
    /// what those ids do, not a copy of every id and of each value's ids.
    pub fn resolve_in(&self, within: &RoaringBitmap, sel: &Selector) -> RoaringBitmap {
        let mut out = within.clone();
        for r in &sel.reqs {
            if out.is_empty() {
                break;
            }
            match r {
                Requirement::Is(k, v) => match self.with_value(k, v) {
                    Some(b) => out &= b,
                    None => out.clear(),
                },
                Requirement::In(k, vs) => {
                    let mut any = RoaringBitmap::new();
                    for b in vs.iter().filter_map(|v| self.with_value(k, v)) {
                        any |= &out & b;
                    }
                    out = any;
                }
                Requirement::NotIn(k, vs) => {
                    for b in vs.iter().filter_map(|v| self.with_value(k, v)) {
                        out -= b;
                    }
                }
                Requirement::Exists(k) => match self.by_key.get(k.as_str()) {
                    Some(b) => out &= b,
                    None => out.clear(),
                },
                Requirement::DoesNotExist(k) => {
                    if let Some(b) = self.by_key.get(k.as_str()) {
                        out -= b;
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::api::{LabelSelector, LabelSelectorRequirement};
    use crate::policy::labels::Labels;
    use std::collections::BTreeMap;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|s| s.to_string()).collect()),
        }
    }

    fn sel(ml: &[(&str, &str)], me: Vec<LabelSelectorRequirement>) -> Selector {
        Selector::compile(
            (&LabelSelector {
                match_labels: Some(Labels::from(labels(ml))),
                match_expressions: Some(me),
            })
                .into(),
        )
        .unwrap()
    }

    /// The index of `objs`, object `i` as id `i`.
    fn index_of(objs: &[BTreeMap<String, String>]) -> LabelIndex {
        let mut idx = LabelIndex::default();
        for (i, l) in objs.iter().enumerate() {
            idx.insert(i as u32, l);
        }
        idx
    }

    #[test]
    fn index_resolution_agrees_with_direct_matching() {
        let objs = [
            labels(&[("app", "web"), ("tier", "fe")]),
            labels(&[("app", "db")]),
            labels(&[]),
            labels(&[("tier", "be"), ("app", "web")]),
        ];
        let idx = index_of(&objs);
        let cases = [
            sel(&[], vec![]),
            sel(&[("app", "web")], vec![]),
            sel(&[], vec![expr("app", "NotIn", &["web"])]),
            sel(&[], vec![expr("tier", "Exists", &[])]),
            sel(&[], vec![expr("tier", "DoesNotExist", &[])]),
            sel(&[("app", "web")], vec![expr("tier", "In", &["be", "x"])]),
            sel(&[("missing", "x")], vec![]),
        ];
        for s in &cases {
            let direct: RoaringBitmap =
                (0..objs.len() as u32).filter(|&i| s.matches(&objs[i as usize])).collect();
            assert_eq!(idx.resolve(s), direct, "{s:?}");
        }
    }

    /// Objects with a few keys, some values shared and some each object's own.
    fn many_objects(n: u32) -> Vec<BTreeMap<String, String>> {
        (0..n)
            .map(|i| {
                let mut l = BTreeMap::new();
                l.insert("app".to_string(), format!("a{}", i % 7));
                if i % 3 != 0 {
                    l.insert("tier".to_string(), ["fe", "be"][i as usize % 2].to_string());
                }
                if i % 5 == 0 {
                    l.insert("hash".to_string(), format!("h{i}"));
                }
                l
            })
            .collect()
    }

    #[test]
    fn an_index_merged_from_parts_is_the_index_of_the_whole() {
        let objs = many_objects(300);
        let whole = index_of(&objs);
        for cuts in [vec![0, 300], vec![0, 1, 300], vec![0, 120, 121, 299, 300], vec![0, 0, 300]] {
            let mut merged = LabelIndex::default();
            for w in cuts.windows(2) {
                let mut part = LabelIndex::default();
                for (i, labels) in objs.iter().enumerate().take(w[1]).skip(w[0]) {
                    part.insert(i as u32, labels);
                }
                merged.merge(part);
            }
            assert!(merged == whole, "cut at {cuts:?}");
        }
    }

    #[test]
    fn resolving_within_ids_is_resolving_then_intersecting() {
        let objs = many_objects(200);
        let idx = index_of(&objs);
        let cases = [
            sel(&[], vec![]),
            sel(&[("app", "a3")], vec![]),
            sel(&[("app", "a3"), ("tier", "fe")], vec![]),
            sel(&[], vec![expr("app", "In", &["a1", "a2", "nope"])]),
            sel(&[], vec![expr("app", "NotIn", &["a1", "a2"])]),
            sel(&[], vec![expr("tier", "Exists", &[])]),
            sel(&[], vec![expr("tier", "DoesNotExist", &[])]),
            sel(&[("missing", "x")], vec![]),
            sel(&[], vec![expr("hash", "In", &["h10", "h15"]), expr("app", "NotIn", &["a3"])]),
        ];
        let withins: [RoaringBitmap; 4] = [
            RoaringBitmap::new(),
            (0..200).collect(),
            (40..60).collect(),
            (0..200).step_by(7).collect(),
        ];
        for s in &cases {
            for w in &withins {
                assert_eq!(idx.resolve_in(w, s), w & idx.resolve(s), "{s:?} within {w:?}");
            }
            let direct: RoaringBitmap =
                (0..200).filter(|&i| s.matches(&objs[i as usize])).collect();
            assert_eq!(idx.resolve(s), direct, "{s:?}");
        }
    }

    #[test]
    fn not_in_matches_objects_without_the_key() {
        let s = sel(&[], vec![expr("env", "NotIn", &["prod"])]);
        assert!(s.matches(&labels(&[])));
        assert!(!s.matches(&labels(&[("env", "prod")])));
    }

    #[test]
    fn equal_selectors_compile_equal() {
        let a = sel(&[("a", "1"), ("b", "2")], vec![expr("c", "In", &["y", "x"])]);
        let b = sel(&[("b", "2"), ("a", "1")], vec![expr("c", "In", &["x", "y", "x"])]);
        assert_eq!(a, b);
        // A `matchLabels` entry and an `In` of one distinct value are one requirement, and
        // an `In` of none matches nothing.
        let one = sel(&[("c", "x")], vec![]);
        assert_eq!(one, sel(&[], vec![expr("c", "In", &["x", "x"])]));
        assert!(one.matches(&labels(&[("c", "x")])) && !one.matches(&labels(&[("c", "y")])));
        let none = sel(&[], vec![expr("c", "In", &[])]);
        assert!(!none.matches(&labels(&[("c", "x")])));
        assert!(index_of(&[labels(&[("c", "x")])]).resolve(&none).is_empty());
    }

    #[test]
    fn both_selector_kinds_compile_alike() {
        // The policy CRDs' compact selector and NetworkPolicy's k8s-openapi one, from the
        // same JSON (a repeated key keeps its last value in both).
        let json = r#"{"matchLabels": {"b": "2", "a": "1", "b": "3"},
                       "matchExpressions": [{"key": "c", "operator": "In", "values": ["x"]}]}"#;
        let compact: LabelSelector = serde_json::from_str(json).unwrap();
        let map: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
            serde_json::from_str(json).unwrap();
        let want = sel(&[("a", "1"), ("b", "3")], vec![expr("c", "In", &["x"])]);
        assert_eq!(Selector::compile((&compact).into()).unwrap(), want);
        assert_eq!(Selector::compile((&map).into()).unwrap(), want);
        // And they encode back to the same JSON.
        assert_eq!(serde_json::to_value(&compact).unwrap(), serde_json::to_value(&map).unwrap());
        for absent in ["{}", r#"{"matchLabels": null, "matchExpressions": null}"#] {
            let compact: LabelSelector = serde_json::from_str(absent).unwrap();
            assert_eq!(compact, LabelSelector::default(), "{absent}");
            assert_eq!(serde_json::to_string(&compact).unwrap(), "{}");
        }
    }

    #[test]
    fn unknown_operator_is_an_error() {
        let s = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![expr("a", "Gt", &["1"])]),
        };
        assert_eq!(Selector::compile((&s).into()), Err(UnknownOperator("Gt".into())));
    }
}
