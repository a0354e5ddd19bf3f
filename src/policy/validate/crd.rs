//! The pieces the policy CRDs (v1alpha1 ANP/BANP, v1alpha2 CNP) share: unions, item
//! counts, priority, rule names, subjects, egress peers, `networks`, `domainNames`, named
//! ports, and what "fail closed" means for a peer of an unknown kind.
//!
//! Source: network-policy-api `apis/v1alpha1/shared_types.go` and
//! `apis/v1alpha2/clusternetworkpolicy_types.go` (the kubebuilder markers and CEL rules
//! quoted above each check).

use crate::policy::api::{LabelSelector, NamespacedPod};
use crate::policy::cidr;
use crate::policy::problem::ProblemKind;

use super::apimachinery::port_name_errors;
use super::selectors::{namespaced_pod, selector};
use super::{
    CRD_SELECTOR_SEVERITY, MAX_CIDR_LEN, MAX_NETWORKS, MAX_PRIORITY, MAX_RULE_NAME, Path, Seen,
    Sink, invalid, set_count, set_names,
};

/// What "fail closed" means for a rule holding a peer of an unknown kind.
///
/// Source (v1alpha1 and v1alpha2 peer docs): "If an implementation sees no fields are set
/// then it can infer that the deployed CRD is of an incompatible version with an unknown
/// field. In that case it should fail closed. For "Allow" rules, "fail closed" means:
/// "treat the rule as matching no traffic". For "Deny" and "Pass" rules, "fail closed"
/// means: "treat the rule as a 'Deny all' rule"."
#[derive(Clone, Copy)]
pub(super) enum FailClosed {
    /// Allow / Accept rules.
    MatchNothing,
    /// Deny / Pass rules.
    DenyAll,
}

impl FailClosed {
    fn effect(self) -> &'static str {
        match self {
            FailClosed::MatchNothing => "matches nothing",
            FailClosed::DenyAll => "denies all traffic the rule applies to",
        }
    }
}

/// `MinItems` / `MaxItems` of a list.
pub(super) fn item_count(s: &mut Sink<'_>, path: &Path<'_>, len: usize, min: usize, max: usize) {
    if len < min {
        s.error(path, ProblemKind::TooFewItems { len, min });
    } else if len > max {
        s.error(path, ProblemKind::TooManyItems { len, max });
    }
}

/// `+kubebuilder:validation:Minimum=0`, `Maximum=1000` on `priority`.
pub(super) fn priority(s: &mut Sink<'_>, value: i32) {
    if !(0..=MAX_PRIORITY).contains(&value) {
        s.error(
            &Path::root("spec.priority"),
            ProblemKind::OutOfRange { value: value.into(), min: 0, max: MAX_PRIORITY.into() },
        );
    }
}

/// `+kubebuilder:validation:MaxLength=100` on a rule's `name`. OpenAPI `maxLength`
/// counts characters (the API server uses `utf8.RuneCountInString`), not bytes.
pub(super) fn rule_name(s: &mut Sink<'_>, rule_path: &Path<'_>, name: &str) {
    // A string has no more characters than bytes: short names need no counting.
    if name.len() <= MAX_RULE_NAME {
        return;
    }
    let len = name.chars().count();
    if len > MAX_RULE_NAME {
        s.error(&rule_path.field("name"), ProblemKind::TooLong { len, max: MAX_RULE_NAME });
    }
}

/// A `MinProperties=1`, `MaxProperties=1` union that is not a peer: none set or several
/// set are both errors.
pub(super) fn union_exactly_one(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    fields: &'static str,
    members: &[(&str, bool)],
) {
    let count = set_count(members);
    if count != 1 {
        let found = if count == 0 { "none".to_owned() } else { set_names(members) };
        s.error(path, ProblemKind::NotExactlyOne { fields, found });
    }
}

/// A peer union: several members set is an error (`MaxProperties=1`); none of the known
/// members set means a peer kind newer than this engine, which fails closed (a warning:
/// a CRD of that newer version accepted the object).
pub(super) fn peer_union(
    s: &mut Sink<'_>,
    path: &Path<'_>,
    fields: &'static str,
    members: &[(&str, bool)],
    fail: FailClosed,
) {
    match set_count(members) {
        0 => s.warning(path, ProblemKind::UnknownPeer { effect: fail.effect() }),
        1 => {}
        _ => s.error(path, ProblemKind::NotExactlyOne { fields, found: set_names(members) }),
    }
}

/// `networks`: "+listType=set", "MinItems=1", "MaxItems=25"; each item a `CIDR`:
/// "+kubebuilder:validation:XValidation:rule="isCIDR(self)",message="Invalid CIDR format
/// provided"" and "+kubebuilder:validation:MaxLength=43".
fn check_networks(s: &mut Sink<'_>, path: &Path<'_>, nets: &[String]) {
    item_count(s, path, nets.len(), 1, MAX_NETWORKS);
    let mut seen = Seen::new();
    for (k, net) in nets.iter().enumerate() {
        let field = path.index(k);
        // A string has no more characters than bytes: short ones need no counting.
        if net.len() > MAX_CIDR_LEN {
            let len = net.chars().count();
            if len > MAX_CIDR_LEN {
                s.error(&field, ProblemKind::TooLong { len, max: MAX_CIDR_LEN });
            }
        }
        if let Err(e) = cidr::parse(net) {
            s.error(&field, invalid(net, format!("Invalid CIDR format provided: {e}")));
        }
        // listType=set: the API server rejects repeated items ("Duplicate value").
        if !seen.insert(net.as_str()) {
            s.error(&field, invalid(net, "duplicate entry in a list of type set"));
        }
    }
}

