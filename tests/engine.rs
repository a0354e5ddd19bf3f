//! Table-driven tests of the tiered policy semantics, one row per rule of DESIGN §2.
//!
//! Every row builds a small cluster (below), adds the policies of the row, decides one flow
//! and checks the verdict and, per direction, which tier and policy decided.

use std::net::IpAddr;
use std::path::Path;

use tierproxy::cluster::manifest::parse_str;
use tierproxy::policy::{
    Basis, Decision, Direction, Endpoint, Flow, Outcome, Protocol, Revision, Snapshot, Verdict,
};

/// Two nodes; namespaces `prod` (env=prod), `dev` (env=dev), `mon` (role=monitoring);
/// pods:
/// - prod/web 10.1.1.1 (app=web, node-1; ports http=8080/TCP, dns=53/UDP)
/// - prod/db 10.1.1.2 (app=db, node-1)
/// - dev/web 10.1.2.1 (app=web, node-2)
/// - mon/prom 10.1.2.2 (app=prom, node-2)
/// - kube-system/agent 172.18.0.2 (hostNetwork on node-1)
/// - dev/done 10.1.2.9 (phase Succeeded)
const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {zone: a}}
status: {addresses: [{type: InternalIP, address: 172.18.0.2}, {type: Hostname, address: node-1}]}
---
apiVersion: v1
kind: Node
metadata: {name: node-2, labels: {zone: b}}
status: {addresses: [{type: InternalIP, address: 172.18.0.3}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: prod, labels: {env: prod}}
---
apiVersion: v1
kind: Namespace
metadata: {name: dev, labels: {env: dev}}
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
spec:
  nodeName: node-1
  containers: [{name: c, ports: [{name: http, containerPort: 8080}, {name: dns, containerPort: 53, protocol: UDP}]}]
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
---
apiVersion: v1
kind: Pod
metadata: {name: done, namespace: dev, labels: {app: web}}
spec: {nodeName: node-2, containers: [{name: c}]}
status: {podIP: 10.1.2.9, phase: Succeeded}
"#;

const EXTERNAL: &str = "203.0.113.10";

fn snapshot(policies: &str) -> Snapshot {
    let text = format!("{CLUSTER}\n---\n{policies}");
    let loaded = parse_str(Path::new("test.yaml"), &text).expect("test YAML parses");
    assert!(loaded.problems.iter().all(|p| !p.is_error()), "load problems: {:?}", loaded.problems);
    let compiled = Snapshot::compile(&loaded.inputs, Revision(7));
    let errors: Vec<_> = compiled.problems.iter().filter(|p| p.is_error()).collect();
    assert!(errors.is_empty(), "compile errors: {errors:?}");
    compiled.snapshot
}

fn ip(what: &str) -> IpAddr {
    match what {
        "prod/web" => "10.1.1.1",
        "prod/db" => "10.1.1.2",
        "dev/web" => "10.1.2.1",
        "mon/prom" => "10.1.2.2",
        "node-1" | "kube-system/agent" => "172.18.0.2",
        "node-2" => "172.18.0.3",
        "dev/done" => "10.1.2.9",
        "external" => EXTERNAL,
        other => other,
    }
    .parse()
    .unwrap_or_else(|_| panic!("unknown endpoint {what}"))
}

fn decide(s: &Snapshot, from: &str, to: &str, protocol: Protocol, port: u16) -> Decision {
    s.decide(&Flow { src: ip(from), dst: ip(to), protocol, dst_port: port })
}

/// `tier:kind/name` of the policy that decided, `default`, `own-node`, or `n/a`.
fn basis(s: &Snapshot, o: Option<&Outcome>) -> String {
    let Some(o) = o else { return "n/a".into() };
    match o.basis {
        Basis::Rule { tier, hit } => format!("{}:{}", tier.as_str(), s.policy_ref(hit.policy).name),
        Basis::Isolated { policy } => format!("isolated:{}", s.policy_ref(policy).name),
        Basis::NoPolicy => "default".into(),
        Basis::OwnNode => "own-node".into(),
    }
}

struct Row {
    /// The rule of DESIGN §2 this row checks.
    name: &'static str,
    policies: &'static str,
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
const SCTP: Protocol = Protocol::Sctp;
const ALLOW: Verdict = Verdict::Allow;
const DENY: Verdict = Verdict::Deny;

const NP_INGRESS_ONLY: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: ing, namespace: prod}
spec:
  podSelector: {}
  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]
