//! Synthetic clusters for benchmarks and load tests: many pods, NetworkPolicies and admin
//! policies with realistic overlap, generated deterministically from a seed.
//!
//! Shape (defaults = the sizing target of issue #2 and `benches/decide.rs`):
//! - namespaces labelled `team=t<i mod 50>`, `env=prod|dev|staging`;
//! - pods spread evenly over namespaces and nodes, labelled `app=a<j mod 10>` and
//!   `tier=fe|be|db`, declaring the named ports `http` (8080/TCP) and `metrics` (9090/TCP);
//! - NetworkPolicies per namespace alternating between "allow from my namespace's app X
//!   and from team Y on http" and "egress to team Z and to 10.0.0.0/8 except one /16";
//! - admin policies with priorities 0.., each selecting one team's namespaces (every tenth
//!   one: all `env=prod` namespaces), with rules cycling Allow/Deny/Pass over 1..=max peers
//!   drawn from the team × app vocabulary, plus `networks` peers;
//! - one BaselineAdminNetworkPolicy denying cross-team ingress.
//!
//! The PRNG is a fixed SplitMix64 so that a seed names the same cluster in every version
//! (library RNGs do not promise value stability across releases).

use std::net::{IpAddr, Ipv4Addr};

use serde_json::{Value, json};

use crate::policy::{Flow, Inputs, Protocol};

/// Sizes of a synthetic cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Number of namespaces (≥ 1).
    pub namespaces: usize,
    /// Number of pod-network pods (≥ 1).
    pub pods: usize,
    /// Number of nodes (≥ 1).
    pub nodes: usize,
    /// Number of NetworkPolicies.
    pub network_policies: usize,
    /// Number of AdminNetworkPolicies.
    pub admin_policies: usize,
    /// Rules per AdminNetworkPolicy and direction (≤ 100, the CRD limit).
    pub rules_per_admin_policy: usize,
    /// Most peers per admin rule (≤ 100, the CRD limit); rules have 1..=this.
    pub max_peers: usize,
    /// When set, every admin policy selects every namespace (the worst case for `decide`).
    pub admin_selects_all: bool,
}

impl Shape {
    /// 10,000 pods in 500 namespaces on 100 nodes, 1,000 NetworkPolicies, 100 ANPs × 100
    /// rules with up to 100 peers each, and a BANP (issue #2's benchmark cluster).
    pub const LARGE: Shape = Shape {
        namespaces: 500,
        pods: 10_000,
        nodes: 100,
        network_policies: 1_000,
        admin_policies: 100,
        rules_per_admin_policy: 100,
        max_peers: 100,
        admin_selects_all: false,
    };

    /// [`Shape::LARGE`] with at most 10 peers per admin rule: issue #7's load-test policy
    /// set (10,000 pods, 1,000 NetworkPolicies, 100 ANPs × 100 rules). With up to 100 peers
    /// per rule the manifests hold a million peers (about 100 MB of JSON), beyond what a
    /// manifest file may be ([`crate::cluster::manifest::MAX_FILE_BYTES`]) and beyond real
    /// policies, which name a few peers per rule.
    pub const LOAD_TEST: Shape = Shape { max_peers: 10, ..Shape::LARGE };
}

const TEAMS: usize = 50;
const APPS: usize = 10;
const ENVS: [&str; 3] = ["prod", "dev", "staging"];
const TIERS: [&str; 3] = ["fe", "be", "db"];

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, value-stable.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; slight modulo bias is irrelevant here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// The IPv4 address of synthetic pod `i`: 10.128.0.0/9 counted up from 10.128.0.1.
pub fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0A80_0001u32 + i as u32)
}

/// The InternalIP of synthetic node `i`: 172.16.0.0/12 counted up from 172.16.0.1.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0xAC10_0001u32 + i as u32)
}

fn decode<T: serde::de::DeserializeOwned>(v: Value) -> std::sync::Arc<T> {
    // The generator writes only well-formed objects; a failure here is a bug in it.
    std::sync::Arc::new(serde_json::from_value(v).expect("synthetic object decodes"))
}

