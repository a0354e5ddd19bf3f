//! Antrea-native tiers decided with real manifests: one row per rule of
//! `shared/reference/antrea-model.md` (sections cited per row), each naming the Antrea
//! source (code, docs or e2e test) it follows.
//!
//! Every row builds the small cluster below, adds its policies, decides one flow and checks
//! the verdict and, per direction, which tier, policy and rule decided.

use std::net::IpAddr;
use std::path::Path;

use tierproxy::cluster::manifest::parse_str;
use tierproxy::policy::{Basis, Decision, Flow, Outcome, Protocol, Revision, Snapshot, Verdict};

/// Two nodes; namespaces `prod` (env=prod, team=a), `dev` (env=dev, team=a), `mon`
/// (role=monitoring, no team); pods:
/// - prod/web 10.1.1.1 (app=web, node-1; port http=8080/TCP)
/// - prod/db 10.1.1.2 (app=db, node-1)
/// - dev/web 10.1.2.1 (app=web, node-2; port http=9090/TCP)
/// - mon/prom 10.1.2.2 (app=prom, node-2)
/// - kube-system/agent 172.18.0.2 (hostNetwork on node-1)
const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {zone: a}}
status: {addresses: [{type: InternalIP, address: 172.18.0.2}]}
---
apiVersion: v1
kind: Node
metadata: {name: node-2, labels: {zone: b}}
status: {addresses: [{type: InternalIP, address: 172.18.0.3}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: prod, labels: {env: prod, team: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: dev, labels: {env: dev, team: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: mon, labels: {role: monitoring}}
---
apiVersion: v1
kind: Namespace
metadata: {name: kube-system}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: prod, labels: {app: web}}
spec: {nodeName: node-1, containers: [{name: c, ports: [{name: http, containerPort: 8080}]}]}
status: {podIP: 10.1.1.1}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: prod, labels: {app: db}}
spec: {nodeName: node-1, containers: [{name: c}]}
status: {podIP: 10.1.1.2}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: dev, labels: {app: web}}
spec: {nodeName: node-2, containers: [{name: c, ports: [{name: http, containerPort: 9090}]}]}
status: {podIP: 10.1.2.1}
---
apiVersion: v1
kind: Pod
metadata: {name: prom, namespace: mon, labels: {app: prom}}
spec: {nodeName: node-2, containers: [{name: c}]}
status: {podIP: 10.1.2.2}
---
apiVersion: v1
kind: Pod
metadata: {name: agent, namespace: kube-system, labels: {app: agent}}
spec: {nodeName: node-1, hostNetwork: true, containers: [{name: c}]}
status: {podIP: 172.18.0.2}
"#;

mod common;

fn snapshot(policies: &str) -> Snapshot {
    common::compile_clean(CLUSTER, policies)
}

fn ip(what: &str) -> IpAddr {
    match what {
        "prod/web" => "10.1.1.1",
        "prod/db" => "10.1.1.2",
        "dev/web" => "10.1.2.1",
        "mon/prom" => "10.1.2.2",
        "node-1" | "kube-system/agent" => "172.18.0.2",
        "node-2" => "172.18.0.3",
        "external" => "203.0.113.10",
        other => other,
    }
    .parse()
    .unwrap_or_else(|_| panic!("unknown endpoint {what}"))
}

fn decide(s: &Snapshot, from: &str, to: &str, protocol: Protocol, port: u16) -> Decision {
    s.decide(&Flow { src: ip(from), dst: ip(to), protocol, dst_port: port })
}

/// `tier:name#rule` of the rule that decided, `isolated:name`, `default`, `own-node`, or
/// `n/a`.
fn basis(s: &Snapshot, o: Option<&Outcome>) -> String {
    let Some(o) = o else { return "n/a".into() };
    match o.basis {
        Basis::Rule { hit, .. } => format!(
            "{}:{}#{}",
            s.policy_tier_name(hit.policy),
            s.policy_ref(hit.policy).name,
            hit.rule
        ),
        Basis::Isolated { policy } => format!("isolated:{}", s.policy_ref(policy).name),
        Basis::NoPolicy => "default".into(),
        Basis::OwnNode => "own-node".into(),
    }
}