"#;

const NP_WITH_EGRESS: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: both, namespace: prod}
spec:
  podSelector: {matchLabels: {app: web}}
  egress: [{to: [{podSelector: {matchLabels: {app: db}}}]}]
"#;

const ANP_PASS_AND_DENY: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: pass-then-deny}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress:
  - {name: pass-dev, action: Pass, from: [{namespaces: {matchLabels: {env: dev}}}]}
  - {name: deny-all, action: Deny, from: [{namespaces: {}}]}
"#;

/// The row `name`: dev/web → prod/web TCP 80 under a ClusterNetworkPolicy `tier: Baseline`
/// named `cnp` at `priority` accepting all ingress and the BaselineAdminNetworkPolicy
/// denying it, so their order decides (the manifest is leaked: rows hold `&'static str`).
fn baseline_cnp_and_banp(
    name: &'static str,
    priority: u32,
    cnp: &str,
    verdict: Verdict,
    ingress: &'static str,
) -> Row {
    let policies = format!(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {{name: {cnp}}}
spec:
  tier: Baseline
  priority: {priority}
  subject: {{namespaces: {{}}}}
  ingress: [{{action: Accept, from: [{{namespaces: {{}}}}]}}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {{name: default}}
spec:
  subject: {{namespaces: {{}}}}
  ingress: [{{action: Deny, from: [{{namespaces: {{}}}}]}}]
"#
    );
    Row {
        name,
        policies: Box::leak(policies.into_boxed_str()),
        from: "dev/web",
        to: "prod/web",
        protocol: TCP,
        port: 80,
        verdict,
        egress: "default",
        ingress,
    }
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            name: "no policy: default allow",
            policies: "",
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "policyTypes defaults to [Ingress] without egress rules: ingress isolated",
            policies: NP_INGRESS_ONLY,
            from: "mon/prom",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:ing",
        },
        Row {
            name: "policyTypes defaults to [Ingress]: egress not isolated",
            policies: NP_INGRESS_ONLY,
            from: "prod/db",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: ALLOW,
            egress: "default",
            ingress: "n/a",
        },
        Row {
            name: "podSelector without namespaceSelector selects in the policy's namespace only",
            policies: NP_INGRESS_ONLY,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:ing",
        },
        Row {
            name: "podSelector peer matches a pod of the policy's namespace",
            policies: NP_INGRESS_ONLY,
            from: "prod/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:ing",
        },
        Row {
            name: "egress rules without policyTypes add Egress: egress isolated",
            policies: NP_WITH_EGRESS,
            from: "prod/web",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: DENY,
            egress: "isolated:both",
            ingress: "n/a",
        },
        Row {
            name: "egress rules without policyTypes also isolate ingress",
            policies: NP_WITH_EGRESS,
            from: "prod/db",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:both",
        },
        Row {
            name: "explicit policyTypes [Egress] leaves ingress open",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: eg, namespace: prod}
spec: {podSelector: {}, policyTypes: [Egress]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "missing from matches all addresses, external ones included",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: any, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: 80}]}]}
"#,
            from: "external",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "networkpolicy:any",
        },
        Row {
            name: "namespaceSelector {} matches all pods but not external addresses",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: pods-only, namespace: prod}
spec: {podSelector: {}, ingress: [{from: [{namespaceSelector: {}}]}]}
"#,
            from: "external",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "n/a",
            ingress: "isolated:pods-only",
        },
        Row {
            name: "namespaceSelector {} matches pods of every namespace",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: pods-only, namespace: prod}
spec: {podSelector: {}, ingress: [{from: [{namespaceSelector: {}}]}]}
"#,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:pods-only",
        },
        Row {
            name: "namespaceSelector {} does not match a node (hostNetwork) source",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: pods-only, namespace: mon}
spec: {podSelector: {}, ingress: [{from: [{namespaceSelector: {}}]}]}
"#,
            from: "node-1",
            to: "mon/prom",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "n/a",
            ingress: "isolated:pods-only",
        },
        Row {
            name: "podSelector and namespaceSelector in one peer are ANDed",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: and, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {env: dev}}, podSelector: {matchLabels: {app: prom}}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 5432,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:and",
        },
        Row {
            name: "podSelector and namespaceSelector in two peers are ORed",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: or, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{namespaceSelector: {matchLabels: {env: dev}}}, {podSelector: {matchLabels: {app: prom}}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 5432,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:or",
        },
        Row {
            name: "ipBlock matches pod IPs",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: block, namespace: prod}
spec: {podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.1.2.0/24}}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:block",
        },
        Row {
            name: "ipBlock except subtracts",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: block, namespace: prod}