/// Generates a cluster of `shape` from `seed`.
pub fn cluster(shape: Shape, seed: u64) -> Inputs {
    let mut rng = Rng::new(seed);
    let ns_count = shape.namespaces.max(1);
    let mut inputs = Inputs::default();
    for i in 0..ns_count {
        inputs.namespaces.push(decode(json!({
            "metadata": {"name": format!("ns-{i}"), "labels": {"team": format!("t{}", i % TEAMS), "env": ENVS[i % 3]}},
        })));
    }
    for i in 0..shape.nodes.max(1) {
        inputs.nodes.push(decode(json!({
            "metadata": {"name": format!("node-{i}"), "labels": {"zone": format!("z{}", i % 3)}},
            "status": {"addresses": [{"type": "InternalIP", "address": node_ip(i).to_string()}]},
        })));
    }
    for j in 0..shape.pods {
        inputs.pods.push(decode(json!({
            "metadata": {
                "name": format!("pod-{j}"),
                "namespace": format!("ns-{}", j % ns_count),
                "labels": {"app": format!("a{}", (j / ns_count) % APPS), "tier": TIERS[j % 3]},
            },
            "spec": {
                "nodeName": format!("node-{}", j % shape.nodes.max(1)),
                "containers": [{"name": "c", "ports": [
                    {"name": "http", "containerPort": 8080},
                    {"name": "metrics", "containerPort": 9090},
                ]}],
            },
            "status": {"podIP": pod_ip(j).to_string(), "phase": "Running"},
        })));
    }
    for k in 0..shape.network_policies {
        let ns = k % ns_count;
        let spec = if k % 2 == 0 {
            json!({
                "podSelector": {"matchLabels": {"app": format!("a{}", rng.below(APPS))}},
                "ingress": [
                    {"from": [{"podSelector": {"matchLabels": {"app": format!("a{}", rng.below(APPS))}}}]},
                    {"from": [{"namespaceSelector": {"matchLabels": {"team": format!("t{}", rng.below(TEAMS))}}}],
                     "ports": [{"port": "http"}, {"port": 9090, "protocol": "TCP"}]},
                ],
            })
        } else {
            json!({
                "podSelector": {"matchLabels": {"tier": TIERS[rng.below(3)]}},
                "policyTypes": ["Egress"],
                "egress": [
                    {"to": [{"namespaceSelector": {"matchLabels": {"team": format!("t{}", rng.below(TEAMS))}}}]},
                    {"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.128.0.0/16"]}}],
                     "ports": [{"port": 443}, {"port": 32000, "endPort": 32768}]},
                ],
            })
        };
        inputs.network_policies.push(decode(json!({
            "metadata": {"name": format!("np-{k}"), "namespace": format!("ns-{ns}")},
            "spec": spec,
        })));
    }
    // Admin policies are built as typed values: a million peers through JSON would make
    // generation, not compilation, the slow part of a benchmark.
    use crate::policy::api::{LabelSelector, NamespacedPod, v1alpha1 as a1};
    let labels = |k: &str, v: String| LabelSelector {
        match_labels: Some([(k, v)].into_iter().collect()),
        match_expressions: None,
    };
    let actions = [
        a1::AdminNetworkPolicyRuleAction::Allow,
        a1::AdminNetworkPolicyRuleAction::Deny,
        a1::AdminNetworkPolicyRuleAction::Pass,
    ];
    for a in 0..shape.admin_policies {
        let namespaces = if shape.admin_selects_all {
            LabelSelector::default()
        } else if a % 10 == 0 {
            labels("env", "prod".into())
        } else {
            labels("team", format!("t{}", a % TEAMS))
        };
        let mut ingress = Vec::new();
        let mut egress = Vec::new();
        for r in 0..shape.rules_per_admin_policy.min(100) {
            let peers = 1 + rng.below(shape.max_peers.clamp(1, 100));
            let mut from = Vec::with_capacity(peers);
            let mut to = Vec::with_capacity(peers);
            let mut has_networks = false;
            for _ in 0..peers {
                let pods = NamespacedPod {
                    namespace_selector: labels("team", format!("t{}", rng.below(TEAMS))),
                    pod_selector: labels("app", format!("a{}", rng.below(APPS))),
                };
                from.push(a1::AdminNetworkPolicyIngressPeer {
                    pods: Some(pods.clone()),
                    ..Default::default()
                });
                to.push(if rng.below(4) == 0 {
                    has_networks = true;
                    let net = format!("192.{}.{}.0/24", rng.below(256), rng.below(256));
                    a1::AdminNetworkPolicyEgressPeer {
                        networks: Some(vec![net]),
                        ..Default::default()
                    }
                } else {
                    a1::AdminNetworkPolicyEgressPeer { pods: Some(pods), ..Default::default() }
                });
            }
            let port = 1000 + rng.below(64) as i32;
            let number = a1::AdminNetworkPolicyPort {
                port_number: Some(a1::Port { protocol: Some("TCP".into()), port }),
                ..Default::default()
            };
            let named = a1::AdminNetworkPolicyPort {
                named_port: Some("metrics".into()),
                ..Default::default()
            };
            let ports = Some(vec![number.clone(), named]);
            // CEL: "networks/nodes peer cannot be set with namedPorts".
            let egress_ports = if has_networks { Some(vec![number]) } else { ports.clone() };
            ingress.push(a1::AdminNetworkPolicyIngressRule {
                name: format!("in-{r}"),
                action: actions[(a + r) % 3],
                from,
                ports: ports.clone(),
            });
            egress.push(a1::AdminNetworkPolicyEgressRule {
                name: format!("out-{r}"),
                action: actions[(a + r + 1) % 3],
                to,
                ports: egress_ports,
            });
        }
        let mut anp = a1::AdminNetworkPolicy::new(
            &format!("anp-{a}"),
            a1::AdminNetworkPolicySpec {
                priority: (a % 1001) as i32,
                subject: a1::AdminNetworkPolicySubject { namespaces: Some(namespaces), pods: None },
                ingress,
                egress,
            },
        );
        anp.status = None;
        inputs.admin_network_policies.push(std::sync::Arc::new(anp));
    }
    inputs.baseline_admin_network_policies.push(decode(json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha1",
        "kind": "BaselineAdminNetworkPolicy",
        "metadata": {"name": "default"},
        "spec": {
            "subject": {"namespaces": {}},
            "ingress": [{"name": "deny-other-teams", "action": "Deny", "from": [{"namespaces": {"matchExpressions": [
                {"key": "team", "operator": "NotIn", "values": ["t0"]}]}}]}],
            "egress": [{"name": "allow-all", "action": "Allow", "to": [{"networks": ["0.0.0.0/0"]}]}],
        },
    })));
    inputs
}