struct Row {
    /// What the row checks, with its source.
    name: &'static str,
    policies: String,
    from: &'static str,
    to: &'static str,
    protocol: Protocol,
    port: u16,
    verdict: Verdict,
    egress: &'static str,
    ingress: &'static str,
}

const TCP: Protocol = Protocol::Tcp;
const UDP: Protocol = Protocol::Udp;
const ALLOW: Verdict = Verdict::Allow;
const DENY: Verdict = Verdict::Deny;
const REJECT: Verdict = Verdict::Reject;

/// An ACNP: `spec` is the YAML flow mapping of its spec.
fn acnp(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: crd.antrea.io/v1beta1\nkind: ClusterNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {spec}\n---\n"
    )
}

/// An ANNP in namespace `ns`.
fn annp(ns: &str, name: &str, spec: &str) -> String {
    format!(
        "apiVersion: crd.antrea.io/v1beta1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: {ns}}}\nspec: {spec}\n---\n"
    )
}

fn tier(name: &str, priority: i32) -> String {
    format!(
        "apiVersion: crd.antrea.io/v1beta1\nkind: Tier\nmetadata: {{name: {name}}}\nspec: {{priority: {priority}}}\n---\n"
    )
}

fn anp(name: &str, priority: i32, ingress: &str) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {{priority: {priority}, subject: {{namespaces: {{}}}}, ingress: {ingress}}}\n---\n"
    )
}

fn cnp(name: &str, tier: &str, priority: i32, ingress: &str) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: {name}}}\nspec: {{tier: {tier}, priority: {priority}, subject: {{namespaces: {{}}}}, ingress: {ingress}}}\n---\n"
    )
}

fn banp(ingress: &str) -> String {
    format!(
        "apiVersion: policy.networking.k8s.io/v1alpha1\nkind: BaselineAdminNetworkPolicy\nmetadata: {{name: default}}\nspec: {{subject: {{namespaces: {{}}}}, ingress: {ingress}}}\n---\n"
    )
}

/// A NetworkPolicy isolating prod/web's ingress, allowing only prod/db.
const NP_WEB_FROM_DB: &str = "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: web-from-db, namespace: prod}\nspec: {podSelector: {matchLabels: {app: web}}, ingress: [{from: [{podSelector: {matchLabels: {app: db}}}]}]}\n---\n";

/// Every ACNP applied to prod/web alone.
const WEB: &str = "appliedTo: [{podSelector: {matchLabels: {app: web}}, namespaceSelector: {matchLabels: {env: prod}}}]";