spec: {podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 10.1.0.0/16, except: [10.1.2.0/28]}}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:block",
        },
        Row {
            name: "ipBlock host bits are masked",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: block, namespace: prod}
spec: {podSelector: {}, egress: [{to: [{ipBlock: {cidr: 203.0.113.77/24}}]}], policyTypes: [Egress]}
"#,
            from: "prod/web",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: ALLOW,
            egress: "networkpolicy:block",
            ingress: "n/a",
        },
        Row {
            name: "protocol defaults to TCP: a UDP flow does not match",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: p80, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: 80}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:p80",
        },
        Row {
            name: "endPort is inclusive",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: range, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: 32000, endPort: 32768}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 32768,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:range",
        },
        Row {
            name: "endPort range excludes the port after it",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: range, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: 32000, endPort: 32768}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 32769,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:range",
        },
        Row {
            name: "named port resolves on the destination pod (ingress)",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: named, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: http}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:named",
        },
        Row {
            name: "named port resolves on the destination pod (egress: the peer's port)",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: named, namespace: prod}
spec: {podSelector: {}, policyTypes: [Egress], egress: [{ports: [{port: http}]}]}
"#,
            from: "prod/web",
            to: "dev/web",
            protocol: TCP,
            port: 9090,
            verdict: ALLOW,
            egress: "networkpolicy:named",
            ingress: "default",
        },
        Row {
            name: "named port on the source pod's number does not match the destination",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: named, namespace: prod}
spec: {podSelector: {}, policyTypes: [Egress], egress: [{ports: [{port: http}]}]}
"#,
            from: "prod/web",
            to: "dev/web",
            protocol: TCP,
            port: 8080,
            verdict: DENY,
            egress: "isolated:named",
            ingress: "default",
        },
        Row {
            name: "named port needs the protocol to match too",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: named, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: dns}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 53,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:named",
        },
        Row {
            name: "named port with its declared protocol matches",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: named, namespace: prod}
spec: {podSelector: {}, ingress: [{ports: [{port: dns, protocol: UDP}]}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 53,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:named",
        },
        Row {
            name: "ANP Deny is not overridden by a NetworkPolicy allow",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: deny-dev}
spec:
  priority: 5
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Deny, from: [{namespaces: {matchLabels: {env: dev}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-all, namespace: prod}
spec: {podSelector: {}, ingress: [{}]}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:deny-dev",
        },
        Row {
            name: "ANP Allow is not overridden by NetworkPolicy isolation",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: allow-mon}
spec:
  priority: 5
  subject: {namespaces: {}}
  ingress: [{action: Allow, from: [{namespaces: {matchLabels: {role: monitoring}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 9100,
            verdict: ALLOW,
            egress: "default",
            ingress: "admin:allow-mon",
        },
        Row {
            name: "Pass hands the decision to the NetworkPolicy tier",
            policies: PASS_THEN_NP,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:ing",
        },
        Row {
            name: "Pass skips the rest of the admin tier (the later Deny)",
            policies: ANP_PASS_AND_DENY,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "Pass without NetworkPolicy lets the baseline decide",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: pass-dev}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Pass, from: [{namespaces: {matchLabels: {env: dev}}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "baseline:default",
        },
        Row {
            name: "NetworkPolicy isolation is final: BANP Allow is never reached",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress: [{action: Allow, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:deny-all",
        },
        Row {
            name: "NetworkPolicy allow overrides a BANP Deny",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-dev, namespace: prod}
spec: {podSelector: {}, ingress: [{from: [{namespaceSelector: {matchLabels: {env: dev}}}]}]}
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: BaselineAdminNetworkPolicy
metadata: {name: default}
spec:
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "networkpolicy:allow-dev",
        },
        Row {
            name: "a NetworkPolicy of another namespace does not isolate",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: dev}
spec: {podSelector: {}}
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "lower priority number wins in the admin tier",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: a-deny-20}
spec:
  priority: 20
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: z-allow-10}
spec:
  priority: 10
  subject: {namespaces: {}}
  ingress: [{action: Allow, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "admin:z-allow-10",
        },
        Row {
            name: "equal priorities are ordered by name",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: b-allow}
spec:
  priority: 10
  subject: {namespaces: {}}
  ingress: [{action: Allow, from: [{namespaces: {}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: a-deny}
spec:
  priority: 10
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:a-deny",
        },
        Row {
            name: "rules within a policy apply in written order",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: order}
spec:
  priority: 10
  subject: {namespaces: {}}
  ingress:
  - {action: Allow, from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: web}}}}]}
  - {action: Deny, from: [{namespaces: {}}]}
"#,
            from: "dev/web",
            to: "prod/db",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "admin:order",
        },
        Row {
            name: "ANP networks peer matches pod IPs",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: nets}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress: [{action: Deny, to: [{networks: [10.1.2.0/24]}]}]
"#,
            from: "prod/web",
            to: "dev/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "admin:nets",
            ingress: "default",
        },
        Row {
            name: "ANP networks peer matches node IPs",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: nets}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress: [{action: Deny, to: [{networks: [172.18.0.0/16]}]}]
"#,
            from: "prod/web",
            to: "node-2",
            protocol: TCP,
            port: 10250,
            verdict: DENY,
            egress: "admin:nets",
            ingress: "n/a",
        },
        Row {
            name: "ANP nodes peer matches node IPs by node label",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: nodes}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress: [{action: Deny, to: [{nodes: {matchLabels: {zone: b}}}]}]
"#,
            from: "prod/web",
            to: "node-2",
            protocol: TCP,
            port: 10250,
            verdict: DENY,
            egress: "admin:nodes",
            ingress: "n/a",
        },
        Row {
            name: "ANP nodes peer does not match other nodes",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: nodes}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress: [{action: Deny, to: [{nodes: {matchLabels: {zone: b}}}]}]
