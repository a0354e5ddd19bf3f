//! The table the validators' tests share: a valid manifest per kind, and rows that each
//! break one rule and name what must be reported. Each file keeps its own rows.

use serde_json::{Value, json};

use super::{
    admin_network_policy, antrea_cluster_network_policy, antrea_network_policy, antrea_tier,
    baseline_admin_network_policy, cluster_network_policy, invalid, namespace, network_policy,
    node, pod,
};
use crate::policy::antrea_tiers::TierTable;
use crate::policy::problem::{Problem, ProblemKind, Severity};

/// The kind a table row validates, with a valid manifest of that kind.
#[derive(Clone, Copy, Debug)]
pub(super) enum Target {
    Anp,
    Banp,
    Cnp,
    Np,
    Ns,
    Pod,
    Node,
    /// `crd.antrea.io/v1beta1` Tier.
    Tier,
    /// Antrea ClusterNetworkPolicy; validated with the static Tiers and a Tier `dev`.
    Acnp,
    /// Antrea NetworkPolicy; as `Acnp`.
    Annp,
}

/// The Tiers Antrea policy rows are validated against: the static ones and `dev` (90).
fn antrea_tiers() -> TierTable {
    let dev = de(json!({"metadata": {"name": "dev"}, "spec": {"priority": 90}}));
    let (table, _) = TierTable::build(&[std::sync::Arc::new(dev)], &mut Vec::new());
    table
}