fn rows() -> Vec<Row> {
    let all_from = |action: &str| format!("[{{action: {action}}}]");
    vec![
        Row {
            name: "§2 static tier securityops exists without a Tier object (tier.go priorityMap)",
            policies: acnp(
                "drop",
                &format!(
                    "{{tier: securityops, priority: 1, {WEB}, ingress: {}}}",
                    all_from("Drop")
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "securityops:drop#0",
        },
        Row {
            name: "§2 a policy without tier is in application (mutate.go mutateAntreaPolicy)",
            policies: acnp(
                "drop",
                &format!("{{priority: 1, {WEB}, ingress: {}}}", all_from("Drop")),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:drop#0",
        },
        Row {
            name: "§3 application (250) precedes ANP (251) whatever their priorities",
            policies: acnp(
                "drop",
                &format!(
                    "{{tier: application, priority: 10000, {WEB}, ingress: {}}}",
                    all_from("Drop")
                ),
            ) + &anp("allow", 0, "[{action: Allow, from: [{namespaces: {}}]}]"),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:drop#0",
        },
        Row {
            name: "§3 CNP Admin (220) precedes every ANP (251) whatever their priorities (issue #22)",
            policies: cnp("deny", "Admin", 999, "[{action: Deny, from: [{namespaces: {}}]}]")
                + &anp("allow", 0, "[{action: Allow, from: [{namespaces: {}}]}]"),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:deny#0",
        },
        Row {
            name: "§3 platform (200) precedes CNP Admin (220)",
            policies: cnp("deny", "Admin", 0, "[{action: Deny, from: [{namespaces: {}}]}]")
                + &acnp(
                    "allow",
                    &format!(
                        "{{tier: platform, priority: 10000, {WEB}, ingress: {}}}",
                        all_from("Allow")
                    ),
                ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "platform:allow#0",
        },
        Row {
            name: "§3 CNP Admin (220) precedes application (250)",
            policies: cnp("deny", "Admin", 999, "[{action: Deny, from: [{namespaces: {}}]}]")
                + &acnp(
                    "allow",
                    &format!(
                        "{{tier: application, priority: 1, {WEB}, ingress: {}}}",
                        all_from("Allow")
                    ),
                ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:deny#0",
        },
        Row {
            name: "§2 a custom Tier of priority 10 precedes emergency (50)",
            policies: tier("first", 10)
                + &acnp(
                    "late",
                    &format!(
                        "{{tier: emergency, priority: 1, {WEB}, ingress: {}}}",
                        all_from("Drop")
                    ),
                )
                + &acnp(
                    "early",
                    &format!(
                        "{{tier: first, priority: 9999, {WEB}, ingress: {}}}",
                        all_from("Allow")
                    ),
                ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "first:early#0",
        },
        Row {
            name: "§3 policy priority is a float: 1.5 precedes 2",
            policies: acnp(
                "a-two",
                &format!("{{priority: 2, {WEB}, ingress: {}}}", all_from("Drop")),
            ) + &acnp(
                "b-one-and-a-half",
                &format!("{{priority: 1.5, {WEB}, ingress: {}}}", all_from("Allow")),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:b-one-and-a-half#0",
        },
        Row {
            name: "§3 same tier and priority interleave by rule index (e2e testACNPRulePriority)",
            policies: acnp(
                "a",
                &format!(
                    "{{priority: 5, {WEB}, ingress: [{{action: Allow, from: [{{namespaceSelector: {{matchLabels: {{role: monitoring}}}}}}]}}, {{action: Drop}}]}}"
                ),
            ) + &annp(
                "prod",
                "b",
                "{priority: 5, appliedTo: [{podSelector: {matchLabels: {app: web}}}], ingress: [{action: Allow, from: [{namespaceSelector: {matchLabels: {env: dev}}}]}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:b#0",
        },
        Row {
            name: "§3 an exact tie (same tier, priority, rule index) is broken by name",
            policies: acnp(
                "a-drop",
                &format!("{{priority: 5, {WEB}, ingress: {}}}", all_from("Drop")),
            ) + &acnp(
                "b-allow",
                &format!("{{priority: 5, {WEB}, ingress: {}}}", all_from("Allow")),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:a-drop#0",
        },
        Row {
            name: "§5 Pass skips later Antrea tiers, CNP Admin and ANP: NetworkPolicy isolation is final (pipeline.go conjunctionActionPassFlow)",
            policies: acnp(
                "pass",
                &format!(
                    "{{tier: securityops, priority: 1, {WEB}, ingress: {}}}",
                    all_from("Pass")
                ),
            ) + &cnp(
                "allow-cnp",
                "Admin",
                1,
                "[{action: Accept, from: [{namespaces: {}}]}]",
            ) + &anp("allow-anp", 1, "[{action: Allow, from: [{namespaces: {}}]}]")
                + NP_WEB_FROM_DB,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:web-from-db",
        },
        Row {
            name: "§5 Pass, no isolation: the baseline Tier decides (§11.4)",
            policies: acnp(
                "pass",
                &format!(
                    "{{tier: securityops, priority: 1, {WEB}, ingress: {}}}",
                    all_from("Pass")
                ),
            ) + &acnp(
                "base",
                &format!("{{tier: baseline, priority: 1, {WEB}, ingress: {}}}", all_from("Drop")),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "baseline:base#0",
        },
        Row {
            name: "§4 the baseline Tier is not reached when NetworkPolicy isolates (e2e testBaselineNamespaceIsolation)",
            policies: acnp(
                "base",
                &format!("{{tier: baseline, priority: 1, {WEB}, ingress: {}}}", all_from("Drop")),
            ) + NP_WEB_FROM_DB,
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:web-from-db#0",
        },
        Row {
            name: "§3 Antrea baseline (253) precedes BANP (254)",
            policies: acnp(
                "base",
                &format!(
                    "{{tier: baseline, priority: 10000, {WEB}, ingress: {}}}",
                    all_from("Allow")
                ),
            ) + &banp("[{action: Deny, from: [{namespaces: {}}]}]"),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "baseline:base#0",
        },
        Row {
            name: "§5 Reject is its own verdict (e2e testACNPRejectIngress)",
            policies: acnp(
                "reject",
                &format!("{{priority: 1, {WEB}, ingress: {}}}", all_from("Reject")),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 53,
            verdict: REJECT,
            egress: "default",
            ingress: "application:reject#0",
        },
        Row {
            name: "§4 an egress Drop hides an ingress Reject",
            policies: acnp(
                "reject",
                &format!("{{priority: 1, {WEB}, ingress: {}}}", all_from("Reject")),
            ) + &annp(
                "dev",
                "drop-out",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Drop}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "application:drop-out#0",
            ingress: "application:reject#0",
        },
        Row {
            name: "§4 an egress Reject wins over an ingress Drop (e2e testACNPRejectEgress)",
            policies: acnp(
                "drop",
                &format!("{{priority: 1, {WEB}, ingress: {}}}", all_from("Drop")),
            ) + &annp(
                "dev",
                "reject-out",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Reject}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: REJECT,
            egress: "application:reject-out#0",
            ingress: "application:drop#0",
        },
        Row {
            name: "§5 Allow is final and skips NetworkPolicy isolation (e2e testACNPAllowXBtoA)",
            policies: acnp(
                "allow",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Allow, from: [{{namespaceSelector: {{matchLabels: {{role: monitoring}}}}}}]}}]}}"
                ),
            ) + NP_WEB_FROM_DB,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:allow#0",
        },
        Row {
            name: "§5 Antrea policies never isolate (e2e testACNPAllowNoDefaultIsolation)",
            policies: acnp(
                "allow",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Allow, from: [{{namespaceSelector: {{matchLabels: {{role: monitoring}}}}}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§7 an ACNP podSelector-only peer selects pods of every namespace",
            policies: acnp(
                "drop",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, from: [{{podSelector: {{matchLabels: {{app: web}}}}}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:drop#0",
        },
        Row {
            name: "§7 an ANNP podSelector-only peer selects pods of its own namespace only (docs Key differences)",
            policies: annp(
                "prod",
                "drop",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: web}}}], ingress: [{action: Drop, from: [{podSelector: {matchLabels: {app: web}}}]}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§6 an ANNP appliedTo selects in its own namespace only",
            policies: annp(
                "dev",
                "drop",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: web}}}], ingress: [{action: Drop}]}",
            ),
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§7 namespaces.match Self: the subject's own namespace (docs Selecting Pods in the same Namespace with Self)",
            policies: acnp(
                "self",
                "{priority: 1, appliedTo: [{namespaceSelector: {}}], ingress: [{action: Allow, from: [{namespaces: {match: Self}}]}, {action: Drop}]}",
            ),
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:self#0",
        },
        Row {
            name: "§7 namespaces.match Self: another namespace falls to later rules",
            policies: acnp(
                "self",
                "{priority: 1, appliedTo: [{namespaceSelector: {}}], ingress: [{action: Allow, from: [{namespaces: {match: Self}}]}, {action: Drop}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:self#1",
        },
        Row {
            name: "§7 sameLabels: namespaces with the subject's team value (antreaclusternetworkpolicy.go groupNamespacesByLabelValue)",
            policies: acnp(
                "team",
                "{priority: 1, appliedTo: [{namespaceSelector: {}}], ingress: [{action: Allow, from: [{namespaces: {sameLabels: [team]}}]}, {action: Drop}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:team#0",
        },
        Row {
            name: "§7 sameLabels: a subject whose namespace lacks the key gets no such rule, not even for its own namespace (e2e testACNPStrictNamespacesIsolationByLabels)",
            policies: acnp(
                "team",
                "{priority: 1, appliedTo: [{namespaceSelector: {}}], ingress: [{action: Allow, from: [{namespaces: {sameLabels: [team]}}]}, {action: Drop}]}",
            ),
            from: "mon/prom",
            to: "mon/prom",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:team#1",
        },
        Row {
            name: "§7 an excepted address of an ipBlock falls to later rules (e2e testACNPDropIPBlockWithExcept)",
            policies: acnp(
                "block",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, from: [{{ipBlock: {{cidr: 10.1.0.0/16, except: [10.1.2.0/24]}}}}]}}, {{action: Reject}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: REJECT,
            egress: "default",
            ingress: "application:block#1",
        },
        Row {
            name: "§7 an ipBlock matches pod IPs",
            policies: acnp(
                "block",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, from: [{{ipBlock: {{cidr: 10.1.0.0/16, except: [10.1.2.0/24]}}}}]}}, {{action: Reject}}]}}"
                ),
            ),
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:block#0",
        },
        Row {
            name: "§7 nodeSelector selects node IPs (docs Node Selector)",
            policies: acnp(
                "nodes",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: prom}}}], ingress: [{action: Drop, from: [{nodeSelector: {matchLabels: {zone: a}}}]}]}",
            ),
            from: "node-1",
            to: "mon/prom",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "n/a",
            ingress: "application:nodes#0",
        },
        Row {
            name: "§10 ingress from the subject's own node is always allowed, nodeSelector too",
            policies: acnp(
                "nodes",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: prom}}}], ingress: [{action: Drop, from: [{nodeSelector: {}}]}]}",
            ),
            from: "node-2",
            to: "mon/prom",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "own-node",
        },
        Row {
            name: "§8 a named port resolves on the destination pod (pod_reconciler.go resolveService)",
            policies: annp(
                "dev",
                "to-http",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Drop, ports: [{port: http}]}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: DENY,
            egress: "application:to-http#0",
            ingress: "default",
        },
        Row {
            name: "§8 a named port does not match another pod's number",
            policies: annp(
                "dev",
                "to-http",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Drop, ports: [{port: http}]}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 9090,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§8 endPort is inclusive (e2e testACNPPortRange)",
            policies: acnp(
                "range",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, ports: [{{protocol: TCP, port: 8000, endPort: 8080}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: DENY,
            egress: "default",
            ingress: "application:range#0",
        },
        Row {
            name: "§8 protocol defaults to TCP: a port rule does not match UDP",
            policies: acnp(
                "tcp",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, ports: [{{port: 53}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 53,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§8 protocols (ICMP) never match TCP/UDP/SCTP",
            policies: acnp(
                "icmp",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, protocols: [{{icmp: {{icmpType: 8}}}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§9 an egress fqdn peer in an Allow rule matches nothing",
            policies: annp(
                "dev",
                "fqdn",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Allow, to: [{fqdn: example.com}]}, {action: Drop}]}",
            ),
            from: "dev/web",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: DENY,
            egress: "application:fqdn#1",
            ingress: "n/a",
        },
        Row {
            name: "§9 a Drop rule holding a peer this engine cannot evaluate applies to all traffic its ports select",
            policies: annp(
                "dev",
                "fqdn",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Drop, to: [{fqdn: example.com}], ports: [{port: 443}]}]}",
            ),
            from: "dev/web",
            to: "mon/prom",
            protocol: TCP,
            port: 443,
            verdict: DENY,
            egress: "application:fqdn#0",
            ingress: "default",
        },
        Row {
            name: "§9 the fail-closed Drop still selects only its ports",
            policies: annp(
                "dev",
                "fqdn",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Drop, to: [{fqdn: example.com}], ports: [{port: 443}]}]}",
            ),
            from: "dev/web",
            to: "mon/prom",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§9 a Pass rule holding a serviceAccount peer acts as a drop",
            policies: acnp(
                "sa",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Pass, from: [{{serviceAccount: {{name: x, namespace: dev}}}}]}}]}}"
                ),
            ),
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:sa#0",
        },
        Row {
            name: "§6 a rule-level appliedTo scopes only that rule (validate.go validateAppliedTo)",
            policies: acnp(
                "per-rule",
                "{priority: 1, ingress: [{action: Drop, appliedTo: [{podSelector: {matchLabels: {app: db}}}]}, {action: Allow, appliedTo: [{podSelector: {matchLabels: {app: web}}}]}]}",
            ) + NP_WEB_FROM_DB,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "application:per-rule#1",
        },
        Row {
            name: "§6 ...and the other rule applies to its own subjects",
            policies: acnp(
                "per-rule",
                "{priority: 1, ingress: [{action: Drop, appliedTo: [{podSelector: {matchLabels: {app: db}}}]}, {action: Allow, appliedTo: [{podSelector: {matchLabels: {app: web}}}]}]}",
            ),
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:per-rule#0",
        },
        Row {
            name: "§6 hostNetwork pods are never subjects (networkpolicy_controller.go)",
            policies: acnp(
                "all",
                "{priority: 1, appliedTo: [{namespaceSelector: {}}], egress: [{action: Drop}]}",
            ),
            from: "kube-system/agent",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "n/a",
        },
        Row {
            name: "§11.5 an empty ANNP peer selects every pod of its namespace (group.go NewGroupSelector)",
            policies: annp(
                "prod",
                "empty-peer",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: web}}}], ingress: [{action: Drop, from: [{}]}]}",
            ),
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:empty-peer#0",
        },
        Row {
            name: "§11.5 ...and no pod of another namespace",
            policies: annp(
                "prod",
                "empty-peer",
                "{priority: 1, appliedTo: [{podSelector: {matchLabels: {app: web}}}], ingress: [{action: Drop, from: [{}]}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§11.5 an empty ANNP appliedTo entry selects every pod of its namespace",
            policies: annp(
                "prod",
                "empty-applied",
                "{priority: 1, appliedTo: [{}], ingress: [{action: Drop}]}",
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:empty-applied#0",
        },
        Row {
            name: "§7 an empty ACNP peer selects nothing (group_entity_index.go match)",
            policies: acnp(
                "empty-peer",
                &format!("{{priority: 1, {WEB}, ingress: [{{action: Drop, from: [{{}}]}}]}}"),
            ),
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "§9 sameLabels: [] names no label: an Allow matches nothing through it",
            policies: acnp(
                "no-labels",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Allow, from: [{{namespaces: {{sameLabels: []}}}}]}}, {{action: Drop}}]}}"
                ),
            ),
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:no-labels#1",
        },
        Row {
            name: "§9 a misspelt peer key fails closed: a Drop applies to all traffic its ports select",
            policies: acnp(
                "typo",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Drop, from: [{{podSelectr: {{matchLabels: {{app: prom}}}}}}]}}]}}"
                ),
            ),
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:typo#0",
        },
        Row {
            name: "§9 a peer with an unknown key matches nothing in an Allow",
            policies: acnp(
                "extra",
                &format!(
                    "{{priority: 1, {WEB}, ingress: [{{action: Allow, from: [{{podSelector: {{matchLabels: {{app: prom}}}}, color: red}}]}}, {{action: Drop}}]}}"
                ),
            ),
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "application:extra#1",
        },
        Row {
            name: "§9 scope in an egress peer is outside its schema: an Allow matches nothing through it",
            policies: annp(
                "dev",
                "scoped",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Allow, to: [{podSelector: {}, scope: Cluster}]}, {action: Drop}]}",
            ),
            from: "dev/web",
            to: "dev/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "application:scoped#1",
            ingress: "default",
        },
        Row {
            name: "§7 an absent from matches every address, external ones too (crd_utils.go matchAllPeer)",
            policies: annp(
                "dev",
                "all-out",
                "{priority: 1, appliedTo: [{podSelector: {}}], egress: [{action: Reject}]}",
            ),
            from: "dev/web",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: REJECT,
            egress: "application:all-out#0",
            ingress: "n/a",
        },
    ]
}