"#,
            from: "prod/web",
            to: "node-1",
            protocol: TCP,
            port: 10250,
            verdict: ALLOW,
            egress: "default",
            ingress: "n/a",
        },
        Row {
            name: "ANP nodes peer matches a hostNetwork pod (it has its node's IP)",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: nodes}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress: [{action: Deny, to: [{nodes: {matchLabels: {zone: a}}}]}]
"#,
            from: "prod/web",
            to: "kube-system/agent",
            protocol: TCP,
            port: 9000,
            verdict: DENY,
            egress: "admin:nodes",
            ingress: "n/a",
        },
        Row {
            name: "hostNetwork pods are never subjects",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: deny-egress}
spec:
  priority: 1
  subject: {namespaces: {}}
  egress: [{action: Deny, to: [{networks: [0.0.0.0/0]}]}]
"#,
            from: "kube-system/agent",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "n/a",
        },
        Row {
            name: "hostNetwork pods are never namespace peers",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: deny-kube-system}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {role: monitoring}}}
  ingress: [{action: Deny, from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: kube-system}}}]}]
"#,
            from: "kube-system/agent",
            to: "mon/prom",
            protocol: TCP,
            port: 9090,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "default",
        },
        Row {
            name: "ingress from the pod's own node is always allowed",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: deny-all}
spec:
  priority: 1
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "node-1",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "own-node",
        },
        Row {
            name: "ingress from another node is not exempt",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "node-2",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: DENY,
            egress: "n/a",
            ingress: "isolated:deny-all",
        },
        Row {
            name: "unknown peer kind in an Allow rule matches nothing",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: future-allow}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Allow, from: [{futurePeer: {x: y}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "isolated:deny-all",
        },
        Row {
            name: "unknown peer kind in a Pass rule denies all it applies to",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: future-pass}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Pass, from: [{futurePeer: {x: y}}], ports: [{portNumber: {port: 80}}]}]
"#,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:future-pass",
        },
        Row {
            name: "a fail-closed rule still honours its ports",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: future-deny}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Deny, from: [{futurePeer: {x: y}}], ports: [{portNumber: {port: 80}}]}]
"#,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 81,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        Row {
            name: "domainNames in an Allow rule match nothing (fail closed)",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: domains}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  egress:
  - {action: Allow, to: [{domainNames: [example.com]}]}
  - {action: Deny, to: [{networks: [0.0.0.0/0]}]}
