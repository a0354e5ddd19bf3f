//! Antrea Tiers: the table that maps a Tier name to its priority, from the six static
//! Tiers and the Tier objects given, with the admission rules Antrea applies to Tiers.
//!
//! A policy's place in Antrea's global order starts with its Tier's priority
//! (`shared/reference/antrea-model.md` §2–§3); the compiler will look names up here.
//!
//! Sources (antrea-io/antrea): `pkg/controller/networkpolicy/tier.go` (`priorityMap`,
//! `staticTierSet`, `maxSupportedTiers`), `validate.go` (`reservedTierPriorities`,
//! `tierValidator.createValidate` / `updateValidate`, `validateTierForPolicy`),
//! `crd_utils.go` (`getTierPriority`), `mutate.go` (`mutateAntreaPolicy`: an omitted tier
//! becomes `application`), `docs/cluster-network-policy.md` ("Reserved Tier Priority": 220
//! while the ClusterNetworkPolicy feature gate is on), and the CRD
//! `build/charts/antrea/crds/tier.yaml` (`priority` 0–255).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::api::antrea::Tier;
use super::problem::{Kind, Problem, ProblemKind};
use super::validate;

/// The Tiers antrea-controller creates at start-up, read-only, by name and priority.
/// They exist whether or not a manifest holds their objects.
///
/// Source: `tier.go` `priorityMap` (`crdv1beta1.DefaultTierPriority` 250,
/// `BaselineTierPriority` 253).
pub const STATIC_TIERS: [(&str, u8); 6] = [
    ("emergency", 50),
    ("securityops", 100),
    ("networkops", 150),
    ("platform", 200),
    ("application", 250),
    ("baseline", 253),
];

/// The Tier of a policy without `spec.tier`. Source: `mutate.go` `mutateAntreaPolicy`
/// ("Mutate empty tier name to the name of the Default application Tier").
pub const DEFAULT_TIER: &str = "application";

/// The Tier evaluated after NetworkPolicy, where `Pass` is refused. Source: `tier.go`
/// `baselineTierName`.
pub const BASELINE_TIER: &str = "baseline";

/// The legacy (Antrea 0.9) spellings of the static Tiers, which alone are mapped to their
/// lowercase object names; no other name is case-folded. Source: `tier.go`
/// `staticTierSet`, `crd_utils.go` `getTierPriority`.
pub const LEGACY_TIER_NAMES: [&str; 6] =
    ["Emergency", "SecurityOps", "NetworkOps", "Platform", "Application", "Baseline"];

/// Priorities no Tier object may take: 251, 252, 254 and 255 (`validate.go`
/// `reservedTierPriorities`: around the ANP, NetworkPolicy and BANP tables), and 220, the
/// place of upstream ClusterNetworkPolicy `tier: Admin` (`cnpAdminTierPriority`, refused
/// for new Tiers while the ClusterNetworkPolicy feature gate is on; tierproxy always
/// reads upstream ClusterNetworkPolicy, so always refuses it). The static priorities are
/// taken by the static Tiers.
pub const RESERVED_PRIORITIES: [i32; 5] = [220, 251, 252, 254, 255];

/// Largest Tier priority. Source: CRD `tier.yaml` `maximum: 255`.
pub const MAX_TIER_PRIORITY: i32 = 255;

/// Most Tiers (static ones included). Source: `tier.go` `maxSupportedTiers = 20`, a soft
/// limit the webhook enforces when a Tier is created.
pub const MAX_TIERS: usize = 20;

/// Where a Tier of the table comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// One of [`STATIC_TIERS`].
    Static,
    /// A Tier object of the input.
    Object,
}

/// One Tier of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierEntry {
    /// 0–255, lower first.
    pub priority: u8,
    /// Static or from an object.
    pub origin: Origin,
}

/// Tier name → priority: the static Tiers and every admitted Tier object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierTable {
    by_name: BTreeMap<String, TierEntry>,
}