impl Target {
    pub(super) fn base(self) -> Value {
        match self {
            Target::Anp => json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1",
                "kind": "AdminNetworkPolicy",
                "metadata": {"name": "anp"},
                "spec": {
                    "priority": 10,
                    "subject": {"namespaces": {"matchLabels": {"team": "a"}}},
                    "ingress": [{
                        "name": "allow-from-b",
                        "action": "Allow",
                        "from": [
                            {"namespaces": {"matchLabels": {"team": "b"}}},
                            {"pods": {
                                "namespaceSelector": {},
                                "podSelector": {"matchExpressions": [
                                    {"key": "app", "operator": "In", "values": ["web"]}
                                ]}
                            }}
                        ],
                        "ports": [
                            {"portNumber": {"protocol": "TCP", "port": 80}},
                            {"namedPort": "http"},
                            {"portRange": {"protocol": "UDP", "start": 1000, "end": 2000}}
                        ]
                    }],
                    "egress": [
                        {
                            "name": "deny-net",
                            "action": "Deny",
                            "to": [
                                {"networks": ["10.0.0.0/8", "2001:db8::/32"]},
                                {"nodes": {"matchExpressions": [{
                                    "key": "node-role.kubernetes.io/control-plane",
                                    "operator": "Exists"
                                }]}}
                            ],
                            "ports": [{"portNumber": {"port": 443}}]
                        },
                        {
                            "name": "pass-dns",
                            "action": "Pass",
                            "to": [{"pods": {
                                "namespaceSelector": {"matchLabels": {
                                    "kubernetes.io/metadata.name": "kube-system"
                                }},
                                "podSelector": {}
                            }}],
                            "ports": [{"namedPort": "dns"}]
                        }
                    ]
                }
            }),
            Target::Banp => json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1",
                "kind": "BaselineAdminNetworkPolicy",
                "metadata": {"name": "default"},
                "spec": {
                    "subject": {"pods": {"namespaceSelector": {}, "podSelector": {}}},
                    "ingress": [{
                        "action": "Deny",
                        "from": [{"namespaces": {}}]
                    }],
                    "egress": [{
                        "name": "deny-all",
                        "action": "Deny",
                        "to": [
                            {"networks": ["0.0.0.0/0", "::/0"]},
                            {"nodes": {}}
                        ],
                        "ports": [{"portRange": {"start": 1, "end": 1024}}]
                    }]
                }
            }),
            Target::Cnp => json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha2",
                "kind": "ClusterNetworkPolicy",
                "metadata": {"name": "cnp"},
                "spec": {
                    "tier": "Admin",
                    "priority": 5,
                    "subject": {"namespaces": {}},
                    "ingress": [{
                        "name": "accept-monitoring",
                        "action": "Accept",
                        "from": [{"namespaces": {"matchLabels": {"role": "monitoring"}}}],
                        "protocols": [
                            {"tcp": {"destinationPort": {"number": 9090}}},
                            {"destinationNamedPort": "metrics"}
                        ]
                    }],
                    "egress": [{
                        "name": "deny-external",
                        "action": "Deny",
                        "to": [{"networks": ["192.0.2.0/24"]}, {"nodes": {}}],
                        "protocols": [
                            {"udp": {"destinationPort": {"range": {"start": 1000, "end": 2000}}}},
                            {"sctp": {"destinationPort": {"number": 36412}}}
                        ]
                    }]
                }
            }),
            Target::Np => json!({
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "np", "namespace": "prod"},
                "spec": {
                    "podSelector": {"matchLabels": {"app": "db"}},
                    "policyTypes": ["Ingress", "Egress"],
                    "ingress": [{
                        "from": [
                            {"podSelector": {"matchLabels": {"app": "web"}},
                             "namespaceSelector": {"matchLabels": {"env": "prod"}}},
                            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
                        ],
                        "ports": [
                            {"protocol": "TCP", "port": 5432},
                            {"port": "metrics"},
                            {"port": 8000, "endPort": 8100}
                        ]
                    }],
                    "egress": [{
                        "to": [{"namespaceSelector": {}}],
                        "ports": [{"protocol": "UDP", "port": 53}]
                    }]
                }
            }),
            Target::Ns => json!({
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": "prod",
                    "labels": {"kubernetes.io/metadata.name": "prod", "env": "prod"}
                }
            }),
            Target::Pod => json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "db-0", "namespace": "prod", "labels": {"app": "db"}},
                "spec": {"containers": [{
                    "name": "db",
                    "ports": [
                        {"name": "postgres", "containerPort": 5432, "protocol": "TCP"},
                        {"name": "metrics", "containerPort": 9187}
                    ]
                }]},
                "status": {
                    "podIP": "10.0.0.5",
                    "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}]
                }
            }),
            Target::Tier => json!({
                "apiVersion": "crd.antrea.io/v1beta1",
                "kind": "Tier",
                "metadata": {"name": "dev"},
                "spec": {"priority": 90, "description": "developers"}
            }),
            Target::Acnp => json!({
                "apiVersion": "crd.antrea.io/v1beta1",
                "kind": "ClusterNetworkPolicy",
                "metadata": {"name": "acnp"},
                "spec": {
                    "tier": "securityops",
                    "priority": 5.5,
                    "appliedTo": [{
                        "podSelector": {"matchLabels": {"app": "db"}},
                        "namespaceSelector": {"matchExpressions": [
                            {"key": "env", "operator": "In", "values": ["prod"]}
                        ]}
                    }],
                    "ingress": [{
                        "name": "allow-web",
                        "action": "Allow",
                        "from": [
                            {"podSelector": {"matchLabels": {"app": "web"}}},
                            {"namespaces": {"match": "Self"}},
                            {"namespaces": {"sameLabels": ["tenant"]}, "podSelector": {}},
                            {"nodeSelector": {}}
                        ],
                        "ports": [{"protocol": "TCP", "port": 80}, {"port": "metrics"}],
                        "enableLogging": true,
                        "logLabel": "web"
                    }],
                    "egress": [{
                        "action": "Drop",
                        "to": [
                            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                            {"namespaceSelector": {}}
                        ],
                        "ports": [{"protocol": "UDP", "port": 1000, "endPort": 2000}]
                    }]
                }
            }),
            Target::Annp => json!({
                "apiVersion": "crd.antrea.io/v1beta1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "annp", "namespace": "prod"},
                "spec": {
                    "priority": 3,
                    "appliedTo": [{"podSelector": {"matchLabels": {"app": "db"}}}],
                    "ingress": [{
                        "action": "Reject",
                        "from": [{"podSelector": {}, "namespaceSelector": {}}],
                        "ports": [{"protocol": "SCTP"}]
                    }],
                    "egress": [{
                        "action": "Drop",
                        "to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]
                    }]
                }
            }),
            Target::Node => json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": "node-1"},
                "status": {"addresses": [
                    {"type": "InternalIP", "address": "192.168.1.10"},
                    {"type": "ExternalIP", "address": "2001:db8::10"},
                    {"type": "Hostname", "address": "node-1"}
                ]}
            }),
        }
    }

    pub(super) fn run(self, v: Value) -> Vec<Problem> {
        let mut out = Vec::new();
        match self {
            Target::Anp => admin_network_policy(&de(v), &mut out),
            Target::Banp => baseline_admin_network_policy(&de(v), &mut out),
            Target::Cnp => cluster_network_policy(&de(v), &mut out),
            Target::Np => network_policy(&de(v), &mut out),
            Target::Ns => namespace(&de(v), &mut out),
            Target::Pod => pod(&de(v), &mut out),
            Target::Node => node(&de(v), &mut out),
            Target::Tier => antrea_tier(&de(v), &mut out),
            Target::Acnp => antrea_cluster_network_policy(&de(v), &antrea_tiers(), &mut out),
            Target::Annp => antrea_network_policy(&de(v), &antrea_tiers(), &mut out),
        }
        out
    }
}