"#,
            from: "prod/web",
            to: "external",
            protocol: TCP,
            port: 443,
            verdict: DENY,
            egress: "admin:domains",
            ingress: "n/a",
        },
        Row {
            name: "ANP portRange is inclusive and protocol-specific",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: range}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Deny, from: [{namespaces: {}}], ports: [{portRange: {protocol: UDP, start: 1000, end: 2000}}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 2000,
            verdict: DENY,
            egress: "default",
            ingress: "admin:range",
        },
        Row {
            name: "ANP namedPort resolves on the destination pod",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: named}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: dev}}}
  egress: [{action: Deny, to: [{namespaces: {}}], ports: [{namedPort: http}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 8080,
            verdict: DENY,
            egress: "admin:named",
            ingress: "default",
        },
        Row {
            name: "egress and ingress are both required: egress deny wins over ingress allow",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: dev-out}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: dev}}}
  egress: [{action: Deny, to: [{namespaces: {matchLabels: {env: prod}}}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "admin:dev-out",
            ingress: "default",
        },
        Row {
            name: "CNP Admin Accept is final for the direction",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: accept-mon}
spec:
  tier: Admin
  priority: 3
  subject: {namespaces: {}}
  ingress: [{action: Accept, from: [{namespaces: {matchLabels: {role: monitoring}}}], protocols: [{tcp: {destinationPort: {number: 9100}}}]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "mon/prom",
            to: "prod/web",
            protocol: TCP,
            port: 9100,
            verdict: ALLOW,
            egress: "default",
            ingress: "admin:accept-mon",
        },
        Row {
            name: "CNP and ANP share the admin priority space",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: cnp-deny-5}
spec:
  tier: Admin
  priority: 5
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: anp-allow-6}
spec:
  priority: 6
  subject: {namespaces: {}}
  ingress: [{action: Allow, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "default",
            ingress: "admin:cnp-deny-5",
        },
        Row {
            name: "CNP Baseline Pass goes on to the default (allow)",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: base-pass}
spec:
  tier: Baseline
  priority: 1
  subject: {namespaces: {}}
  ingress: [{action: Pass, from: [{namespaces: {matchLabels: {env: dev}}}]}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: base-deny}
spec:
  tier: Baseline
  priority: 2
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "default",
            ingress: "default",
        },
        baseline_cnp_and_banp(
            "the BANP ranks at priority 1 among Baseline CNPs (Antrea, antrea-model §3): before one at 900",
            900,
            "base-allow",
            DENY,
            "baseline:default",
        ),
        baseline_cnp_and_banp(
            "a Baseline CNP at priority 0 comes before the BANP",
            0,
            "base-allow",
            ALLOW,
            "baseline:base-allow",
        ),
        baseline_cnp_and_banp(
            "a Baseline CNP tied with the BANP at priority 1: name order (a-allow before default)",
            1,
            "a-allow",
            ALLOW,
            "baseline:a-allow",
        ),
        baseline_cnp_and_banp(
            "a Baseline CNP tied with the BANP at priority 1: name order (default before z-allow)",
            1,
            "z-allow",
            DENY,
            "baseline:default",
        ),
        Row {
            name: "CNP sctp protocol match",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: sctp}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}], protocols: [{sctp: {destinationPort: {range: {start: 3000, end: 4000}}}}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: SCTP,
            port: 3868,
            verdict: DENY,
            egress: "default",
            ingress: "admin:sctp",
        },
        Row {
            name: "CNP destinationNamedPort takes the named port's protocol",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: dns}
spec:
  tier: Admin
  priority: 1
  subject: {namespaces: {}}
  ingress: [{action: Deny, from: [{namespaces: {}}], protocols: [{destinationNamedPort: dns}]}]
"#,
            from: "dev/web",
            to: "prod/web",
            protocol: UDP,
            port: 53,
            verdict: DENY,
            egress: "default",
            ingress: "admin:dns",
        },
        Row {
            name: "terminated pods are not endpoints",
            policies: r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: deny-dev-web}
spec:
  priority: 1
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress: [{action: Deny, from: [{pods: {namespaceSelector: {matchLabels: {env: dev}}, podSelector: {matchLabels: {app: web}}}}]}]
"#,
            from: "dev/done",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: ALLOW,
            egress: "n/a",
            ingress: "default",
        },
        Row {
            name: "external sources are never subjects; ingress still applies",
            policies: r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-all, namespace: prod}
