//! What gets audited: node-wide defaults per action, and a per-policy annotation that turns
//! logging on or off per action or per rule name.
//!
//! KEP-2091 ("Future work: Audit Logging") sketches an `auditPolicy` field; the upstream
//! CRDs have none, so tierproxy reads the same intent from an annotation on the policy
//! object, `tierproxy.io/audit` ([`ANNOTATION`]). Grammar (items separated by commas,
//! spaces around items ignored):
//!
//! ```text
//! value  = item *("," item)
//! item   = switch                      ; every action of this policy
//!        | action "=" switch           ; one action: allow, deny or pass
//!        | "rule:" name "=" switch     ; one rule, by its `name`
//! switch = "on" | "off"
//! ```
//!
//! The most specific item wins: `rule:NAME` over `action=` over a bare switch over the
//! node's defaults ([`Defaults`]). A policy's `on` for allow logs every allow it decides
//! (the node's 1-in-N allow sampling applies only where no policy says anything). An
//! annotation that does not parse is reported ([`AnnotationError`], naming the object and
//! field) and that policy is audited in full — for an audit trail, logging too much is the
//! safe failure.
//!
//! An Antrea rule with `enableLogging: true` (`crd.antrea.io/v1beta1`, "audit logging")
//! is always logged, above every switch: it is the policy author's own request, and an
//! annotation's `off` cannot silence it (drop the field for that). A rule without it, or
//! with `enableLogging: false` (the default), follows the switches above.
//!
//! A decision is audited per direction: the direction's record is emitted when any rule
//! hit on its path (each Pass taken, then the rule, isolation or default that decided)
//! is switched on. Sampling is decided once per flow, so both directions of a sampled
//! flow, and its connection's end, are logged together.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::policy::compile::{Action, Direction};
use crate::policy::eval::{Basis, Decision, Outcome};
use crate::policy::{ObjectRef, Problem, ProblemKind, Snapshot};

/// The annotation read on AdminNetworkPolicy, BaselineAdminNetworkPolicy,
/// ClusterNetworkPolicy and NetworkPolicy objects, upstream and Antrea's alike.
pub const ANNOTATION: &str = "tierproxy.io/audit";

/// Node-wide defaults: which decisions are logged where no policy annotation decides.
///
/// Source: issue #4 "What gets logged" (deny and pass on, allow sampled 1-in-N).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Defaults {
    /// Log one allow in `allow_sample` (per flow); 0 = never, 1 = every allow.
    pub allow_sample: u32,
    /// Log denies and Antrea rejects.
    pub deny: bool,
    /// Log decisions that took a Pass rule.
    pub pass: bool,
    /// Log the end of each proxied connection whose decision was logged. A connection cut
    /// by a policy change is reported whatever this says.
    pub close: bool,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults { allow_sample: 100, deny: true, pass: true, close: true }
    }
}

/// One policy's switches from its annotation; `None` = not said.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicySwitches {
    /// A bare `on`/`off`.
    pub all: Option<bool>,
    /// `allow=`, `deny=`, `pass=`, in that order.
    pub actions: [Option<bool>; 3],
    /// `rule:NAME=`, sorted by name.
    pub rules: Vec<(String, bool)>,
}

/// An annotation that does not parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationError {
    /// The policy object.
    pub object: ObjectRef,
    /// The annotation's value.
    pub value: String,
    /// What is wrong, quoting the offending item.
    pub message: String,
}

impl AnnotationError {
    /// The error as a [`Problem`] (a warning: the policy is enforced as written), for
    /// `tierproxy check`.
    pub fn to_problem(&self) -> Problem {
        Problem::warning(
            &self.object,
            format!("metadata.annotations[{ANNOTATION}]"),
            ProblemKind::Invalid {
                value: self.value.clone(),
                reason: format!("{}; the policy is audited in full", self.message),
            },
        )
    }
}

impl fmt::Display for AnnotationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.object;
        match &o.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", o.kind, o.name)?,
            None => write!(f, "{} {}", o.kind, o.name)?,
        }
        write!(
            f,
            ": metadata.annotations[{ANNOTATION}]: {} (the policy is audited in full)",
            self.message
        )
    }
}

impl std::error::Error for AnnotationError {}

/// Position of an action in [`PolicySwitches::actions`].
fn action_index(a: Action) -> usize {
    match a {
        Action::Allow => 0,
        // `deny=` switches Antrea's Drop and Reject alike (docs/audit.md).
        Action::Deny | Action::Reject => 1,
        Action::Pass => 2,
    }
}