pub(super) fn de<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("test manifest deserializes")
}

pub(super) type Want = (Severity, &'static str, ProblemKind);

pub(super) fn err(field: &'static str, kind: ProblemKind) -> Want {
    (Severity::Error, field, kind)
}

pub(super) fn warn(field: &'static str, kind: ProblemKind) -> Want {
    (Severity::Warning, field, kind)
}

pub(super) fn inv(value: &str, reason: &str) -> ProblemKind {
    invalid(value, reason)
}

pub(super) fn range(value: i64, min: i64, max: i64) -> ProblemKind {
    ProblemKind::OutOfRange { value, min, max }
}

pub(super) fn one_of(fields: &'static str, found: &str) -> ProblemKind {
    ProblemKind::NotExactlyOne { fields, found: found.to_owned() }
}

pub(super) fn too_many(len: usize, max: usize) -> ProblemKind {
    ProblemKind::TooManyItems { len, max }
}

pub(super) fn too_few(len: usize, min: usize) -> ProblemKind {
    ProblemKind::TooFewItems { len, min }
}

pub(super) fn not_in(value: &str, allowed: &'static str) -> ProblemKind {
    ProblemKind::NotInEnum { value: value.to_owned(), allowed }
}

pub(super) fn repeat(v: &mut Value, n: usize) {
    let first = v[0].clone();
    *v = Value::Array(vec![first; n]);
}

/// One rule, one row.
pub(super) struct Row {
    pub(super) rule: &'static str,
    pub(super) target: Target,
    pub(super) edit: fn(&mut Value),
    pub(super) want: Vec<Want>,
}

pub(super) fn row(
    rule: &'static str,
    target: Target,
    edit: fn(&mut Value),
    want: Vec<Want>,
) -> Row {
    Row { rule, target, edit, want }
}

pub(super) const EGRESS_PEER: &str = "namespaces, pods, nodes, networks, domainNames";
pub(super) const CEL_ANP: &str = "networks/nodes/domainNames peer cannot be set with namedPorts since \
                       there are no namedPorts for networks/nodes/domainNames";
pub(super) const CEL_BANP: &str = "networks/nodes peer cannot be set with namedPorts since there are \
                        no namedPorts for networks/nodes";
pub(super) const DENY_ALL: &str = "denies all traffic the rule applies to";
pub(super) const DUP: &str = "duplicate entry in a list of type set";

/// Runs `rows`: each must report exactly its problems, in order.
pub(super) fn check(rows: Vec<Row>) {
    let mut failures = Vec::new();
    for Row { rule, target, edit, want } in rows {
        let mut v = target.base();
        edit(&mut v);
        let got: Vec<(Severity, String, ProblemKind)> =
            target.run(v).into_iter().map(|p| (p.severity, p.field, p.kind)).collect();
        let want: Vec<(Severity, String, ProblemKind)> =
            want.into_iter().map(|(s, f, k)| (s, f.to_owned(), k)).collect();
        if got != want {
            failures.push(format!("{rule} ({target:?}):\n   got  {got:?}\n   want {want:?}"));
        }
    }
    assert!(failures.is_empty(), "{} rule(s) failed:\n{}", failures.len(), failures.join("\n"));
}