/// `n` random flows of a cluster of `shape`: mostly pod to pod, some to external
/// addresses, ports spread over the ones the policies name and others.
pub fn flows(shape: Shape, n: usize, seed: u64) -> Vec<Flow> {
    let mut rng = Rng::new(seed);
    let ports = [80u16, 443, 1000, 1010, 1063, 8080, 9090, 32100, 5432];
    (0..n)
        .map(|_| {
            let src = IpAddr::V4(pod_ip(rng.below(shape.pods)));
            let dst = if rng.below(10) == 0 {
                IpAddr::V4(Ipv4Addr::new(192, rng.below(256) as u8, rng.below(256) as u8, 7))
            } else {
                IpAddr::V4(pod_ip(rng.below(shape.pods)))
            };
            let protocol = if rng.below(8) == 0 { Protocol::Udp } else { Protocol::Tcp };
            Flow { src, dst, protocol, dst_port: ports[rng.below(ports.len())] }
        })
        .collect()
}

/// Sizes of the Antrea-native policy set added to a synthetic cluster
/// (`shared/reference/antrea-model.md`; issue #22's benchmark).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AntreaShape {
    /// Custom Tier objects (at most [`MAX_TIERS`] less the six static Tiers; the generator
    /// places them below 220 and in 221–250, avoiding the static Tiers' priorities).
    ///
    /// [`MAX_TIERS`]: crate::policy::antrea_tiers::MAX_TIERS
    pub custom_tiers: usize,
    /// Antrea ClusterNetworkPolicies (ACNPs) per Tier, in every custom Tier and in each of
    /// the six static ones.
    pub acnps_per_tier: usize,
    /// Antrea NetworkPolicies (ANNPs), spread over namespaces and the `securityops`,
    /// `application` and `baseline` Tiers.
    pub annps: usize,
    /// Rules per Antrea policy and direction.
    pub rules_per_policy: usize,
    /// Most peers per rule; rules have 1..=this.
    pub max_peers: usize,
}