fn switch(s: &str) -> Option<bool> {
    match s {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

/// Parses an annotation value ([module docs](self) for the grammar).
///
/// # Errors
/// A message naming the first item that is not `on`, `off`, `ACTION=on|off` or
/// `rule:NAME=on|off`, or an empty value.
pub fn parse(value: &str) -> Result<PolicySwitches, String> {
    let mut out = PolicySwitches::default();
    if value.trim().is_empty() {
        return Err("empty value (expected on, off, allow=…, deny=…, pass=… or rule:NAME=…)".into());
    }
    for item in value.split(',').map(str::trim) {
        let bad = || {
            format!(
                "{item:?} is not on, off, allow=on|off, deny=on|off, pass=on|off or \
                 rule:NAME=on|off"
            )
        };
        if let Some(on) = switch(item) {
            out.all = Some(on);
            continue;
        }
        let Some((key, val)) = item.split_once('=') else { return Err(bad()) };
        let on = switch(val.trim()).ok_or_else(bad)?;
        let key = key.trim();
        if let Some(name) = key.strip_prefix("rule:") {
            if name.is_empty() {
                return Err(bad());
            }
            out.rules.retain(|(n, _)| n != name);
            out.rules.push((name.to_string(), on));
            continue;
        }
        let action = match key {
            "allow" => Action::Allow,
            "deny" => Action::Deny,
            "pass" => Action::Pass,
            _ => return Err(bad()),
        };
        out.actions[action_index(action)] = Some(on);
    }
    out.rules.sort();
    Ok(out)
}

/// A rule as a `rule:NAME` switch names it, with its own logging request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleRef<'a> {
    /// The rule's `name`, if it has one.
    pub name: Option<&'a str>,
    /// Its direction.
    pub dir: Direction,
    /// Its position in the policy's list for `dir`.
    pub index: u32,
    /// Antrea `enableLogging: true`: always logged ([module docs](self)).
    pub enable_logging: bool,
}

/// Whether one rule hit is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Want {
    /// Not logged.
    Never,
    /// Logged when the flow is sampled (the node's allow default).
    Sampled,
    /// Logged.
    Always,
}

/// How a flow whose hits ask for [`Want::Sampled`] is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampling {
    /// By this plan's counter: one flow in `allow_sample` ([`Defaults::allow_sample`]).
    Count,
    /// Already taken: the kernel sampled it (a UDP flow of a cached class whose new
    /// conntrack entry the ruleset let the agent see, one in `allow_sample`; `redirect`
    /// rule 7), so it is logged.
    Taken,
}

/// The audit selection for one snapshot: every policy's switches, by policy index.
/// Built once per snapshot revision ([`Selection::new`]), read by the deciders without locks.
#[derive(Debug)]
pub struct Selection {
    defaults: Defaults,
    /// By policy index; `None`: no annotation.
    policies: Vec<Option<PolicySwitches>>,
    sample: AtomicU64,
}

impl Selection {
    /// The selection for `snapshot` under node defaults `defaults`, with the annotations
    /// that did not parse (those policies are audited in full).
    pub fn new(snapshot: &Snapshot, defaults: Defaults) -> (Arc<Selection>, Vec<AnnotationError>) {
        let mut errors = Vec::new();
        let policies = (0..snapshot.policy_count())
            .map(|p| {
                let value = snapshot.policy_annotation(p, ANNOTATION)?;
                Some(parse(value).unwrap_or_else(|message| {
                    errors.push(AnnotationError {
                        object: snapshot.policy_ref(p).clone(),
                        value: value.to_string(),
                        message,
                    });
                    PolicySwitches { all: Some(true), ..PolicySwitches::default() }
                }))
            })
            .collect();
        (Arc::new(Selection { defaults, policies, sample: AtomicU64::new(0) }), errors)
    }

    /// A plan that uses `defaults` for every policy (no annotations read).
    pub fn defaults_only(defaults: Defaults) -> Arc<Selection> {
        Arc::new(Selection { defaults, policies: Vec::new(), sample: AtomicU64::new(0) })
    }

    /// The node defaults this plan was built with.
    pub fn defaults(&self) -> Defaults {
        self.defaults
    }