/// `domainNames`: "+listType=set", "MinItems=1", "MaxItems=25"; each item a `DomainName`
/// with `+kubebuilder:validation:Pattern` (see [`is_domain_name`]).
pub(super) fn check_domain_names(s: &mut Sink<'_>, path: &Path<'_>, names: &[String]) {
    item_count(s, path, names.len(), 1, MAX_NETWORKS);
    let mut seen = Seen::new();
    for (k, name) in names.iter().enumerate() {
        let field = path.index(k);
        if !is_domain_name(name) {
            s.error(
                &field,
                invalid(
                    name,
                    "must be a domain name of at least two labels, optionally prefixed by \
                     '*.' and followed by one '.' (DomainName pattern)",
                ),
            );
        }
        if !seen.insert(name.as_str()) {
            s.error(&field, invalid(name, "duplicate entry in a list of type set"));
        }
    }
}

/// A named port that can never equal a container port's name, which must be an
/// IANA_SVC_NAME (core `validateContainerPorts`). The CRDs accept any string.
pub(super) fn check_named_port(s: &mut Sink<'_>, path: &Path<'_>, name: &str) {
    let errs = port_name_errors(name);
    if !errs.is_empty() {
        s.warning(
            path,
            ProblemKind::NeverMatches {
                reason: format!(
                    "named port {name:?} is not a valid IANA_SVC_NAME ({}), so no container \
                     port can have it",
                    errs.join("; ")
                ),
            },
        );
    }
}

pub(super) fn subject(
    s: &mut Sink<'_>,
    namespaces: Option<&LabelSelector>,
    pods: Option<&NamespacedPod>,
) {
    // AdminNetworkPolicySubject / ClusterNetworkPolicySubject: "Exactly one field must be
    // set." (+kubebuilder:validation:MaxProperties=1, MinProperties=1)
    let path = Path::root("spec.subject");
    union_exactly_one(
        s,
        &path,
        "namespaces, pods",
        &[("namespaces", namespaces.is_some()), ("pods", pods.is_some())],
    );
    if let Some(sel) = namespaces {
        selector(s, sel, &path.field("namespaces"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(p) = pods {
        namespaced_pod(s, p, &path.field("pods"));
    }
}

/// The peer kinds ANP/BANP egress peers share: namespaces, pods, nodes, networks.
pub(super) fn common_egress_peer(
    s: &mut Sink<'_>,
    peer_path: &Path<'_>,
    namespaces: &Option<LabelSelector>,
    pods: &Option<NamespacedPod>,
    nodes: &Option<LabelSelector>,
    nets: &Option<Vec<String>>,
) {
    if let Some(sel) = namespaces {
        selector(s, sel, &peer_path.field("namespaces"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(p) = pods {
        namespaced_pod(s, p, &peer_path.field("pods"));
    }
    if let Some(sel) = nodes {
        selector(s, sel, &peer_path.field("nodes"), CRD_SELECTOR_SEVERITY);
    }
    if let Some(n) = nets {
        check_networks(s, &peer_path.field("networks"), n);
    }
}

/// The `DomainName` pattern of network-policy-api (v1alpha1 and v1alpha2):
/// `^(\*\.)?([a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.)+[a-zA-z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?\.?$`
///
/// Mirrored exactly, including upstream's `A-z` range in the first-character class, which
/// also admits `[ \ ] ^ _` and `` ` `` as the first character of a label.
pub fn is_domain_name(s: &str) -> bool {
    fn first(c: u8) -> bool {
        c.is_ascii_lowercase() || (b'A'..=b'z').contains(&c) || c.is_ascii_digit()
    }
    fn label(l: &str) -> bool {
        match l.as_bytes() {
            [] => false,
            [only] => first(*only),
            [f, mid @ .., last] => {
                first(*f)
                    && mid.iter().all(|&c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
                    && last.is_ascii_alphanumeric()
            }
        }
    }
    let s = s.strip_prefix("*.").unwrap_or(s);
    let s = s.strip_suffix('.').unwrap_or(s);
    let mut labels = 0usize;
    for l in s.split('.') {
        if !label(l) {
            return false;
        }
        labels += 1;
    }
    labels >= 2
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn domain_name_pattern_matches_upstream_regex() {
        for ok in [
            "kubernetes.io",
            "blog.kubernetes.io",
            "*.kubernetes.io",
            "kubernetes.io.",
            "a.b",
            "x_y.example.com",
            "1.2",
            // Upstream's `[a-zA-z0-9]` admits these as a label's first character.
            "_sip.example.com",
            "^a.example.com",
        ] {
            assert!(is_domain_name(ok), "{ok} should match");
        }
        for bad in [
            "",
            "localhost",
            "*.com.",
            "*",
            "*.",
            ".example.com",
            "example..com",
            "example.com..",
            "*.*.example.com",
            "-a.example.com",
            "a-.example.com",
            "a.example.com-",
            "www.*.example.com",
            "exa mple.com",
            "exämple.com",
            "a_.example.com",
        ] {
            assert!(!is_domain_name(bad), "{bad} should not match");
        }
    }
}