impl AntreaShape {
    /// Issue #22's benchmark set: 20 Tiers × 50 ACNPs × 20 rules, and 500 ANNPs (20 rules
    /// each), on top of [`Shape::LARGE`]. The issue asks for 20 *custom* Tiers; Antrea admits
    /// at most [`MAX_TIERS`] (20) Tiers in all, the six static ones included (antrea-model.md
    /// §2, `tier.go` `maxSupportedTiers`), so the set holds 14 custom Tiers and fills the
    /// static ones too: the same 20 Tiers and 1,000 ACNPs.
    ///
    /// [`MAX_TIERS`]: crate::policy::antrea_tiers::MAX_TIERS
    pub const ISSUE_22: AntreaShape = AntreaShape {
        custom_tiers: 14,
        acnps_per_tier: 50,
        annps: 500,
        rules_per_policy: 20,
        max_peers: 5,
    };
}

/// The priority of custom Tier `t` of [`antrea`]: three quarters of them below 220 (before
/// ClusterNetworkPolicy `tier: Admin`), the rest in 221–250, none on a static Tier's
/// priority (50, 100, 150, 200, 250, 253).
fn custom_tier_priority(t: usize, tiers: usize) -> i32 {
    let low = tiers - tiers / 4;
    let p = if t < low { 1 + (t * 210 / low.max(1)) } else { 221 + (t - low) * 28 / (tiers - low) };
    let p = p as i32;
    if p % 50 == 0 { p + 1 } else { p }
}

