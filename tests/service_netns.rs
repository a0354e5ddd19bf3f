//! ClusterIP and NodePort Services end to end (issues #6 and #22): a lab whose nodes carry
//! kube-proxy-like nftables DNAT for the Services in its manifests, with agents. A client
//! pod connects to ClusterIPs whose backend is on its own node and on the other node, and to
//! node ports of its own node; policy must be decided on the backend pod (its labels,
//! namespace and target port), never on the ClusterIP or the node port, and the client must
//! see every reply (and every refusal) come from the address and port it connected to.
//!
//! Without the decision after the DNAT (the queue in PREROUTING, before kube-proxy's nat
//! hook) this fails: the client's egress policy, which allows namespace `b` on 8080 only,
//! denies every connection to a ClusterIP (an address of no pod, port 80), and the denies
//! below would be allowed.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tierproxy::lab::netns::in_netns;

mod common;
use common::*;

/// Two nodes. Namespace `a`: the client on n1, with an egress NetworkPolicy that allows
/// namespace `b` on TCP 8080 and UDP 5353 only. Namespace `b`: `web-local` on n1 (8080
/// named `http`, 9090, UDP 5353 named `dns`), `web-remote` and `vault` on n2. NetworkPolicy
/// `b/only-8080` isolates b's pods for ingress except from namespace a on 8080 and UDP 5353;
/// ANP `guard-vault` denies ingress to `app: vault` from namespace a. Antrea ACNP
/// `reject-shielded` (Tier `securityops`) rejects ingress to `shielded` (n1) from namespace
/// a, which reaches it through ClusterIP 10.96.0.13 and node ports 30013 (TCP) and 30053
/// (UDP). `local` (ClusterIP 10.96.0.10) has node ports 30080, 30054 (UDP) and 30090.
/// The client, `web-local` and `shielded` are dual-stack, and so are the ClusterIPs of
/// `local` (fd00:96::10) and `shielded` (fd00:96::13), and n1 (fd00:33::2).
const CLUSTER: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: n1}
status: {addresses: [{type: InternalIP, address: 172.33.0.2}, {type: InternalIP, address: "fd00:33::2"}]}
---
apiVersion: v1
kind: Node
metadata: {name: n2}
status: {addresses: [{type: InternalIP, address: 172.33.0.3}]}
---
apiVersion: v1
kind: Namespace
metadata: {name: a, labels: {kubernetes.io/metadata.name: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: b, labels: {kubernetes.io/metadata.name: b}}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: a, labels: {app: client}}
spec: {nodeName: n1, containers: [{name: c}]}
status: {phase: Running, podIP: 10.62.1.2, podIPs: [{ip: 10.62.1.2}, {ip: "fd00:62::1:2"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-local, namespace: b, labels: {app: web-local}}
spec:
  nodeName: n1
  containers:
  - name: c
    ports:
    - {name: http, containerPort: 8080}
    - {containerPort: 9090}
    - {name: dns, containerPort: 5353, protocol: UDP}
status: {phase: Running, podIP: 10.62.1.3, podIPs: [{ip: 10.62.1.3}, {ip: "fd00:62::1:3"}]}
---
apiVersion: v1
kind: Pod
metadata: {name: web-remote, namespace: b, labels: {app: web-remote}}
spec: {nodeName: n2, containers: [{name: c, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 10.62.2.2}
---
apiVersion: v1
kind: Pod
metadata: {name: vault, namespace: b, labels: {app: vault}}
spec: {nodeName: n2, containers: [{name: c, ports: [{containerPort: 8080}]}]}
status: {phase: Running, podIP: 10.62.2.3}
---
apiVersion: v1
kind: Pod
metadata: {name: shielded, namespace: b, labels: {app: shielded}}
spec:
  nodeName: n1
  containers:
  - name: c
    ports:
    - {containerPort: 8080}
    - {containerPort: 5353, protocol: UDP}
status: {phase: Running, podIP: 10.62.1.4, podIPs: [{ip: 10.62.1.4}, {ip: "fd00:62::1:4"}]}
---
apiVersion: v1
kind: Service
metadata: {name: shielded, namespace: b}
spec:
  type: NodePort
  clusterIP: 10.96.0.13
  clusterIPs: [10.96.0.13, "fd00:96::13"]
  selector: {app: shielded}
  ports:
  - {name: web, port: 80, targetPort: 8080, nodePort: 30013}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353, nodePort: 30053}
---
apiVersion: crd.antrea.io/v1beta1
kind: ClusterNetworkPolicy
metadata: {name: reject-shielded}
spec:
  priority: 5
  tier: securityops
  appliedTo: [{podSelector: {matchLabels: {app: shielded}}}]
  ingress:
  - action: Reject
    from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: a}}}]
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: b}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  selector: {app: web-local}
  ports:
  - {name: web, port: 80, targetPort: http, nodePort: 30080}
  - {name: dns, port: 53, protocol: UDP, targetPort: dns, nodePort: 30054}
  - {name: admin, port: 8080, targetPort: 9090, nodePort: 30090}