spec: {podSelector: {}}
"#,
            from: "external",
            to: "prod/web",
            protocol: TCP,
            port: 80,
            verdict: DENY,
            egress: "n/a",
            ingress: "isolated:deny-all",
        },
    ]
}

const PASS_THEN_NP: &str = r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: pass-then-deny}
spec:
  priority: 10
  subject: {namespaces: {matchLabels: {env: prod}}}
  ingress:
  - {name: pass-dev, action: Pass, from: [{namespaces: {matchLabels: {env: dev}}}]}
  - {name: deny-all, action: Deny, from: [{namespaces: {}}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: ing, namespace: prod}
spec:
  podSelector: {}
  ingress: [{from: [{podSelector: {matchLabels: {app: web}}}]}]
"#;

#[test]
fn semantics_table() {
    let mut failures = Vec::new();
    for row in rows() {
        let s = snapshot(row.policies);
        let d = decide(&s, row.from, row.to, row.protocol, row.port);
        let got = (d.verdict, basis(&s, d.egress.as_ref()), basis(&s, d.ingress.as_ref()));
        let want = (row.verdict, row.egress.to_string(), row.ingress.to_string());
        if got != want {
            failures.push(format!("{}: got {got:?}, want {want:?}", row.name));
        }
        assert_eq!(d.revision, Revision(7));
    }
    assert!(failures.is_empty(), "{} row(s) failed:\n{}", failures.len(), failures.join("\n"));
}

/// Every row decides a flow of its own: two rows with the same policies and flow check
/// one thing twice, under two names (issue #21).
#[test]
fn rows_are_distinct() {
    let rows = rows();
    let mut seen = std::collections::HashMap::new();
    let mut same = Vec::new();
    for row in &rows {
        let key = (row.policies, row.from, row.to, row.protocol, row.port);
        if let Some(first) = seen.insert(key, row.name) {
            same.push(format!("{first:?} and {:?}", row.name));
        }
    }
    assert!(same.is_empty(), "rows deciding the same flow:\n{}", same.join("\n"));
}

#[test]
fn pass_is_recorded_on_the_way() {
    let s = snapshot(PASS_THEN_NP);
    // prod/web is not in dev: no Pass; the ANP's second rule denies.
    let d = decide(&s, "prod/web", "prod/db", TCP, 80);
    let ing = d.ingress.expect("prod/db is a pod");
    assert_eq!(ing.verdict, Verdict::Deny);
    assert!(ing.passed.is_empty());
    let d = decide(&s, "dev/web", "prod/db", TCP, 80);
    let ing = d.ingress.expect("prod/db is a pod");
    assert_eq!(ing.passed.len(), 1);
    let info = s.rule_info(Direction::Ingress, ing.passed[0]);
    assert_eq!(info.name, Some("pass-dev"));
    assert_eq!(s.policy_ref(ing.passed[0].policy).name, "pass-then-deny");
}

#[test]
fn endpoints_are_classified() {
    let s = snapshot("");
    assert!(matches!(s.endpoint(ip("prod/web")), Endpoint::Pod(_)));
    assert!(matches!(s.endpoint(ip("node-1")), Endpoint::Node(_)));
    assert_eq!(s.endpoint(ip("external")), Endpoint::External);
    assert_eq!(s.endpoint(ip("dev/done")), Endpoint::External);
}

#[test]
fn fail_closed_rule_is_reported_as_such() {
    let s = snapshot(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: future}
spec:
  priority: 1
  subject: {namespaces: {}}
  egress: [{name: r, action: Pass, to: [{futurePeer: {}}]}]
"#,
    );
    let d = decide(&s, "prod/web", "external", TCP, 443);
    let Basis::Rule { hit, .. } = d.egress.unwrap().basis else { panic!("a rule decided") };
    let info = s.rule_info(Direction::Egress, hit);
    assert!(info.fail_closed);
    assert_eq!(info.action, tierproxy::policy::Action::Deny);
}