/// The Antrea-native objects of `shape` over the namespaces, apps and pods of `cluster`
/// (same vocabulary as [`cluster`]), from `seed`: custom Tiers, ACNPs in them and in the
/// static Tiers, and ANNPs.
///
/// Realistic mix, deterministic per seed:
/// - appliedTo: a team's namespaces (every fifth policy narrowed to one app), every
///   twenty-fifth policy with rule-level appliedTo instead (subject-dependent rules);
/// - actions cycle Allow, Drop, Reject, Pass (Pass is not used in `baseline`);
/// - peers: an app in a team's namespaces; an app alone (across the cluster in an ACNP, in
///   the policy's namespace in an ANNP); in egress rules a /24 outside the pod network; and
///   in every twentieth ACNP `namespaces.match: Self` (in another twentieth, the `fe` pods
///   of namespaces with the subject's `env`: `namespaces.sameLabels`);
/// - ports: one number in 1000–1063, the named port `metrics`, or a range (endPort);
/// - priorities repeat in pairs inside a Tier, so policies of equal priority interleave.
pub fn antrea(
    shape: AntreaShape,
    cluster: Shape,
    seed: u64,
) -> crate::policy::api::antrea::Objects {
    let mut rng = Rng::new(seed ^ 0xA27EA);
    let ns_count = cluster.namespaces.max(1);
    let mut out = crate::policy::api::antrea::Objects::default();
    for t in 0..shape.custom_tiers {
        out.tiers.push(decode(json!({
            "apiVersion": "crd.antrea.io/v1beta1", "kind": "Tier",
            "metadata": {"name": format!("tier-{t}")},
            "spec": {"priority": custom_tier_priority(t, shape.custom_tiers)},
        })));
    }
    let actions = ["Allow", "Drop", "Reject", "Pass"];
    let rules = |k: usize,
                 ingress: bool,
                 namespaced: bool,
                 baseline: bool,
                 rule_applied: bool,
                 rng: &mut Rng| {
        (0..shape.rules_per_policy)
            .map(|r| {
                let mut action = actions[(k + r + usize::from(ingress)) % 4];
                if baseline && action == "Pass" {
                    action = "Drop";
                }
                let peers: Vec<Value> = (0..1 + rng.below(shape.max_peers.max(1)))
                    .map(|_| match rng.below(8) {
                        0 if !ingress => json!({"ipBlock": {"cidr": format!("192.{}.{}.0/24", rng.below(256), rng.below(256))}}),
                        0 | 1 => json!({"podSelector": {"matchLabels": {"app": format!("a{}", rng.below(APPS))}}}),
                        2 if !namespaced && k.is_multiple_of(20) => json!({"namespaces": {"match": "Self"}}),
                        2 if !namespaced && k % 20 == 10 => json!({"namespaces": {"sameLabels": ["env"]}, "podSelector": {"matchLabels": {"tier": "fe"}}}),
                        _ => json!({"namespaceSelector": {"matchLabels": {"team": format!("t{}", rng.below(TEAMS))}},
                                    "podSelector": {"matchLabels": {"app": format!("a{}", rng.below(APPS))}}}),
                    })
                    .collect();
                let ports = match rng.below(4) {
                    0 => json!([{"protocol": "TCP", "port": "metrics"}]),
                    1 => json!([{"protocol": "TCP", "port": 32000, "endPort": 32768}]),
                    _ => json!([{"protocol": if rng.below(8) == 0 { "UDP" } else { "TCP" }, "port": 1000 + rng.below(64)}]),
                };
                let mut rule = json!({
                    "name": format!("{}-{r}", if ingress { "in" } else { "out" }),
                    "action": action,
                    if ingress { "from" } else { "to" }: peers,
                    "ports": ports,
                });
                if rule_applied {
                    rule["appliedTo"] = json!([{"podSelector": {"matchLabels": {"app": format!("a{}", rng.below(APPS))}}}]);
                }
                rule
            })
            .collect::<Vec<Value>>()
    };
    let applied_to = |k: usize, namespaced: bool, rng: &mut Rng| {
        let app = json!({"matchLabels": {"app": format!("a{}", rng.below(APPS))}});
        let team = json!({"matchLabels": {"team": format!("t{}", rng.below(TEAMS))}});
        match (namespaced, k.is_multiple_of(5)) {
            (true, true) => json!([{"podSelector": app}]),
            (true, false) => json!([{"podSelector": {}}]),
            (false, true) => json!([{"namespaceSelector": team, "podSelector": app}]),
            (false, false) => json!([{"namespaceSelector": team}]),
        }
    };
    let tiers = (0..shape.custom_tiers)
        .map(|t| format!("tier-{t}"))
        .chain(crate::policy::antrea_tiers::STATIC_TIERS.iter().map(|(name, _)| name.to_string()));
    for (t, tier) in tiers.enumerate() {
        let baseline = tier == "baseline";
        for i in 0..shape.acnps_per_tier {
            let k = t * shape.acnps_per_tier + i;
            let rule_applied = k % 25 == 24;
            let mut spec = json!({
                "tier": tier,
                "priority": 1.0 + (i / 2) as f64 * 0.5,
                "ingress": rules(k, true, false, baseline, rule_applied, &mut rng),
                "egress": rules(k, false, false, baseline, rule_applied, &mut rng),
            });
            if !rule_applied {
                spec["appliedTo"] = applied_to(k, false, &mut rng);
            }
            out.cluster_network_policies.push(decode(json!({
                "apiVersion": "crd.antrea.io/v1beta1", "kind": "ClusterNetworkPolicy",
                "metadata": {"name": format!("acnp-{tier}-{i}")},
                "spec": spec,
            })));
        }
    }
    let annp_tiers = ["securityops", "application", "baseline"];
    for k in 0..shape.annps {
        let tier = annp_tiers[k % 3];
        let rule_applied = k % 25 == 24;
        let mut spec = json!({
            "tier": tier,
            "priority": 1.0 + (k % 10) as f64,
            "ingress": rules(k, true, true, tier == "baseline", rule_applied, &mut rng),
            "egress": rules(k, false, true, tier == "baseline", rule_applied, &mut rng),
        });
        if !rule_applied {
            spec["appliedTo"] = applied_to(k, true, &mut rng);
        }
        out.network_policies.push(decode(json!({
            "apiVersion": "crd.antrea.io/v1beta1", "kind": "NetworkPolicy",
            "metadata": {"name": format!("annp-{k}"), "namespace": format!("ns-{}", k % ns_count)},
            "spec": spec,
        })));
    }
    out
}