#[test]
fn antrea_semantics_table() {
    let mut failures = Vec::new();
    for r in rows() {
        let s = snapshot(&r.policies);
        let d = decide(&s, r.from, r.to, r.protocol, r.port);
        let got = (d.verdict, basis(&s, d.egress.as_ref()), basis(&s, d.ingress.as_ref()));
        let want = (r.verdict, r.egress.to_owned(), r.ingress.to_owned());
        if got != want {
            failures.push(format!("{}:\n    got  {got:?}\n    want {want:?}", r.name));
        }
        // The fast path (port index, matchers) decides as the reference walk does.
        let f = Flow { src: ip(r.from), dst: ip(r.to), protocol: r.protocol, dst_port: r.port };
        assert_eq!(s.decide_reference(&f), d, "{}: reference and fast path differ", r.name);
    }
    assert!(failures.is_empty(), "{} row(s) failed:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn rows_are_distinct() {
    let rows = rows();
    for (i, a) in rows.iter().enumerate() {
        for b in &rows[i + 1..] {
            assert_ne!(a.name, b.name, "two rows share a name");
        }
    }
}

/// A Pass is recorded on the way with the Antrea Tier's name.
#[test]
fn pass_is_recorded_with_the_tier_name() {
    let s = snapshot(
        &(acnp(
            "pass",
            &format!("{{tier: securityops, priority: 1, {WEB}, ingress: [{{action: Pass}}]}}"),
        ) + NP_WEB_FROM_DB),
    );
    let d = decide(&s, "dev/web", "prod/web", TCP, 80);
    let o = d.ingress.unwrap();
    assert_eq!(o.passed.len(), 1);
    assert_eq!(s.policy_tier_name(o.passed[0].policy), "securityops");
    assert_eq!(s.policy_ref(o.passed[0].policy).name, "pass");
}

/// An exact tie is reported on both policies, naming the other and who goes first; two
/// policies of one priority in different Tiers are no tie.
#[test]
fn exact_ties_are_reported_on_both_policies() {
    let s = snapshot(
        &(acnp("a-drop", &format!("{{priority: 5, {WEB}, ingress: [{{action: Drop}}]}}"))
            + &acnp("b-allow", &format!("{{priority: 5, {WEB}, ingress: [{{action: Allow}}]}}"))
            + &acnp(
                "c-other-tier",
                &format!("{{tier: platform, priority: 5, {WEB}, ingress: [{{action: Allow}}]}}"),
            )),
    );
    let ties: Vec<String> = tierproxy::policy::compile::priority_conflicts(&s)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ties.len(), 2, "{ties:#?}");
    assert!(
        ties[0].contains("ClusterNetworkPolicy.crd.antrea.io a-drop: spec.priority"),
        "{ties:#?}"
    );
    assert!(
        ties[0].contains(
            "tier application priority 5 is shared with ClusterNetworkPolicy.crd.antrea.io b-allow"
        ),
        "{ties:#?}"
    );
    assert!(
        ties[0]
            .contains("at ingress[0] both have one; evaluated in name order, this policy's first"),
        "{ties:#?}"
    );
    assert!(ties[1].contains("b-allow") && ties[1].contains("the other's first"), "{ties:#?}");
}

