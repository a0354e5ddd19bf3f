//! The NetworkPolicy pass of a compile: `networking.k8s.io/v1` NetworkPolicies into
//! [`Policy`]s of the NetworkPolicy tier, their selector peers interned as pod sets.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::sync::Arc;

use super::cluster::{Cluster, SetKey};
use super::{
    Inputs, meta_name, meta_namespace, own_annotations, port_u16, protocol_or_tcp, selector,
    valid_sorted,
};
use crate::policy::api::NetworkPolicy;
use crate::policy::cidr::{self, Block};
use crate::policy::model::{Action, Direction, Peers, PeersBuilder, Rule, Tier, rank};
use crate::policy::ports::{PortMatch, PortSpec, Ports};
use crate::policy::problem::{Kind, ObjectRef, Problem};
use crate::policy::snapshot::Policy;
use crate::policy::validate;

/// NetworkPolicy pass: reads `inputs.network_policies` (validated unless `validate` is
/// false) and the namespaces and pod label index of `c`; returns the policies of the
/// valid ones, in namespace/name order, and interns their selectors in `c`.
pub(super) fn network_policies(
    c: &mut Cluster,
    inputs: &Inputs,
    validate: bool,
    problems: &mut Vec<Problem>,
) -> Vec<Policy> {
    let mut policies = Vec::new();
    for (r, np) in valid_sorted(
        &inputs.network_policies,
        |p| {
            ObjectRef::namespaced(
                Kind::NetworkPolicy,
                meta_namespace(&p.metadata),
                meta_name(&p.metadata),
            )
        },
        validate::network_policy,
        validate,
        problems,
    ) {
        if let Some(p) = c.network_policy(r, np) {
            policies.push(p);
        }
    }
    policies
}

/// NetworkPolicy `ports`: "If this field is empty or missing, this rule matches all ports".
fn np_ports(ports: &Option<Vec<k8s_openapi::api::networking::v1::NetworkPolicyPort>>) -> Ports {
    let Some(ports) = ports else { return Ports::any() };
    Ports(
        ports
            .iter()
            .map(|p| {
                let k8s_openapi::api::networking::v1::NetworkPolicyPort {
                    end_port,
                    port,
                    protocol,
                } = p;
                let protocol = Some(protocol_or_tcp(protocol.as_deref()));
                let ports = match port {
                    // "If this field is not provided, this matches all port names and numbers."
                    None => PortSpec::Any,
                    Some(IntOrString::Int(n)) => {
                        let lo = port_u16(*n);
                        // "endPort indicates that the range of ports from port to endPort if
                        // set, inclusive, should be allowed by the policy."
                        PortSpec::Range(lo, end_port.map_or(lo, port_u16))
                    }
                    Some(IntOrString::String(name)) => PortSpec::Named(name.clone()),
                };
                PortMatch { protocol, ports }
            })
            .collect(),
    )
}