---
apiVersion: v1
kind: Service
metadata: {name: remote, namespace: b}
spec:
  clusterIP: 10.96.0.11
  selector: {app: web-remote}
  ports:
  - {port: 80, targetPort: 8080}
  - {name: dns, port: 53, protocol: UDP, targetPort: 5353}
---
apiVersion: v1
kind: Service
metadata: {name: vault, namespace: b}
spec:
  clusterIP: 10.96.0.12
  selector: {app: vault}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client-egress, namespace: a}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: b}}}]
    ports: [{port: 8080}, {port: 5353, protocol: UDP}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: only-8080, namespace: b}
spec:
  podSelector: {}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: a}}}]
    ports: [{port: 8080}, {port: 5353, protocol: UDP}]
---
apiVersion: policy.networking.k8s.io/v1alpha1
kind: AdminNetworkPolicy
metadata: {name: guard-vault}
spec:
  priority: 5
  subject: {pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: vault}}}}
  ingress:
  - name: not-from-a
    action: Deny
    from: [{namespaces: {matchLabels: {kubernetes.io/metadata.name: a}}}]
"#;

const CLIENT_IP: &str = "10.62.1.2";

/// The client's IPv6 address.
const CLIENT_IP6: &str = "fd00:62::1:2";

/// One TCP connection from `netns` to `to`: the greeting line, then an echo. The stream's
/// peer is `to` (a connected socket takes segments from `to` only, so the greeting arriving
/// at all shows that the replies were un-NATed to the ClusterIP).
fn tcp_cycle(
    netns: &str,
    to: SocketAddr,
    timeout: Duration,
) -> Result<(String, SocketAddr), String> {
    in_netns(netns, || {
        let s = TcpStream::connect_timeout(&to, timeout).map_err(io("connect"))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io("timeout"))?;
        let peer = s.peer_addr().map_err(io("peer"))?;
        let mut r = BufReader::new(s.try_clone().map_err(io("clone"))?);
        let mut greeting = String::new();
        r.read_line(&mut greeting).map_err(io("greeting"))?;
        (&s).write_all(b"ping\n").map_err(io("write"))?;
        let mut echo = String::new();
        r.read_line(&mut echo).map_err(io("echo"))?;
        assert_eq!(echo, "ping\n", "echoed through the proxy");
        Ok((greeting, peer))
    })
    .map_err(|e| tierproxy::error::chain(&e))
}

/// `n` datagrams over one connected UDP socket from `netns` to `to`; the answers, each
/// received from `to`.
fn udp_exchange(netns: &str, to: SocketAddr, n: usize) -> Vec<String> {
    in_netns(netns, || {
        let s = UdpSocket::bind(any_port(to)).map_err(io("bind"))?;
        s.connect(to).map_err(io("connect"))?;
        s.set_read_timeout(Some(Duration::from_secs(3))).map_err(io("timeout"))?;
        let mut answers = Vec::new();
        let mut buf = [0u8; 512];
        for i in 0..n {
            s.send(format!("d{i}").as_bytes()).map_err(io("send"))?;
            let (len, from) = retrying(|| s.recv_from(&mut buf)).map_err(io("recv"))?;
            assert_eq!(from, to, "the answer comes from the address the client sent to");
            answers.push(String::from_utf8_lossy(&buf[..len]).into_owned());
        }
        Ok(answers)
    })
    .expect("UDP through a Service")
}

/// Asserts that a TCP connection from `netns` to `to` is served, to the client address
/// `client` (the server greets with the address it saw) and from `to` (the stream's peer).
fn served_tcp(netns: &str, to: SocketAddr, client: &str) {
    let (greeting, peer) = tcp_cycle(netns, to, Duration::from_secs(3))
        .unwrap_or_else(|e| panic!("{to}: not served: {e}"));
    assert!(greeting.starts_with(&format!("tierproxy-lab {client} ")), "{to}: {greeting}");
    assert_eq!(peer, to);
}