/// Of two Tiers with one priority, the one created first is admitted (by name when
/// neither has a creation time), whatever the order of the input: a compile does not
/// depend on input order.
#[test]
fn which_of_two_tiers_of_one_priority_is_admitted_does_not_depend_on_input_order() {
    let policy =
        acnp("pa", &format!("{{tier: a, priority: 1, {WEB}, ingress: [{{action: Drop}}]}}"));
    for tiers in [tier("a", 10) + &tier("b", 10), tier("b", 10) + &tier("a", 10)] {
        let text = format!("{CLUSTER}\n---\n{tiers}{policy}");
        let loaded = parse_str(Path::new("t.yaml"), &text).unwrap();
        let c = Snapshot::compile(&loaded.inputs, Revision(1));
        let errors: Vec<String> =
            c.problems.iter().filter(|p| p.is_error()).map(ToString::to_string).collect();
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert!(errors[0].starts_with("error: Tier.crd.antrea.io b: spec.priority"), "{errors:#?}");
        let d = decide(&c.snapshot, "dev/web", "prod/web", TCP, 80);
        assert_eq!(d.verdict, DENY);
    }
}

/// A port outside 1–65535 (refused by validation; possible only in a compile that skips
/// it) selects no port: it is never clamped onto 65535, and an endPort below port never
/// panics.
#[test]
fn an_unvalidated_port_out_of_range_selects_no_port() {
    let policy = acnp(
        "big",
        &format!(
            "{{priority: 1, {WEB}, ingress: [{{action: Drop, ports: [{{port: 70000}}, {{port: 90, endPort: 80}}]}}]}}"
        ),
    );
    let text = format!("{CLUSTER}\n---\n{policy}");
    let loaded = parse_str(Path::new("t.yaml"), &text).unwrap();
    assert!(Snapshot::compile(&loaded.inputs, Revision(1)).problems.iter().any(|p| p.is_error()));
    let s = Snapshot::compile_validated(&loaded.inputs, Revision(1)).snapshot;
    for port in [65535, 80, 85, 90] {
        let d = decide(&s, "dev/web", "prod/web", TCP, port);
        assert_eq!(d.verdict, ALLOW, "port {port}");
    }
}