impl Default for TierTable {
    /// The static Tiers alone.
    fn default() -> Self {
        let by_name = STATIC_TIERS
            .iter()
            .map(|(n, p)| ((*n).to_owned(), TierEntry { priority: *p, origin: Origin::Static }))
            .collect();
        TierTable { by_name }
    }
}

/// The object name a policy's `spec.tier` refers to: `""` → [`DEFAULT_TIER`], a legacy
/// static spelling → its lowercase name, anything else as written (no case folding:
/// `EMERGENCY` names no Tier).
pub fn tier_object_name(tier: &str) -> std::borrow::Cow<'_, str> {
    if tier.is_empty() {
        DEFAULT_TIER.into()
    } else if LEGACY_TIER_NAMES.contains(&tier) {
        tier.to_ascii_lowercase().into()
    } else {
        tier.into()
    }
}

impl TierTable {
    /// The table of the static Tiers and `tiers`, in input order (the order a `kubectl
    /// apply` of the same files would create them in, which decides which of two Tiers
    /// with one priority is refused). Each Tier object is validated
    /// ([`validate::antrea_tier`]); then, as Antrea's webhook does on create:
    ///
    /// - a static Tier's object must carry its static priority (Tier priority is
    ///   immutable: "update to Tier priority is not allowed"); with it, it is admitted and
    ///   changes nothing;
    /// - a custom Tier may not take a [`RESERVED_PRIORITIES`] value ("tier X priority P is
    ///   reserved"), nor the priority of a static or earlier admitted Tier ("overlaps with
    ///   existing Tier"), nor be created beyond [`MAX_TIERS`] Tiers.
    ///
    /// Problems go to `out` (errors at `spec.priority`). `tiers` must hold one object per
    /// name (the loader keeps the last of duplicates). Returns the table and the admitted
    /// objects.
    pub fn build(tiers: &[Arc<Tier>], out: &mut Vec<Problem>) -> (TierTable, Vec<Arc<Tier>>) {
        let mut table = TierTable::default();
        let mut admitted = Vec::new();
        for t in tiers {
            let start = out.len();
            validate::antrea_tier(t, out);
            if out[start..].iter().any(Problem::is_error) {
                continue;
            }
            let name = t.metadata.name.as_deref().unwrap_or_default();
            let object = validate::object_ref(Kind::AntreaTier, &t.metadata);
            let prio = t.spec.priority;
            let refuse = |out: &mut Vec<Problem>, reason: String| {
                out.push(Problem::error(
                    &object,
                    "spec.priority",
                    ProblemKind::Invalid { value: prio.to_string(), reason },
                ));
            };
            if let Some(&(_, fixed)) = STATIC_TIERS.iter().find(|(n, _)| *n == name) {
                if prio == i32::from(fixed) {
                    admitted.push(t.clone());
                } else {
                    refuse(
                        out,
                        format!(
                            "{name} is a static Tier of priority {fixed}; a Tier's priority \
                             cannot be changed"
                        ),
                    );
                }
                continue;
            }
            if RESERVED_PRIORITIES.contains(&prio) {
                let why = if prio == 220 {
                    "reserved for upstream ClusterNetworkPolicy tier Admin"
                } else {
                    "reserved"
                };
                refuse(out, format!("Tier priority {prio} is {why}"));
                continue;
            }
            // 0..=255 here: validate::antrea_tier refused the rest.
            let Ok(p) = u8::try_from(prio) else { continue };
            if let Some((other, _)) = table.by_name.iter().find(|(_, e)| e.priority == p) {
                refuse(out, format!("overlaps with the priority of Tier {other}"));
                continue;
            }
            if table.by_name.len() >= MAX_TIERS {
                refuse(out, format!("the maximum number of Tiers supported is {MAX_TIERS}"));
                continue;
            }
            table
                .by_name
                .insert(name.to_owned(), TierEntry { priority: p, origin: Origin::Object });
            admitted.push(t.clone());
        }
        (table, admitted)
    }

