//! Label sets as the engine stores and reads them.
//!
//! Source: `metav1.ObjectMeta.labels` and `metav1.LabelSelector.matchLabels`, both
//! `map[string]string` on the wire. k8s-openapi decodes them into `BTreeMap<String, String>`,
//! whose every map allocates a 544-byte node and every string its own block: about 650
//! bytes for a one-label selector. A cluster store holds tens of thousands of such maps
//! (10,000 pods; 100 AdminNetworkPolicies of 100 rules hold 100,000 peers with two
//! selectors each), so the stores keep [`Labels`] instead: one sorted slice of inline
//! strings, 48 bytes per label and no allocation beyond the slice for keys and values of up
//! to 24 bytes (every label key without a prefix is at most 63 bytes; most are short).
//!
//! [`LabelSet`] reads either form, so the compiler and validation serve both the stores
//! and whole k8s-openapi objects from manifests.

use std::collections::BTreeMap;
use std::fmt;

use compact_str::CompactString;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A label map: pairs sorted by key, keys unique. Decodes from and encodes to a JSON/YAML
/// map, as `map[string]string` does; a key repeated in the input keeps its last value, as
/// Go's decoder and serde's `BTreeMap` do.
///
/// Immutable once built: build it from a map or from pairs ([`FromIterator`]).
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Box<[(CompactString, CompactString)]>);

impl Labels {
    /// The value of `key`, by binary search.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key)).ok().map(|i| self.0[i].1.as_str())
    }

    /// `true` if `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// The pairs in key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.into_iter()
    }

    /// The pair with the smallest key.
    pub fn first(&self) -> Option<(&str, &str)> {
        self.0.first().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The number of labels.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// `true` without labels.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: AsRef<str>, V: AsRef<str>> FromIterator<(K, V)> for Labels {
    /// Pairs in any order; of a repeated key the last value is kept.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let mut v: Vec<(CompactString, CompactString)> = pairs
            .into_iter()
            .map(|(k, v)| (CompactString::from(k.as_ref()), CompactString::from(v.as_ref())))
            .collect();
        // A stable sort keeps repeated keys in input order; the dedup then keeps the last.
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.reverse();
        v.dedup_by(|later, earlier| later.0 == earlier.0);
        v.reverse();
        Labels(v.into_boxed_slice())
    }
}

impl<K: AsRef<str>, V: AsRef<str>, const N: usize> From<[(K, V); N]> for Labels {
    /// As [`FromIterator`], like `BTreeMap::from([...])`.
    fn from(pairs: [(K, V); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        map.iter().collect()
    }
}

impl From<&BTreeMap<String, String>> for Labels {
    fn from(map: &BTreeMap<String, String>) -> Self {
        map.iter().collect()
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a str, &'a str);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (CompactString, CompactString)>,
        fn(&'a (CompactString, CompactString)) -> (&'a str, &'a str),
    >;
    /// The pairs in key order.
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Labels {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MapVisitor;
        impl<'de> Visitor<'de> for MapVisitor {
            type Value = Labels;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of label keys to string values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Labels, A::Error> {
                let mut pairs: Vec<(CompactString, CompactString)> =
                    Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some(pair) = map.next_entry()? {
                    pairs.push(pair);
                }
                Ok(pairs.into_iter().collect())
            }
        }
        d.deserialize_map(MapVisitor)
    }
}

/// Read access to a label map, stored as [`Labels`] or as k8s-openapi's `BTreeMap`.
pub trait LabelSet {
    /// The value of `key`.
    fn label(&self, key: &str) -> Option<&str>;
    /// The pairs in key order.
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)>;
}

impl LabelSet for Labels {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key)
    }
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.iter()
    }
}