/// A compile that validates checks each Antrea policy where it compiles it and leaves
/// out one with an error, as Antrea's API server refuses it: the traffic its valid rules
/// name is decided as without it. A compile of the same objects taken as validated keeps
/// it (so the policy is not left out for another reason). Its problems come after the
/// Tiers' and the duplicates', policy by policy: ACNPs by name, then ANNPs by namespace
/// and name.
#[test]
fn a_validating_compile_leaves_out_an_antrea_policy_with_an_error() {
    let bad = acnp(
        "b-bad",
        &format!("{{priority: 20000, {WEB}, ingress: [{{action: Drop, ports: [{{port: 80}}]}}]}}"),
    );
    let odd_annp = annp(
        "prod",
        "a-odd",
        "{priority: 0, appliedTo: [{podSelector: {}}], ingress: [{action: Drop}]}",
    );
    let odd_acnp = acnp(
        "a-odd",
        &format!("{{priority: 1, tier: nowhere, {WEB}, ingress: [{{action: Drop}}]}}"),
    );
    let tiers = tier("t", 10) + &tier("t", 10);
    let text = format!("{CLUSTER}\n---\n{tiers}{odd_annp}{bad}{odd_acnp}");
    let loaded = parse_str(Path::new("t.yaml"), &text).unwrap();
    let c = Snapshot::compile(&loaded.inputs, Revision(1));
    let mut objects: Vec<String> = Vec::new();
    for p in &c.problems {
        let o = format!("{}/{}", p.object.namespace.as_deref().unwrap_or("-"), p.object.name);
        if objects.last() != Some(&o) {
            objects.push(o);
        }
    }
    assert_eq!(objects, ["-/t", "-/a-odd", "-/b-bad", "prod/a-odd"], "{:#?}", c.problems);
    let errors = |o: &str| {
        c.problems.iter().any(|p| {
            p.is_error()
                && format!("{}/{}", p.object.namespace.as_deref().unwrap_or("-"), p.object.name)
                    == o
        })
    };
    assert!(errors("-/a-odd") && errors("-/b-bad") && errors("prod/a-odd"), "{:#?}", c.problems);
    assert_eq!(decide(&c.snapshot, "dev/web", "prod/web", TCP, 80).verdict, ALLOW);
    let taken = Snapshot::compile_validated(&loaded.inputs, Revision(1)).snapshot;
    assert_eq!(decide(&taken, "dev/web", "prod/web", TCP, 80).verdict, DENY);
}