    /// Whether a hit of `action` — by rule `rule` of policy `policy`, or by no policy
    /// (default allow) or no rule (isolation) — is logged. A rule with Antrea
    /// `enableLogging` always is. A `rule:NAME` switch names a rule by its `name`, or an
    /// unnamed rule as audit events do: `ingress[i]`, `egress[i]`.
    pub fn want(&self, policy: Option<u32>, rule: Option<RuleRef<'_>>, action: Action) -> Want {
        // "enableLogging: true" asks for every decision of the rule; an audit trail
        // errs on the side of logging, so no switch overrides it.
        if rule.is_some_and(|r| r.enable_logging) {
            return Want::Always;
        }
        let a = action_index(action);
        let s = policy.and_then(|p| self.policies.get(p as usize)).and_then(Option::as_ref);
        let said = s.and_then(|s| {
            let by_rule = match rule {
                Some(r) if !s.rules.is_empty() => {
                    let unnamed;
                    let name = match r.name {
                        Some(n) => n,
                        None => {
                            unnamed = format!("{}[{}]", r.dir.as_str(), r.index);
                            &unnamed
                        }
                    };
                    s.rules
                        .binary_search_by(|(n, _)| n.as_str().cmp(name))
                        .ok()
                        .map(|i| s.rules[i].1)
                }
                _ => None,
            };
            by_rule.or(s.actions[a]).or(s.all)
        });
        match said {
            Some(true) => Want::Always,
            Some(false) => Want::Never,
            None => match action {
                Action::Allow if self.defaults.allow_sample == 0 => Want::Never,
                Action::Allow if self.defaults.allow_sample == 1 => Want::Always,
                Action::Allow => Want::Sampled,
                Action::Deny | Action::Reject if self.defaults.deny => Want::Always,
                Action::Pass if self.defaults.pass => Want::Always,
                Action::Deny | Action::Reject | Action::Pass => Want::Never,
            },
        }
    }

    /// The strongest [`Want`] along one direction's path: each Pass taken, then what
    /// decided.
    pub fn want_outcome(&self, snapshot: &Snapshot, dir: Direction, o: &Outcome) -> Want {
        let hit = |h: crate::policy::RuleHit| {
            let info = snapshot.rule_info(dir, h);
            let rule = RuleRef {
                name: info.name,
                dir,
                index: info.index,
                enable_logging: info.enable_logging,
            };
            self.want(Some(h.policy), Some(rule), info.action)
        };
        let last = match o.basis {
            Basis::Rule { hit: h, .. } => hit(h),
            Basis::Isolated { policy } => self.want(Some(policy), None, Action::Deny),
            Basis::NoPolicy | Basis::OwnNode => self.want(None, None, Action::Allow),
        };
        o.passed.iter().map(|&h| hit(h)).fold(last, Want::max)
    }

    /// Which directions of `decision` are logged, as `[ingress, egress]` by [`Direction`]
    /// index; samples the flow (one in `allow_sample`) when only sampled hits ask for it.
    pub fn select(&self, snapshot: &Snapshot, decision: &Decision) -> [bool; 2] {
        self.select_as(snapshot, decision, Sampling::Count)
    }

    /// [`Selection::select`], with the flow's sampling decided as `sampling` says.
    pub fn select_as(
        &self,
        snapshot: &Snapshot,
        decision: &Decision,
        sampling: Sampling,
    ) -> [bool; 2] {
        let w = self.wants(snapshot, decision);
        let sampled = w.contains(&Want::Sampled)
            && match sampling {
                Sampling::Count => {
                    let n = u64::from(self.defaults.allow_sample.max(1));
                    self.sample.fetch_add(1, Ordering::Relaxed).is_multiple_of(n)
                }
                Sampling::Taken => true,
            };
        w.map(|w| w == Want::Always || (w == Want::Sampled && sampled))
    }

    /// Whether a direction of `decision` is logged whatever the sampling ([`Want::Always`]:
    /// a policy's annotation, an Antrea rule's `enableLogging`, or `--audit-allow-sample 1`
    /// for an allow). The kernel path never caches such a UDP class where the kernel
    /// samples the cached flows (`proxy::queue`), so that every one of its flows is seen.
    pub fn always(&self, snapshot: &Snapshot, decision: &Decision) -> bool {
        self.wants(snapshot, decision).contains(&Want::Always)
    }