/// Asserts that `n` datagrams from `netns` to `to` are each answered, from `to`, by a
/// server that saw the client address `client`.
fn served_udp(netns: &str, to: SocketAddr, n: usize, client: &str) {
    for (i, a) in udp_exchange(netns, to, n).iter().enumerate() {
        assert!(a.starts_with(&format!("tierproxy-lab {client} ")), "{to}: {a}");
        assert!(a.ends_with(&format!("d{i}")), "{to}: {a}");
    }
}

/// The unspecified address of `to`'s family, port 0.
fn any_port(to: SocketAddr) -> &'static str {
    if to.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
}

/// The decision records of `audit` (JSON Lines) whose client is the test's client.
fn decisions(audit: &Path) -> Vec<Value> {
    std::fs::read_to_string(audit)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "tierproxy.policy.decision")
        .filter(|v| v["attributes"]["source.address"] == CLIENT_IP)
        .collect()
}

/// Waits (bounded) until `audit` holds a decision record of the client to `dst`:`port`
/// with `verdict`, and returns it.
fn decision_to(audit: &Path, dst: &str, port: u64, verdict: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found = decisions(audit).into_iter().find(|v| {
            v["attributes"]["destination.address"] == dst
                && v["attributes"]["destination.port"] == port
                && v["attributes"]["tierproxy.verdict"] == verdict
        });
        if let Some(v) = found {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "no {verdict} of {dst}:{port} in {}:\n{:#?}",
            audit.display(),
            decisions(audit)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn service_flows_are_decided_on_the_backend_pod_and_answered_from_the_address_used() {
    let test = "service_flows_are_decided_on_the_backend_pod_and_answered_from_the_address_used";
    if !netns_available(test) {
        return;
    }
    let lab = Lab::new("svc");
    let cluster = lab.file("cluster.yaml", CLUSTER);
    let up = lab.up_with(true, &[&cluster], None);
    assert!(
        String::from_utf8_lossy(&up.stdout).contains("4 Services, ClusterIP and NodePort")
            || String::from_utf8_lossy(&up.stderr).contains("4 Services, ClusterIP and NodePort"),
        "{}",
        text(&up)
    );
    let client = netns_of_pod(&lab, "a", "client");
    let audit = Path::new("/run/tierproxy-lab").join(&lab.prefix).join("audit-n1.jsonl");
    let addr = |s: &str| s.parse::<SocketAddr>().expect("address");

    // (a) Backend on the client's node, named target port: allowed (egress to b:8080, b's
    // ingress from a on 8080), source preserved, replies from the ClusterIP. Several
    // connections: each is a new SYN to the ClusterIP.
    for _ in 0..3 {
        served_tcp(&client, addr("10.96.0.10:80"), CLIENT_IP);
    }
    // (b) Backend on the other node.
    served_tcp(&client, addr("10.96.0.11:80"), CLIENT_IP);
    // UDP: every datagram to the ClusterIP reaches the backend's 5353 and is answered from
    // the ClusterIP (the later ones, too, which the proxy's listener takes again).
    served_udp(&client, addr("10.96.0.10:53"), 3, CLIENT_IP);
    // IPv6: the ClusterIP of the same Service, the client's IPv6 address kept.
    served_tcp(&client, addr("[fd00:96::10]:80"), CLIENT_IP6);
    served_udp(&client, addr("[fd00:96::10]:53"), 2, CLIENT_IP6);
    // (c) A node port of the client's node (kube-proxy's NodePort DNAT; the lab keeps the
    // client's address), TCP and UDP: the same backend, answered from the node's address
    // and node port.
    for _ in 0..2 {
        served_tcp(&client, addr("172.33.0.2:30080"), CLIENT_IP);
    }
    served_udp(&client, addr("172.33.0.2:30054"), 3, CLIENT_IP);
    // The node's IPv6 address: the node port of the IPv6 ClusterIP's port.
    served_tcp(&client, addr("[fd00:33::2]:30080"), CLIENT_IP6);
    served_udp(&client, addr("[fd00:33::2]:30054"), 2, CLIENT_IP6);

    // Denied on the backend: its target port 9090 (the ClusterIP's port is 8080, which both
    // policies allow), and a backend pod an AdminNetworkPolicy guards. Timeouts, not
    // refusals.
    for (to, why) in [
        ("10.96.0.10:8080", "target port 9090"),
        ("172.33.0.2:30090", "target port 9090 through a node port"),
        ("10.96.0.12:80", "vault pod"),
    ] {
        let started = Instant::now();
        let r = tcp_cycle(&client, addr(to), Duration::from_millis(1500));
        let e = r.expect_err(why);
        assert!(e.contains("timed out"), "{why}: a timeout, not a refusal: {e}");
        assert!(started.elapsed() >= Duration::from_millis(1400), "{why}: dropped silently");
    }

    // Rejected on the backend (issue #22): refused at once, and from the ClusterIP, or the
    // client would ignore the refusal and time out as for a deny. The RST and the ICMP
    // error come from the kernel's reject where the queue passes no conntrack entry (these
    // machines' kernels), from the agent elsewhere.
    // The same through the node ports of the client's node: the kernel's answer is un-NATed
    // to the node's address and node port. And over IPv6, where the TPROXY'd SYN is refused
    // in INPUT and the datagram gets ICMPv6 administratively prohibited.
    for (tcp, udp) in [
        ("10.96.0.13:80", "10.96.0.13:53"),
        ("172.33.0.2:30013", "172.33.0.2:30053"),
        ("[fd00:33::2]:30013", "[fd00:33::2]:30053"),
        ("[fd00:96::13]:80", "[fd00:96::13]:53"),
    ] {
        let started = Instant::now();
        let e = tcp_cycle(&client, addr(tcp), Duration::from_millis(1500))
            .expect_err("rejected through the Service");
        assert!(e.contains("refused"), "{tcp}: a refusal: {e}");
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1000), "{tcp}: at once: {took:?}");
        let e = in_netns(&client, || {
            let s = UdpSocket::bind(any_port(addr(udp))).map_err(io("bind"))?;
            s.connect(addr(udp)).map_err(io("connect"))?;
            s.set_read_timeout(Some(Duration::from_millis(1500))).map_err(io("timeout"))?;
            s.send(b"rejected?").map_err(io("send"))?;
            Ok(retrying(|| s.recv(&mut [0u8; 64])).expect_err("no answer but the refusal"))
        })
        .expect("UDP to the rejecting Service");
        // ICMP host administratively prohibited: EHOSTUNREACH on a connected socket;
        // ICMPv6 administratively prohibited: EACCES (`icmpv6_err_convert`).
        let expected = if addr(udp).is_ipv4() {
            std::io::ErrorKind::HostUnreachable
        } else {
            std::io::ErrorKind::PermissionDenied
        };
        assert_eq!(e.kind(), expected, "{udp}: {e}");
    }

    // The audit names the backend pod and its target port, never a ClusterIP.
    let local = decision_to(&audit, "10.62.1.3", 8080, "allow");
    assert_eq!(local["attributes"]["tierproxy.destination.k8s.pod.name"], "web-local", "{local}");
    let remote = decision_to(&audit, "10.62.2.2", 8080, "allow");
    assert_eq!(remote["attributes"]["tierproxy.destination.k8s.pod.name"], "web-remote");
    let udp = decision_to(&audit, "10.62.1.3", 5353, "allow");
    assert_eq!(udp["attributes"]["network.transport"], "udp", "{udp}");
    let port = decision_to(&audit, "10.62.1.3", 9090, "deny");
    assert_eq!(port["attributes"]["tierproxy.destination.k8s.pod.name"], "web-local", "{port}");
    let shielded = decision_to(&audit, "10.62.1.4", 8080, "reject");
    assert_eq!(shielded["attributes"]["tierproxy.policy.name"], "reject-shielded", "{shielded}");
    decision_to(&audit, "10.62.1.4", 5353, "reject");
    let vault = decision_to(&audit, "10.62.2.3", 8080, "deny");
    assert_eq!(vault["attributes"]["tierproxy.destination.k8s.pod.name"], "vault", "{vault}");
    assert_eq!(vault["attributes"]["tierproxy.policy.name"], "guard-vault", "{vault}");
    let all = decisions(&audit);
    assert!(
        !all.iter().any(|v| v["attributes"]["destination.address"]
            .as_str()
            .is_some_and(|a| a.starts_with("10.96.") || a.starts_with("172.33."))),
        "no decision on a ClusterIP or a node's address: {all:#?}"
    );

    // The DNAT is the lab's: its table in every node namespace.
    for node in ["n1", "n2"] {
        let o = std::process::Command::new("ip")
            .args(["netns", "exec", &netns_of_node(&lab, node), "nft", "list", "table", "inet"])
            .arg(tierproxy::lab::service::TABLE)
            .output()
            .expect("nft runs");
        let listing = String::from_utf8_lossy(&o.stdout);
        assert!(listing.contains("dnat ip to 10.62.1.3:9090"), "{node}: {listing}");
        assert!(listing.contains("numgen random mod 1"), "{node}: {listing}");
        assert!(listing.contains("tcp dport 30080 jump"), "{node}: {listing}");
    }
}

