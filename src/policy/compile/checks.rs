//! Checks that run on a compiled snapshot and report what is legal but worth a look:
//! equal priorities with overlapping subjects, rules and policies that match nothing.
//! They read only the [`Snapshot`]; `check`, the builder and the policy status call them.

use std::collections::{BTreeMap, BTreeSet};

use super::index::place;
use crate::policy::model::{Direction, Tier};
use crate::policy::problem::{Kind, ObjectRef, Problem, ProblemKind};
use crate::policy::snapshot::{Policy, Snapshot};

/// Pairs of admin-tier or baseline-tier policies (CNPs, and the BANP at its rank of 1)
/// with equal priority whose subjects overlap, each with the number of pods both select:
/// one warning on each policy of a pair, naming the other and saying which is evaluated first (the first in evaluation
/// order: tier, priority, then name, kind, namespace). Used by `check` and the policy
/// status (KEP-2091 "Risks and Mitigations": "provide a warning if there is another ANP
/// with the same priority").
pub fn priority_conflicts(s: &Snapshot) -> Vec<Problem> {
    let mut out = Vec::new();
    // Upstream priorities are integers; Antrea's ties are `antrea_ties`'.
    let by_prio: BTreeMap<(Tier, u8, i32), Vec<&Policy>> = s
        .policies
        .iter()
        .filter(|p| p.tier != Tier::NetworkPolicy && p.antrea_tier.is_none())
        .fold(BTreeMap::new(), |mut m, p| {
            m.entry((p.tier, p.rank, p.priority as i32)).or_insert_with(Vec::new).push(p);
            m
        });
    for ((_, _, prio), mut ps) in by_prio {
        // Policy ids are slots after a patch moved one: order by place, not by id.
        ps.sort_by(|a, b| place(a).cmp(&place(b)));
        for (i, a) in ps.iter().enumerate() {
            for b in &ps[i + 1..] {
                let overlap = a.subject.intersection_len(&b.subject) as usize;
                if overlap > 0 {
                    // On both policies: each one's rules are ordered against the other's
                    // (issue #19: the second of a tie said Accepted).
                    for (this, other, first) in [(a, b, true), (b, a, false)] {
                        // The BANP has no priority field: it ranks at 1 (`admin::BANP_PRIORITY`).
                        let field = if this.object.kind == Kind::BaselineAdminNetworkPolicy {
                            "spec"
                        } else {
                            "spec.priority"
                        };
                        out.push(Problem::warning(
                            &this.object,
                            field,
                            ProblemKind::PriorityConflict {
                                priority: prio,
                                other: ObjectRef::clone(&other.object),
                                overlap,
                                first,
                            },
                        ));
                    }
                }
            }
        }
    }
    antrea_ties(s, &mut out);
    out
}

/// Antrea policies of one Tier and priority whose subjects overlap and that have rules at
/// a common index of one direction ([`ProblemKind::RuleTie`]): one warning on each, for
/// the first such index (the rest follow the same order). Called by
/// [`priority_conflicts`].
fn antrea_ties(s: &Snapshot, out: &mut Vec<Problem>) {
    let mut groups: BTreeMap<(u8, super::index::Priority), Vec<&Policy>> = BTreeMap::new();
    for p in s.policies.iter().filter(|p| p.antrea_tier.is_some()) {
        groups.entry((p.rank, super::index::Priority(p.priority))).or_default().push(p);
    }
    for ps in groups.values_mut() {
        ps.sort_by(|a, b| place(a).cmp(&place(b)));
        for (i, a) in ps.iter().enumerate() {
            for b in &ps[i + 1..] {
                let overlap = a.subject.intersection_len(&b.subject) as usize;
                if overlap == 0 {
                    continue;
                }
                let Some(d) = Direction::BOTH
                    .into_iter()
                    .find(|&d| !a.rules[d as usize].is_empty() && !b.rules[d as usize].is_empty())
                else {
                    continue;
                };
                for (this, other, first) in [(a, b, true), (b, a, false)] {
                    out.push(Problem::warning(
                        &this.object,
                        "spec.priority",
                        ProblemKind::RuleTie {
                            tier: this.antrea_tier.as_deref().unwrap_or_default().to_owned(),
                            priority: this.priority.to_string(),
                            other: ObjectRef::clone(&other.object),
                            overlap,
                            direction: d.as_str(),
                            index: 0,
                            first,
                        },
                    ));
                }
            }
        }
    }
}

/// Rules that match no traffic in this snapshot, and policies that select no pod: worth a
/// look, since pods may be missing from the input or a selector may be misspelled.
pub fn unreachable_rules(s: &Snapshot) -> Vec<Problem> {
    let mut out = Vec::new();
    let declared: BTreeSet<&str> =
        s.pods.iter().flat_map(|p| p.ports.iter().map(|n| n.name.as_str())).collect();
    let mut in_order: Vec<&Policy> = s.policies.iter().collect();
    in_order.sort_by(|a, b| place(a).cmp(&place(b)));
    for p in in_order {
        if p.subject.is_empty() {
            out.push(Problem::warning(
                &p.object,
                "spec",
                ProblemKind::NeverMatches { reason: "the subject selects no pod".into() },
            ));
        }
        for d in Direction::BOTH {
            for r in &p.rules[d as usize] {
                let field = format!("spec.{}[{}]", d.as_str(), r.index);
                let peers = &r.peers;
                let no_peer = !peers.all
                    && peers.blocks.is_empty()
                    && peers.relative.iter().all(|r| s.pod_sets[r.pods as usize].is_empty())
                    && peers.nodes.as_ref().is_none_or(|n| n.is_empty())
                    && peers.pod_sets.iter().all(|&id| s.pod_sets[id as usize].is_empty());
                if no_peer {
                    out.push(Problem::warning(
                        &p.object,
                        field.clone(),
                        ProblemKind::NeverMatches {
                            reason: "no peer of this rule selects anything".into(),
                        },
                    ));
                }
                let missing: Vec<&str> =
                    r.ports.named().filter(|n| !declared.contains(n)).collect();
                if !missing.is_empty() && missing.len() == r.ports.0.len() {
                    out.push(Problem::warning(
                        &p.object,
                        format!("{field}.ports"),
                        ProblemKind::NeverMatches {
                            reason: format!(
                                "no pod declares the named port(s) {}",
                                missing.join(", ")
                            ),
                        },
                    ));
                }
            }
        }
    }
    out
}