impl Cluster {
    /// Compiles one validated NetworkPolicy: its subject (its `podSelector` in its own
    /// namespace; `None` when nobody declared the namespace, so no pod lives there), its
    /// defaulted `policyTypes` and its rules, each peer's selectors interned.
    pub(super) fn network_policy(
        &mut self,
        object: ObjectRef,
        np: &NetworkPolicy,
    ) -> Option<Policy> {
        use k8s_openapi::api::networking::v1::{
            NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec,
        };
        let ns_name = object.namespace.clone().unwrap_or_default();
        let ns = match self.ns_ids.get(&ns_name) {
            Some(&id) => id,
            // No pod lives in a namespace nobody declared: the policy selects nothing.
            None => return None,
        };
        let no_spec = NetworkPolicySpec::default();
        let NetworkPolicySpec { egress, ingress, pod_selector, policy_types } =
            np.spec.as_ref().unwrap_or(&no_spec);
        // "This field is optional. If it is not specified, it defaults to an empty
        // selector" — which selects all pods in the namespace.
        let (subject, subject_set) = match selector(&pod_selector.clone().unwrap_or_default()) {
            Some(s) => {
                let id = self.intern(SetKey::InNamespace(ns, s));
                (Arc::clone(&self.interner.sets[id as usize]), Some(id))
            }
            None => (Arc::default(), None),
        };
        // policyTypes defaulting (API server, SetDefaults_NetworkPolicySpec): "If this field
        // is not specified, it will default based on the existence of ingress or egress
        // rules; policies that contain an egress section are assumed to affect egress, and
        // all policies (whether or not they contain an ingress section) are assumed to
        // affect ingress."
        let applies = match policy_types.as_deref() {
            Some(t) if !t.is_empty() => {
                [t.iter().any(|t| t == "Ingress"), t.iter().any(|t| t == "Egress")]
            }
            _ => [true, egress.as_ref().is_some_and(|e| !e.is_empty())],
        };
        let mut rules: [Vec<Rule>; 2] = [Vec::new(), Vec::new()];
        let compile_rule = |c: &mut Cluster, peers: &Option<Vec<NetworkPolicyPeer>>| -> Peers {
            // "If this field is empty or missing, this rule matches all sources/destinations."
            let Some(list) = peers.as_ref().filter(|l| !l.is_empty()) else {
                return PeersBuilder::all().build();
            };
            let mut out = PeersBuilder::default();
            for p in list {
                let NetworkPolicyPeer { ip_block, namespace_selector, pod_selector } = p;
                if let Some(b) = ip_block {
                    if let Ok(net) = cidr::parse(&b.cidr) {
                        let except =
                            b.except.iter().flatten().filter_map(|e| cidr::parse(e).ok()).collect();
                        out.blocks.push(Block { net, except });
                    }
                    continue;
                }
                let key = match (namespace_selector, pod_selector) {
                    // "If namespaceSelector is also set, then the NetworkPolicyPeer as a
                    // whole selects the pods matching podSelector in the Namespaces selected
                    // by NamespaceSelector."
                    (Some(n), Some(p)) => {
                        selector(n).zip(selector(p)).map(|(n, p)| SetKey::Pods(n, p))
                    }
                    (Some(n), None) => selector(n).map(SetKey::Namespaces),
                    // "Otherwise it selects the pods matching podSelector in the policy's own
                    // namespace."
                    (None, Some(p)) => selector(p).map(|p| SetKey::InNamespace(ns, p)),
                    (None, None) => None,
                };
                if let Some(k) = key {
                    out.pod_sets.push(c.intern(k));
                }
            }
            out.pod_sets.sort_unstable();
            out.pod_sets.dedup();
            out.build()
        };
        // NetworkPolicy rules only allow; a rule's position is its index.
        let allow = |index: usize, peers: Peers, ports| Rule {
            name: None,
            index: index as u32,
            action: Action::Allow,
            peers,
            ports: np_ports(ports),
            fail_closed: false,
            applied_to: None,
            enable_logging: false,
            log_label: None,
        };
        if applies[Direction::Ingress as usize] {
            for (i, r) in ingress.iter().flatten().enumerate() {
                let NetworkPolicyIngressRule { from, ports } = r;
                let peers = compile_rule(self, from);
                rules[0].push(allow(i, peers, ports));
            }
        }
        if applies[Direction::Egress as usize] {
            for (i, r) in egress.iter().flatten().enumerate() {
                let NetworkPolicyEgressRule { to, ports } = r;
                let peers = compile_rule(self, to);
                rules[1].push(allow(i, peers, ports));
            }
        }
        rules.iter_mut().for_each(Vec::shrink_to_fit);
        Some(Policy {
            object: Arc::new(object),
            tier: Tier::NetworkPolicy,
            rank: rank::NETWORK_POLICY,
            priority: 0.0,
            antrea_tier: None,
            rules: Arc::new(rules),
            matchers: [None, None],
            subject,
            subject_set,
            applies,
            annotations: own_annotations(&np.metadata).into(),
        })
    }
}