/// The UDP datagrams the kernel of namespace `netns` delivered to its sockets, IPv4 and
/// IPv6 (`Udp: InDatagrams`, `Udp6InDatagrams`).
fn udp_delivered(netns: &str) -> (u64, u64) {
    in_netns(netns, || {
        let v4 = std::fs::read_to_string("/proc/thread-self/net/snmp").map_err(io("snmp"))?;
        let v6 = std::fs::read_to_string("/proc/thread-self/net/snmp6").map_err(io("snmp6"))?;
        let udp: Vec<&str> = v4.lines().filter(|l| l.starts_with("Udp: ")).collect();
        let at = udp[0].split(' ').position(|f| f == "InDatagrams").expect("InDatagrams");
        let in4 = udp[1].split(' ').nth(at).and_then(|v| v.parse().ok()).expect("a count");
        let in6 = (v6.lines().find_map(|l| l.strip_prefix("Udp6InDatagrams")))
            .and_then(|v| v.trim().parse().ok())
            .expect("Udp6InDatagrams");
        Ok((in4, in6))
    })
    .expect("the namespace's UDP counters")
}

/// `--udp-path proxy` (issue #22, on kernels without CONFIG_NETFILTER_NETLINK_GLUE_CT, as
/// these machines' are): a rejected datagram to a ClusterIP, IPv4 or IPv6, or to a node
/// port is refused from the address the client sent to, and never reaches its server.
/// For a ClusterIP the queue cannot say which address that was: the datagram (TPROXY'd)
/// goes on to the proxy, which refuses it, and conntrack, having confirmed the flow's
/// entry on delivery, un-NATs the refusal. Before this, the refusal came from the
/// backend's address and the client timed out. UDP to a node port is not TPROXY'd (the
/// node's own address): the kernel forwards an allowed flow, its answers included, and
/// its reject answers a rejected one, as on the kernel path; a new snapshot that denies
/// such a live flow cuts it (its conntrack entry deleted). A server's port unreachable
/// behind a ClusterIP, which the proxy relays, reaches the client too.
#[test]
fn the_udp_proxy_path_answers_and_refuses_through_a_service_from_the_address_used() {
    let test = "the_udp_proxy_path_answers_and_refuses_through_a_service_from_the_address_used";
    if !netns_available(test) {
        return;
    }
    let lab = Lab::new("svcu");
    let cluster = lab.file("cluster.yaml", CLUSTER);
    let o = lab.lab(&[
        "up",
        "--manifests",
        cluster.to_str().expect("path"),
        "--agent-arg=--udp-path=proxy",
        "--agent-arg=--metrics-addr=127.0.0.1:9464",
    ]);
    assert!(o.status.success(), "lab up failed: {}", text(&o));
    let client = netns_of_pod(&lab, "a", "client");
    let addr = |s: &str| s.parse::<SocketAddr>().expect("address");
    let refusal = |to: SocketAddr| {
        in_netns(&client, || {
            let s = UdpSocket::bind(any_port(to)).map_err(io("bind"))?;
            s.connect(to).map_err(io("connect"))?;
            s.set_read_timeout(Some(Duration::from_millis(1500))).map_err(io("timeout"))?;
            s.send(b"refused?").map_err(io("send"))?;
            Ok(retrying(|| s.recv(&mut [0u8; 64])).expect_err("no answer but the refusal").kind())
        })
        .expect("UDP through a Service")
    };
    // Allowed: the proxy relays, answers come from the ClusterIP; UDP to a node port is
    // forwarded by the kernel (the node's own address), answers from the node port. The
    // backend's answers to a node port once passed the proxy's interception as a flow of
    // their own and never reached the client.
    for (to, from) in [
        ("10.96.0.10:53", CLIENT_IP),
        ("[fd00:96::10]:53", CLIENT_IP6),
        ("172.33.0.2:30054", CLIENT_IP),
    ] {
        served_udp(&client, addr(to), 2, from);
    }
    use std::io::ErrorKind::{ConnectionRefused, HostUnreachable, PermissionDenied};
    let shielded = netns_of_pod(&lab, "b", "shielded");
    let delivered = udp_delivered(&shielded);
    for (to, expected) in [
        ("10.96.0.13:53", HostUnreachable),
        ("172.33.0.2:30053", HostUnreachable),
        ("[fd00:96::13]:53", PermissionDenied),
        // web-remote (n2) has no UDP server: its port unreachable, relayed by the proxy.
        ("10.96.0.11:53", ConnectionRefused),
    ] {
        let started = Instant::now();
        assert_eq!(refusal(addr(to)), expected, "{to}");
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1000), "{to}: at once: {took:?}");
    }
    // Refused, never delivered: the rejected server's kernel got none of them (a datagram
    // let on would be there before its client gave up).
    assert_eq!(udp_delivered(&shielded), delivered, "no rejected datagram reached shielded");
    // Each rejected datagram decided once, at its first packet (the proxy took that
    // decision instead of deciding the flow again), and refused once, by the proxy.
    let metrics = agent_http(&netns_of_node(&lab, "n1"), "/metrics");
    let value = |sample: &str| metric_value(&metrics, sample);
    assert_eq!(value("tierproxy_reject_answers_total{answer=\"icmp_prohibited\"}"), 3.0);
    assert_eq!(value("tierproxy_decisions_at_accept_total"), 0.0);
    let audit = Path::new("/run/tierproxy-lab").join(&lab.prefix).join("audit-n1.jsonl");
    decision_to(&audit, "10.62.1.4", 5353, "reject");

    // A live flow through a node port, which the kernel forwards on this path too, is cut
    // when a new snapshot denies it: its conntrack entry deleted (the sweep of the flows
    // rule 5 marked), its next datagram decided again and dropped. Before, it lived on
    // until its entry expired.
    let flow = in_netns(&client, || {
        let s = UdpSocket::bind("0.0.0.0:0").map_err(io("bind"))?;
        s.connect(addr("172.33.0.2:30054")).map_err(io("connect"))?;
        s.set_read_timeout(Some(Duration::from_millis(1500))).map_err(io("timeout"))?;
        Ok(s)
    })
    .expect("socket");
    let ask = |payload: &[u8]| -> Option<String> {
        flow.send(payload).ok()?;
        let mut buf = [0u8; 512];
        let n = retrying(|| flow.recv(&mut buf)).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    for i in 0..3 {
        let answer = ask(format!("q{i}").as_bytes()).expect("answered before the change");
        assert!(answer.ends_with(&format!("q{i}")), "{answer}");
    }
    let no_udp = lab.file("no-udp.yaml", &CLUSTER.replace(", {port: 5353, protocol: UDP}]", "]"));
    let o = lab.lab(&["apply", "-m", no_udp.to_str().expect("path")]);
    assert!(o.status.success(), "lab apply: {}", text(&o));
    // Only the flows the kernel forwards are swept (the two to the node port; the
    // proxy's own flows, its ClusterIP flows' entries among them, it cuts itself).
    assert!(String::from_utf8_lossy(&o.stdout).contains(" udp_cut=2 "), "{}", text(&o));
    // A re-decision denying the class is audited (the ClusterIP flow the proxy relays to
    // web-local is of the same class, and denies of one class within a second are one
    // record).
    let deadline = Instant::now() + Duration::from_secs(10);
    let cut = loop {
        let found = decisions(&audit).into_iter().find(|v| {
            v["attributes"]["tierproxy.decision.point"] == "re-decision"
                && v["attributes"]["destination.address"] == "10.62.1.3"
                && v["attributes"]["destination.port"] == 5353
        });
        if let Some(v) = found {
            break v;
        }
        assert!(Instant::now() < deadline, "no re-decision of the class:\n{}", text(&o));
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(cut["attributes"]["tierproxy.verdict"], "deny", "{cut}");
    assert_eq!(ask(b"after"), None, "the flow is cut and its datagrams dropped");
}