/// A dual-stack peer matches an IPv4 ipBlock only on its IPv4 address: address matches of
/// multi-address pods are looked up per flow, never folded into the pod.
#[test]
fn dual_stack_peer_matches_blocks_per_address_family() {
    let s = snapshot(
        r#"
apiVersion: v1
kind: Pod
metadata: {name: ds, namespace: dev, labels: {app: ds}}
spec: {nodeName: node-2, containers: [{name: c}]}
status: {podIP: 10.9.0.1, podIPs: [{ip: 10.9.0.1}, {ip: "fd00::1"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: ds-server, namespace: prod, labels: {app: ds}}
spec: {nodeName: node-1, containers: [{name: c}]}
status: {podIP: 10.9.1.1, podIPs: [{ip: 10.9.1.1}, {ip: "fd00::2"}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: v4-only, namespace: prod}
spec: {podSelector: {matchLabels: {app: ds}}, ingress: [{from: [{ipBlock: {cidr: 10.9.0.0/16}}]}]}
"#,
    );
    let flow = |src: &str, dst: &str| Flow {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        protocol: TCP,
        dst_port: 80,
    };
    let v4 = s.decide(&flow("10.9.0.1", "10.9.1.1"));
    let v6 = s.decide(&flow("fd00::1", "fd00::2"));
    assert_eq!(v4.verdict, Verdict::Allow);
    assert_eq!(v6.verdict, Verdict::Deny);
    assert_eq!(v4, s.decide_reference(&flow("10.9.0.1", "10.9.1.1")));
    assert_eq!(v6, s.decide_reference(&flow("fd00::1", "fd00::2")));
}

/// DESIGN §3: a node's agent decides flows of its own client pods (both directions: its
/// proxy completes the client's handshake, so the server's ingress must be known before
/// the first packet is let through) and the ingress of its own server pods; the rest is
/// the other node's to decide.
#[test]
fn a_node_decides_only_the_directions_of_its_own_pods() {
    let s = snapshot(
        r#"
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: dev, labels: {app: a}}
spec: {nodeName: node-1, containers: [{name: c}]}
status: {podIP: 10.9.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: dev, labels: {app: b}}
spec: {nodeName: node-1, containers: [{name: c}]}
status: {podIP: 10.9.0.2}
---
apiVersion: v1
kind: Pod
metadata: {name: c, namespace: prod, labels: {app: c}}
spec: {nodeName: node-2, containers: [{name: c}]}
status: {podIP: 10.9.1.1}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-in, namespace: prod}
spec: {podSelector: {}, policyTypes: [Ingress]}
"#,
    );
    let n1 = s.find_node("node-1").expect("node-1");
    let n2 = s.find_node("node-2").expect("node-2");
    let flow = |src: &str, dst: &str| Flow {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        protocol: TCP,
        dst_port: 80,
    };
    // Same node: both directions, at that node only.
    let same = flow("10.9.0.1", "10.9.0.2");
    let d = s.decide_on_node(&same, n1);
    assert!(d.egress.is_some() && d.ingress.is_some());
    assert_eq!(d, s.decide(&same));
    let d = s.decide_on_node(&same, n2);
    assert!(d.egress.is_none() && d.ingress.is_none());
    assert_eq!(d.verdict, ALLOW);
    // Cross node: the client's node decides both (egress allowed, the server's ingress
    // denied, so the flow is dropped at its first packet); the server's node decides
    // ingress only.
    let cross = flow("10.9.0.1", "10.9.1.1");
    let at_client = s.decide_on_node(&cross, n1);
    assert!(at_client.egress.is_some() && at_client.ingress.is_some());
    assert_eq!(at_client.egress.as_ref().map(|o| o.verdict), Some(ALLOW));
    assert_eq!(at_client.verdict, DENY);
    let at_server = s.decide_on_node(&cross, n2);
    assert!(at_server.egress.is_none() && at_server.ingress.is_some());
    assert_eq!(at_server.verdict, DENY);
    // The reverse flow, from the server's node: its pod is the client now.
    let back = flow("10.9.1.1", "10.9.0.1");
    let d = s.decide_on_node(&back, n1);
    assert!(d.egress.is_none() && d.ingress.is_some());
    assert_eq!(s.decide_on_node(&back, n2), s.decide(&back));
    assert_eq!(s.decide(&cross).verdict, DENY);
    // The shared CLUSTER has pods on both nodes too: check membership both ways.
    let (l1, l2) = (s.local_pod_ips(n1), s.local_pod_ips(n2));
    for a in ["10.9.0.1", "10.9.0.2"] {
        assert!(l1.contains(&ip(a)) && !l2.contains(&ip(a)), "{a}");
    }
    assert!(l2.contains(&ip("10.9.1.1")) && !l1.contains(&ip("10.9.1.1")));
    assert!(!l1.contains(&ip("node-1")), "a node address is not a local pod address");
}