    /// Each direction's strongest [`Want`], as `[ingress, egress]`.
    fn wants(&self, snapshot: &Snapshot, decision: &Decision) -> [Want; 2] {
        let want = |dir: Direction, o: &Option<Outcome>| {
            o.as_ref().map_or(Want::Never, |o| self.want_outcome(snapshot, dir, o))
        };
        [want(Direction::Ingress, &decision.ingress), want(Direction::Egress, &decision.egress)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_grammar() {
        let s = parse(" off , deny=on,rule:allow-dns = on, rule:b=off ").unwrap();
        assert_eq!(s.all, Some(false));
        assert_eq!(s.actions, [None, Some(true), None]);
        assert_eq!(s.rules, vec![("allow-dns".to_string(), true), ("b".to_string(), false)]);
        // Later items win over earlier ones for the same key.
        assert_eq!(parse("allow=on,allow=off").unwrap().actions[0], Some(false));
        assert_eq!(parse("rule:x=on,rule:x=off").unwrap().rules, vec![("x".into(), false)]);
    }

    #[test]
    fn rejects_what_is_not_in_the_grammar() {
        for bad in ["", " ", "yes", "allow", "allow=yes", "log=on", "rule:=on", "on,,off"] {
            let e = parse(bad).expect_err(bad);
            assert!(!e.is_empty());
        }
        assert!(parse("allow=maybe").unwrap_err().contains("\"allow=maybe\""));
    }

    #[test]
    fn the_most_specific_switch_wins() {
        let defaults = Defaults { allow_sample: 10, deny: true, pass: false, close: true };
        let plan = Selection {
            defaults,
            policies: vec![
                Some(parse("off, deny=on, rule:r1=on").unwrap()),
                None,
                Some(parse("allow=on").unwrap()),
                Some(parse("allow=off, rule:egress[2]=on").unwrap()),
            ],
            sample: AtomicU64::new(0),
        };
        let named = |n| {
            Some(RuleRef {
                name: Some(n),
                dir: Direction::Ingress,
                index: 0,
                enable_logging: false,
            })
        };
        // Policy 0: rule beats action beats bare switch.
        assert_eq!(plan.want(Some(0), named("r1"), Action::Allow), Want::Always);
        assert_eq!(plan.want(Some(0), named("r2"), Action::Deny), Want::Always);
        assert_eq!(plan.want(Some(0), named("r2"), Action::Allow), Want::Never);
        assert_eq!(plan.want(Some(0), None, Action::Pass), Want::Never);
        // Policy 1 (no annotation) and no policy: the node's defaults.
        assert_eq!(plan.want(Some(1), None, Action::Allow), Want::Sampled);
        assert_eq!(plan.want(Some(1), None, Action::Deny), Want::Always);
        assert_eq!(plan.want(Some(1), None, Action::Pass), Want::Never);
        assert_eq!(plan.want(None, None, Action::Allow), Want::Sampled);
        // Policy 2 logs every allow; its denies follow the node.
        assert_eq!(plan.want(Some(2), named("x"), Action::Allow), Want::Always);
        assert_eq!(plan.want(Some(2), named("x"), Action::Deny), Want::Always);
        // An unnamed rule (NetworkPolicy) is named as its events name it.
        let unnamed = |dir, index| Some(RuleRef { name: None, dir, index, enable_logging: false });
        assert_eq!(plan.want(Some(3), unnamed(Direction::Egress, 2), Action::Allow), Want::Always);
        assert_eq!(plan.want(Some(3), unnamed(Direction::Ingress, 2), Action::Allow), Want::Never);
        assert_eq!(plan.want(Some(3), unnamed(Direction::Egress, 1), Action::Allow), Want::Never);
        // Sampling 0 and 1.
        let never = Selection::defaults_only(Defaults { allow_sample: 0, ..defaults });
        assert_eq!(never.want(None, None, Action::Allow), Want::Never);
        let all = Selection::defaults_only(Defaults { allow_sample: 1, ..defaults });
        assert_eq!(all.want(None, None, Action::Allow), Want::Always);
    }

    #[test]
    fn enable_logging_logs_a_rule_whatever_the_switches_say() {
        let quiet = Defaults { allow_sample: 0, deny: false, pass: false, close: true };
        let plan = Selection {
            defaults: quiet,
            policies: vec![None, Some(parse("off, rule:logged=off").unwrap())],
            sample: AtomicU64::new(0),
        };
        let rule = |enable_logging| {
            Some(RuleRef { name: Some("logged"), dir: Direction::Egress, index: 1, enable_logging })
        };
        for action in [Action::Allow, Action::Deny, Action::Reject, Action::Pass] {
            // Node defaults that log nothing, a bare `off`, the rule's own `off`: logged.
            for policy in [0, 1] {
                assert_eq!(plan.want(Some(policy), rule(true), action), Want::Always, "{action:?}");
                assert_eq!(plan.want(Some(policy), rule(false), action), Want::Never, "{action:?}");
            }
        }
    }

    #[test]
    fn deny_switches_drop_and_reject_alike() {
        let defaults = Defaults { allow_sample: 0, deny: true, pass: true, close: true };
        let plan = Selection {
            defaults,
            policies: vec![Some(parse("deny=off").unwrap()), None],
            sample: AtomicU64::new(0),
        };
        for action in [Action::Deny, Action::Reject] {
            assert_eq!(plan.want(Some(0), None, action), Want::Never, "{action:?}");
            assert_eq!(plan.want(Some(1), None, action), Want::Always, "{action:?}");
        }
        let off = Selection::defaults_only(Defaults { deny: false, ..defaults });
        assert_eq!(off.want(None, None, Action::Reject), Want::Never);
    }
}