impl LabelSet for BTreeMap<String, String> {
    fn label(&self, key: &str) -> Option<&str> {
        self.get(key).map(String::as_str)
    }
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// A borrowed label map of either form.
#[derive(Debug, Clone, Copy)]
pub enum LabelsRef<'a> {
    /// k8s-openapi's map (whole objects from manifests).
    Map(&'a BTreeMap<String, String>),
    /// The compact form (the cluster stores).
    Compact(&'a Labels),
}

impl LabelsRef<'_> {
    /// The number of labels.
    pub fn len(&self) -> usize {
        match self {
            LabelsRef::Map(m) => m.len(),
            LabelsRef::Compact(l) => l.len(),
        }
    }

    /// `true` without labels.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pair with the smallest key.
    pub fn first(&self) -> Option<(&str, &str)> {
        match self {
            LabelsRef::Map(m) => m.first_key_value().map(|(k, v)| (k.as_str(), v.as_str())),
            LabelsRef::Compact(l) => l.first(),
        }
    }
}

impl LabelSet for LabelsRef<'_> {
    fn label(&self, key: &str) -> Option<&str> {
        match self {
            LabelsRef::Map(m) => m.label(key),
            LabelsRef::Compact(l) => l.get(key),
        }
    }
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        match *self {
            LabelsRef::Map(m) => Pairs::Map(m.iter()),
            LabelsRef::Compact(l) => Pairs::Compact(l.0.iter()),
        }
    }
}

/// The pairs of a [`LabelsRef`] in key order, one branch on the form per pair. (A chain
/// of two `Option` iterators in its place made validating the bench's hundred
/// AdminNetworkPolicies of a hundred rules, two million selectors, take 1.13x as long on
/// one thread.)
enum Pairs<'a> {
    Map(std::collections::btree_map::Iter<'a, String, String>),
    Compact(std::slice::Iter<'a, (CompactString, CompactString)>),
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a str, &'a str);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Pairs::Map(i) => i.next().map(|(k, v)| (k.as_str(), v.as_str())),
            Pairs::Compact(i) => i.next().map(|(k, v)| (k.as_str(), v.as_str())),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            Pairs::Map(i) => i.size_hint(),
            Pairs::Compact(i) => i.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_as_a_map_sorted_and_with_the_last_of_a_repeated_key() {
        let l: Labels = serde_json::from_str(r#"{"b": "2", "a": "1", "b": "3"}"#).unwrap();
        assert_eq!(l.iter().collect::<Vec<_>>(), [("a", "1"), ("b", "3")]);
        // The same as k8s-openapi's map reads.
        let m: BTreeMap<String, String> =
            serde_json::from_str(r#"{"b": "2", "a": "1", "b": "3"}"#).unwrap();
        assert_eq!(Labels::from(&m), l);
        assert_eq!(serde_json::to_string(&l).unwrap(), r#"{"a":"1","b":"3"}"#);
        assert_eq!(format!("{l:?}"), r#"{"a": "1", "b": "3"}"#);
    }

    #[test]
    fn lookups_agree_with_the_map() {
        let keys = ["app", "app.kubernetes.io/name", "team", "a-very-long-key-beyond-24-bytes", ""];
        let m: BTreeMap<String, String> =
            keys.iter().enumerate().map(|(i, k)| (k.to_string(), format!("v{i}"))).collect();
        let l = Labels::from(&m);
        for k in keys.iter().chain(&["missing", "ap", "teams"]) {
            assert_eq!(l.get(k), m.label(k), "{k}");
            assert_eq!(LabelsRef::Compact(&l).label(k), LabelsRef::Map(&m).label(k), "{k}");
        }
        assert!(LabelsRef::Compact(&l).pairs().eq(LabelsRef::Map(&m).pairs()));
        assert_eq!(LabelsRef::Compact(&l).first(), LabelsRef::Map(&m).first());
        assert_eq!(l.len(), m.len());
    }

    #[test]
    fn rejects_what_is_not_a_string_map() {
        let err = serde_json::from_str::<Labels>(r#"{"a": 1}"#).unwrap_err();
        assert!(err.to_string().contains("expected a string"), "{err}");
        assert!(serde_json::from_str::<Labels>(r#"["a"]"#).is_err());
    }
}