    /// The Tier a policy's `spec.tier` names ([`tier_object_name`]), if it exists.
    pub fn get(&self, tier: &str) -> Option<TierEntry> {
        self.by_name.get(tier_object_name(tier).as_ref()).copied()
    }

    /// Every Tier, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, TierEntry)> {
        self.by_name.iter().map(|(n, e)| (n.as_str(), *e))
    }
}

/// Orders Tiers as Antrea's API server admitted them: by `metadata.creationTimestamp`
/// (objects without one, as in manifests, last), then by name. Of two Tiers with one
/// priority [`TierTable::build`] admits the first and refuses the other, as the webhook
/// refused the later one ("overlaps with existing Tier"), so every reader of the same
/// objects (each agent, `explain`) refuses the same one whatever order it got them in.
/// Timestamps have a resolution of one second: two Tiers created within one are told apart
/// by name.
pub fn creation_order(tiers: &mut [Arc<Tier>]) {
    tiers.sort_by(|a, b| {
        let key = |t: &Tier| {
            let created = t.metadata.creation_timestamp.as_ref().map(|t| t.0);
            (created.is_none(), created, t.metadata.name.clone())
        };
        key(a).cmp(&key(b))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::problem::Severity;

    fn tier(name: &str, priority: i32) -> Arc<Tier> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "crd.antrea.io/v1beta1", "kind": "Tier",
                "metadata": {"name": name}, "spec": {"priority": priority}
            }))
            .unwrap(),
        )
    }

    /// (object, field, message) of each problem; all must be errors.
    fn errors(out: &[Problem]) -> Vec<(String, String)> {
        out.iter()
            .map(|p| {
                assert_eq!(p.severity, Severity::Error, "{p}");
                (p.object.name.clone(), p.kind.to_string())
            })
            .collect()
    }

    #[test]
    fn static_tiers_exist_without_objects() {
        let (t, admitted) = TierTable::build(&[], &mut Vec::new());
        assert!(admitted.is_empty());
        let got: Vec<(&str, u8)> = t.iter().map(|(n, e)| (n, e.priority)).collect();
        let mut want = STATIC_TIERS.to_vec();
        want.sort();
        assert_eq!(got, want);
        assert!(t.iter().all(|(_, e)| e.origin == Origin::Static));
    }

    /// `tier` omitted → application; the six legacy spellings map to lowercase, nothing
    /// else is case-folded (`crd_utils.go getTierPriority`, `validate.go
    /// validateTierForPolicy`).
    #[test]
    fn tier_names_resolve_as_antrea_resolves_them() {
        let t = TierTable::default();
        assert_eq!(t.get("").map(|e| e.priority), Some(250));
        assert_eq!(t.get("SecurityOps").map(|e| e.priority), Some(100));
        assert_eq!(t.get("Baseline").map(|e| e.priority), Some(253));
        assert_eq!(t.get("securityops").map(|e| e.priority), Some(100));
        assert_eq!(t.get("EMERGENCY"), None);
        assert_eq!(t.get("Securityops"), None);
        assert_eq!(t.get("custom"), None);
    }

    #[test]
    fn custom_tiers_are_added() {
        let mut out = Vec::new();
        let (t, admitted) = TierTable::build(&[tier("early", 10), tier("late", 249)], &mut out);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(admitted.len(), 2);
        assert_eq!(t.get("early"), Some(TierEntry { priority: 10, origin: Origin::Object }));
        assert_eq!(t.get("late").map(|e| e.priority), Some(249));
    }

    /// `validate.go reservedTierPriorities` (251, 252, 254, 255) and 220
    /// (`docs/cluster-network-policy.md` "Reserved Tier Priority"); the static priorities
    /// are taken ("overlaps with existing Tier").
    #[test]
    fn reserved_and_static_priorities_are_refused() {
        for (prio, reason) in [
            (220, "Tier priority 220 is reserved for upstream ClusterNetworkPolicy tier Admin"),
            (251, "Tier priority 251 is reserved"),
            (252, "Tier priority 252 is reserved"),
            (254, "Tier priority 254 is reserved"),
            (255, "Tier priority 255 is reserved"),
            (50, "overlaps with the priority of Tier emergency"),
            (100, "overlaps with the priority of Tier securityops"),
            (150, "overlaps with the priority of Tier networkops"),
            (200, "overlaps with the priority of Tier platform"),
            (250, "overlaps with the priority of Tier application"),
            (253, "overlaps with the priority of Tier baseline"),
        ] {
            let mut out = Vec::new();
            let (t, admitted) = TierTable::build(&[tier("x", prio)], &mut out);
            assert!(admitted.is_empty() && t.get("x").is_none(), "{prio}");
            assert_eq!(
                errors(&out),
                [("x".to_owned(), format!("\"{prio}\" is invalid: {reason}"))],
                "{prio}"
            );
            assert_eq!(out[0].field, "spec.priority");
        }
    }

    /// The CRD's `minimum: 0`, `maximum: 255` (`tier.yaml`).
    #[test]
    fn priority_out_of_crd_range_is_refused() {
        for prio in [-1, 256] {
            let mut out = Vec::new();
            let (_, admitted) = TierTable::build(&[tier("x", prio)], &mut out);
            assert!(admitted.is_empty());
            assert_eq!(errors(&out), [("x".to_owned(), format!("{prio} is out of range 0..=255"))]);
        }
    }

    /// Two Tiers with one priority: the first is admitted, the second refused naming it
    /// (`tierValidator.createValidate`: "overlaps with existing Tier").
    #[test]
    fn colliding_custom_tiers_refuse_the_later() {
        let mut out = Vec::new();
        let (t, admitted) = TierTable::build(&[tier("a", 10), tier("b", 10)], &mut out);
        assert_eq!(admitted.len(), 1);
        assert!(t.get("a").is_some() && t.get("b").is_none());
        assert_eq!(
            errors(&out),
            [(
                "b".to_owned(),
                "\"10\" is invalid: overlaps with the priority of Tier a".to_owned()
            )]
        );
    }

    /// A static Tier's object (as `kubectl get tiers -o yaml` exports it) is admitted with
    /// its own priority and refused with another (priority is immutable).
    #[test]
    fn static_tier_objects_must_keep_their_priority() {
        let mut out = Vec::new();
        let (t, admitted) =
            TierTable::build(&[tier("application", 250), tier("emergency", 40)], &mut out);
        assert_eq!(admitted.len(), 1);
        assert_eq!(t.get("emergency").map(|e| e.priority), Some(50));
        assert_eq!(
            errors(&out),
            [(
                "emergency".to_owned(),
                "\"40\" is invalid: emergency is a static Tier of priority 50; a Tier's \
                 priority cannot be changed"
                    .to_owned()
            )]
        );
    }

    /// `maxSupportedTiers = 20`, static Tiers included: 14 custom Tiers fit, the 15th is
    /// refused.
    #[test]
    fn at_most_twenty_tiers() {
        let tiers: Vec<_> = (0..15).map(|i| tier(&format!("t{i}"), i + 1)).collect();
        let mut out = Vec::new();
        let (t, admitted) = TierTable::build(&tiers, &mut out);
        assert_eq!((admitted.len(), t.iter().count()), (14, 20));
        assert_eq!(
            errors(&out),
            [(
                "t14".to_owned(),
                "\"15\" is invalid: the maximum number of Tiers supported is 20".to_owned()
            )]
        );
    }

    /// An invalid Tier object (here: its name) is refused and adds no Tier.
    #[test]
    fn an_invalid_tier_object_adds_nothing() {
        let mut out = Vec::new();
        let (t, admitted) = TierTable::build(&[tier("Bad_Name", 10)], &mut out);
        assert!(admitted.is_empty() && t.get("Bad_Name").is_none());
        assert_eq!(out[0].field, "metadata.name");
    }
}
