//! The API-server source ([`tierproxy::cluster::apiserver`]) and the status writer
//! ([`tierproxy::cluster::status`]) against a scripted API server over real HTTP
//! (`common::apiserver`): initial list, add/modify/delete, relist after a watch error and
//! an outage (from the watch cache, moving the generation only when the content changed,
//! noticed within the prober's bound), the agents' User-Agent, a CRD installed later, and
//! status conditions and Events from the elected writer; the election's hand-overs
//! (failed renewals, a revoked permission, a release on stop) and a dry run that writes
//! nothing; agents started before and after a bad update enforce the same; the same
//! objects from the source and from manifest files decide alike; the agent's log during an
//! outage. No privileges needed.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::apiserver::{FakeApi, as_user};
use serde_json::{Value, json};
use tierproxy::cluster::apiserver::{ApiSource, SourceConfig, WatchedKind};
use tierproxy::cluster::lastgood::{self, RecordStore};
use tierproxy::cluster::status::{self, Acceptance, Report, StatusOptions};
use tierproxy::policy::{Kind, ObjectRef, Problem};

const ANP: &str = "policy.networking.k8s.io/v1alpha1";

fn ns(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}})
}

fn pod(ns: &str, name: &str, ip: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": ns, "labels": labels,
                        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x".repeat(2000)}},
           "spec": {"nodeName": "node-a", "containers": [{"name": "c", "image": "nginx",
                    "ports": [{"name": "http", "containerPort": 80}]}]},
           "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}})
}

fn anp(name: &str, priority: i64) -> Value {
    json!({"apiVersion": ANP, "kind": "AdminNetworkPolicy", "metadata": {"name": name},
           "spec": {"priority": priority, "subject": {"namespaces": {}},
                    "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}})
}

/// The node the tests' clients name in their User-Agent.
const NODE: &str = "node-a";

/// A client of `api`.
async fn client(api: &FakeApi) -> kube::Client {
    let config = kube::Config::new(format!("http://{}", api.addr).parse().unwrap());
    tierproxy::cluster::apiserver::client(Some(config), NODE).await.unwrap()
}

/// The collection paths of the seven watched kinds.
const COLLECTIONS: [&str; 7] = [
    "/api/v1/pods",
    "/api/v1/namespaces",
    "/api/v1/nodes",
    "/apis/networking.k8s.io/v1/networkpolicies",
    "/apis/policy.networking.k8s.io/v1alpha1/adminnetworkpolicies",
    "/apis/policy.networking.k8s.io/v1alpha1/baselineadminnetworkpolicies",
    "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies",
];

/// Whether every kind, in the requests from `mark` on, has listed and then started a watch
/// (from `from`, if given): the watch comes after the watcher has handled the list's end.
fn relisted(api: &FakeApi, mark: usize, from: Option<&str>) -> bool {
    let requests = api.requests();
    let requests = &requests[mark.min(requests.len())..];
    COLLECTIONS.iter().all(|c| {
        let prefix = format!("GET {c}?");
        let Some(list) =
            requests.iter().position(|r| r.starts_with(&prefix) && !r.contains("watch=true"))
        else {
            return false;
        };
        requests[list..].iter().any(|r| {
            r.starts_with(&prefix)
                && r.contains("watch=true")
                && from.is_none_or(|rv| r.contains(&format!("resourceVersion={rv}&")))
        })
    })
}

fn fast() -> SourceConfig {
    SourceConfig {
        debounce: Duration::from_millis(20),
        max_delay: Duration::from_millis(200),
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(200),
        page_size: None,
        probe_interval: Duration::from_millis(50),
    }
}

/// Waits (at most 10 s) for `f` to hold.
async fn until(what: &str, f: impl Fn() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn start(api: &FakeApi) -> (ApiSource, Arc<AtomicUsize>) {
    let changes = Arc::new(AtomicUsize::new(0));
    let c = changes.clone();
    let source = ApiSource::start(client(api).await, fast(), move || {
        c.fetch_add(1, Ordering::SeqCst);
    });
    (source, changes)
}

fn pod_names(s: &ApiSource) -> Vec<String> {
    let mut v: Vec<String> = s.inputs().pod_views.iter().map(|p| p.name.clone()).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_list_then_adds_modifies_and_deletes_reach_the_inputs() {
    let api = FakeApi::start();
    api.apply(ns("shop", json!({"env": "prod"})));
    api.apply(pod("shop", "web-1", "10.0.0.5", json!({"app": "web"})));
    api.apply(anp("deny-all", 10));
    let (source, changes) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    until("the first report", || changes.load(Ordering::SeqCst) >= 1).await;
    let inputs = source.inputs();
    assert_eq!(inputs.namespaces.len(), 1);
    assert_eq!(pod_names(&source), ["web-1"]);
    assert_eq!(inputs.admin_network_policies.len(), 1);
    // Pods are stored as views: what the engine reads, nothing else.
    assert!(inputs.pods.is_empty());
    let p = &inputs.pod_views[0];
    assert_eq!((p.namespace.as_str(), p.name.as_str()), ("shop", "web-1"));
    assert_eq!(p.ips, ["10.0.0.5".parse::<std::net::IpAddr>().unwrap()]);
    assert_eq!(p.named_ports.len(), 1);
    assert_eq!(p.node_name.as_deref(), Some("node-a"));

    // Add, modify, delete: each reaches the stores and is reported.
    let before = changes.load(Ordering::SeqCst);
    let g0 = source.generation();
    api.apply(pod("shop", "web-2", "10.0.0.6", json!({"app": "web"})));
    until("web-2 added", || pod_names(&source) == ["web-1", "web-2"]).await;
    api.apply(pod("shop", "web-2", "10.0.0.6", json!({"app": "db"})));
    until("web-2 relabelled", || {
        source.inputs().pod_views.iter().any(|p| p.labels.get("app") == Some("db"))
    })
    .await;
    api.delete("v1", "Pod", Some("shop"), "web-1");
    until("web-1 deleted", || pod_names(&source) == ["web-2"]).await;
    // The store changes a moment before the generation is bumped (one task, two steps):
    // waited on, not read at once (it failed once in CI on a loaded machine).
    until("three changes counted", || source.generation() >= g0 + 3).await;
    until("the changes reported", || changes.load(Ordering::SeqCst) > before).await;
    assert!(source.stale_for().is_none());

    // Changes the engine cannot see count for nothing: a pod's readiness (dropped by the
    // projection) and a policy's status (what the status writer writes). A namespace added
    // after them marks when they have been processed.
    let g = source.generation();
    let mut unready = pod("shop", "web-2", "10.0.0.6", json!({"app": "db"}));
    unready["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
    api.apply(unready);
    let mut with_status = anp("deny-all", 10);
    with_status["status"] = json!({"conditions": [{"type": "tierproxy.io/Accepted", "status": "True",
        "reason": "Accepted", "message": "", "lastTransitionTime": "2026-11-24T00:00:00Z"}]});
    api.apply(with_status);
    api.apply(ns("marker", json!({})));
    until("the marker", || source.inputs().namespaces.len() == 2).await;
    assert_eq!(source.generation(), g + 1, "only the new namespace counted as a change");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_error_and_an_outage_keep_the_stores_and_end_in_a_relist() {
    let api = FakeApi::start();
    api.apply(ns("shop", json!({})));
    api.apply(pod("shop", "web-1", "10.0.0.5", json!({})));
    let (source, _changes) = start(&api).await;
    until("initial lists", || source.initialized()).await;

    // The history is compacted and the watches end: the watchers' next watch gets 410
    // Gone and they relist (and go on watching from the new list).
    let lists = || {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
            .count()
    };
    assert_eq!(lists(), 1);
    api.compact();
    api.close_watches();
    until("relist after 410", || lists() >= 2).await;
    api.apply(pod("shop", "web-2", "10.0.0.6", json!({})));

    until("the change made after compaction", || pod_names(&source) == ["web-1", "web-2"]).await;
    assert!(source.stale_for().is_none(), "410 Gone is a routine relist, not staleness");
    assert_eq!(source.errors(), 0);

    // An outage: the stores keep what they had, staleness shows, errors are counted.
    let errors = source.errors();
    api.set_down(true);
    until("the outage seen", || source.stale_for().is_some()).await;
    assert_eq!(pod_names(&source), ["web-1", "web-2"], "the stores are kept during an outage");
    assert!(source.errors() > errors);
    let pods_error = || {
        let h = source.health().into_iter().find(|(k, _)| *k == WatchedKind::Pod).unwrap().1;
        h.failing_since.is_some() && h.last_error.as_deref().is_some_and(|e| e.contains("503"))
    };
    until("the pods watcher failing with the 503", pods_error).await;
    // Changes made during the outage are seen once it ends.
    api.set_down(false);
    api.delete("v1", "Pod", Some("shop"), "web-1");
    until("recovered", || source.stale_for().is_none() && pod_names(&source) == ["web-2"]).await;

    // Plain 500s on the list are retried too.
    api.fail_next(3);
    api.close_watches();
    api.apply(pod("shop", "web-3", "10.0.0.7", json!({})));
    until("after 500s", || pod_names(&source) == ["web-2", "web-3"]).await;
    assert!(lists() >= 4, "the pods were listed again after the errors: {}", lists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crd_installed_later_is_watched_once_it_appears() {
    let api = FakeApi::start();
    api.uninstall(ANP, "AdminNetworkPolicy");
    api.uninstall("policy.networking.k8s.io/v1alpha2", "ClusterNetworkPolicy");
    let (source, changes) = start(&api).await;
    // Not installed is not an error: the lists count as done, and empty.
    until("initial lists without the CRDs", || source.initialized()).await;
    assert!(source.inputs().admin_network_policies.is_empty());
    let h = source.health();
    assert!(
        h.iter().any(|(k, h)| *k == WatchedKind::AdminNetworkPolicy && h.absent && h.initialized)
    );
    assert!(h.iter().any(|(k, h)| *k == WatchedKind::BaselineAdminNetworkPolicy && !h.absent));
    assert!(source.stale_for().is_none(), "a missing CRD is not staleness");

    // The CRD is installed and a policy created: picked up within the retry backoff.
    let before = changes.load(Ordering::SeqCst);
    api.install(ANP, "AdminNetworkPolicy");
    api.apply(anp("deny-all", 10));
    until("the ANP", || source.inputs().admin_network_policies.len() == 1).await;
    until("reported", || changes.load(Ordering::SeqCst) > before).await;
    assert!(
        source.health().iter().any(|(k, h)| *k == WatchedKind::AdminNetworkPolicy && !h.absent)
    );

    // Uninstalled again: the kind contributes nothing.
    api.uninstall(ANP, "AdminNetworkPolicy");
    until("the ANP gone", || source.inputs().admin_network_policies.is_empty()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_elected_writer_sets_conditions_and_events_and_only_when_they_change() {
    let api = FakeApi::start();
    api.apply(anp("good", 10));
    api.apply(anp("bad", 1001));
    let (source, _) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    let (reports, rx) = tokio::sync::watch::channel(Arc::new(Report::default()));
    let options = StatusOptions {
        lease_namespace: "tierproxy-system".into(),
        lease_name: "tierproxy-policy-status".into(),
        identity: "node-a".into(),
        lease_seconds: 5,
        leader: Default::default(),
    };
    let records = Arc::new(RecordStore::default());
    let writer = tokio::spawn(status::run(
        client(&api).await,
        source.clone(),
        options,
        rx,
        records,
        std::future::pending(),
    ));
    let bad = ObjectRef::cluster(Kind::AdminNetworkPolicy, "bad");
    let problem = Problem::error(
        &bad,
        "spec.priority",
        tierproxy::policy::problem::ProblemKind::OutOfRange { value: 1001, min: 0, max: 1000 },
    );
    reports.send_replace(Arc::new(Report::new(1, std::slice::from_ref(&problem), &[])));
    let cond = |name: &str| condition(&api, name);
    until("both conditions written", || cond("good").is_some() && cond("bad").is_some()).await;
    let good = cond("good").unwrap();
    assert_eq!(
        (good["status"].as_str(), good["reason"].as_str()),
        (Some("True"), Some("Accepted"))
    );
    assert_eq!(good["observedGeneration"], 1);
    let badc = cond("bad").unwrap();
    assert_eq!(
        (badc["status"].as_str(), badc["reason"].as_str()),
        (Some("False"), Some("Invalid"))
    );
    assert!(
        badc["message"].as_str().unwrap().contains("spec.priority: 1001 is out of range"),
        "{badc}"
    );

    // The lease is held by this agent.
    let lease = api.get(
        "coordination.k8s.io/v1",
        "Lease",
        Some("tierproxy-system"),
        "tierproxy-policy-status",
    );
    assert_eq!(
        lease.as_ref().map(|l| l["spec"]["holderIdentity"].clone()),
        Some(json!("node-a")),
        "{lease:?}"
    );
    // An Event for the invalid policy. The writer posts it after the policy's condition, so
    // it may still be on its way when both conditions are seen. That none came for the
    // valid one, nor a second for the same problem, is checked below, once the writer has
    // provably finished later passes over every policy.
    let events = || -> Vec<Value> {
        api.writes()
            .into_iter()
            .filter(|(m, p, _)| m == "POST" && p.contains("/events"))
            .map(|(_, _, b)| b)
            .collect()
    };
    until("the InvalidPolicy event", || !events().is_empty()).await;
    let first = events();
    assert_eq!(first[0]["reason"], "InvalidPolicy");
    assert_eq!(first[0]["regarding"]["name"], "bad");
    assert_eq!(first[0]["type"], "Warning");

    // The status writes are server-side apply patches of the status subresource, by the
    // field manager "tierproxy".
    let status_writes = || {
        api.requests().iter().filter(|r| r.starts_with("PATCH") && r.contains("/status")).count()
    };
    let n = status_writes();
    assert!(
        api.requests().iter().any(|r| r.contains("/adminnetworkpolicies/bad/status")
            && r.contains("fieldManager=tierproxy"))
    );
    // The same report again, with a new policy beside: only the new one's condition is
    // written. A third report with another new policy shows that the writer is done with
    // the second (it takes reports in turn, each a pass over every policy).
    for (i, name) in ["later", "later-still"].into_iter().enumerate() {
        api.apply(anp(name, 30 + i as i64));
        until("the new policy in the store", || source.admin_network_policies().len() == 3 + i)
            .await;
        reports.send_replace(Arc::new(Report::new(
            2 + i as u64,
            std::slice::from_ref(&problem),
            &[],
        )));
        until("the new policy's condition", || cond(name).is_some()).await;
    }
    assert_eq!(status_writes(), n + 2, "an unchanged status is not written again");
    // Reports are taken in turn, each a pass over every policy with an Event right after
    // its condition: the third pass has written "later-still", so the first two are done,
    // and either would have posted an Event for "good" or a second one for "bad".
    let events = events();
    assert_eq!(events.len(), 1, "one Event, for the invalid policy, once: {events:?}");

    // The policy is fixed: its condition flips, with a new transition time.
    api.apply(anp("bad", 20));
    until("the fixed policy in the store", || {
        source.admin_network_policies().iter().any(|p| p.spec.priority == 20)
    })
    .await;
    reports.send_replace(Arc::new(Report::new(3, &[], &[])));
    until("condition flipped", || cond("bad").is_some_and(|c| c["status"] == "True")).await;
    assert_eq!(cond("bad").unwrap()["observedGeneration"], 2);
    writer.abort();
}

/// tierproxy's condition on the AdminNetworkPolicy `name`, if written.
fn condition(api: &FakeApi, name: &str) -> Option<Value> {
    api.get(ANP, "AdminNetworkPolicy", None, name).and_then(|o| {
        o["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == status::CONDITION_TYPE).cloned())
    })
}

/// The Node `node-a` (the agents' node in these tests).
fn node_a() -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
           "status": {"addresses": [{"type": "InternalIP", "address": "172.31.0.2"}]}})
}

/// One agent of a node: its own watchers and record store, as `agent::run` has them.
struct Agent {
    source: ApiSource,
    records: Arc<RecordStore>,
}

impl Agent {
    async fn start(api: &FakeApi) -> Agent {
        let (source, _) = start(api).await;
        let records = Arc::new(RecordStore::default());
        tokio::spawn(lastgood::watch(
            client(api).await,
            "tierproxy-system".into(),
            records.clone(),
            || {},
        ));
        until("initial lists", || source.initialized() && records.initialized()).await;
        Agent { source, records }
    }

    /// Runs this agent's status writer (identity `node-a`, lease 5 s) until the test ends;
    /// what is sent on the returned channel is its report.
    async fn lead(&self, api: &FakeApi) -> tokio::sync::watch::Sender<Arc<Report>> {
        let (reports, rx) = tokio::sync::watch::channel(Arc::new(Report::default()));
        let options = StatusOptions {
            lease_namespace: "tierproxy-system".into(),
            lease_name: "tierproxy-policy-status".into(),
            identity: "node-a".into(),
            lease_seconds: 5,
            leader: Default::default(),
        };
        tokio::spawn(status::run(
            client(api).await,
            self.source.clone(),
            options,
            rx,
            self.records.clone(),
            std::future::pending(),
        ));
        reports
    }

    /// What this agent would enforce now, as `agent::run` builds it.
    fn build(&self, revision: u64) -> tierproxy::agent::Built {
        tierproxy::agent::build(
            &mut tierproxy::cluster::builder::Builder::new(),
            tierproxy::cluster::builder::gather(&[], Some(&self.source)),
            "node-a",
            tierproxy::policy::Revision(revision),
            tierproxy::audit::Defaults::default(),
            Some(&self.records.records()),
            &mut tierproxy::cluster::builder::ProblemLog::default(),
        )
        .unwrap()
    }
}

/// Issue #19, item 1: an agent started after a policy turned invalid enforces the same as
/// one that was running when it did (the last good version the leader recorded in the
/// ConfigMap), and the report (status) says the same on both; a policy that was never
/// valid is left out on both, and its status says its rules do not apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_started_before_and_after_a_bad_update_enforce_the_same() {
    use tierproxy::policy::{Decision, Flow, Protocol, Verdict};
    let api = FakeApi::start();
    api.apply(node_a());
    api.apply(ns("a", json!({"kubernetes.io/metadata.name": "a"})));
    api.apply(ns("b", json!({"kubernetes.io/metadata.name": "b"})));
    api.apply(pod("a", "client", "10.0.0.1", json!({})));
    api.apply(pod("b", "server", "10.0.0.2", json!({})));
    api.apply(anp("deny", 10));
    let flow = Flow {
        src: "10.0.0.1".parse().unwrap(),
        dst: "10.0.0.2".parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 80,
    };
    let verdict = |d: Decision| d.verdict;

    // Agent A runs and leads: its snapshot's report makes it record the valid version.
    let a = Agent::start(&api).await;
    let reports = a.lead(&api).await;
    let built = a.build(1);
    assert_eq!(verdict(built.current.snapshot.decide(&flow)), Verdict::Deny);
    let deny = ObjectRef::cluster(Kind::AdminNetworkPolicy, "deny");
    assert_eq!(built.report.valid.get(&deny), Some(&Some(1)));
    reports.send_replace(Arc::new(built.report));
    until("the valid version recorded", || {
        a.records.records().0.get(&deny).is_some_and(|r| r.generation == Some(1))
    })
    .await;
    let cm = api.get("v1", "ConfigMap", Some("tierproxy-system"), lastgood::CONFIGMAP).unwrap();
    assert!(
        cm["data"]["adminnetworkpolicy.deny"].as_str().unwrap().contains("\"priority\":10"),
        "{cm}"
    );

    // The policy turns invalid; a policy that never was valid appears beside it.
    let mut broken = anp("deny", 5000);
    broken["spec"]["ingress"][0]["name"] = json!("x");
    api.apply(broken);
    api.apply(anp("never-valid", 1001));
    until("agent A sees both", || {
        a.source.admin_network_policies().iter().any(|p| p.spec.priority == 5000)
            && a.source.admin_network_policies().len() == 2
    })
    .await;
    let from_a = a.build(2);
    reports.send_replace(Arc::new(from_a.report.clone()));

    // Agent B starts only now: it never saw the valid version.
    let b = Agent::start(&api).await;
    let from_b = b.build(1);
    for (who, built) in [("A", &from_a), ("B", &from_b)] {
        assert_eq!(
            verdict(built.current.snapshot.decide(&flow)),
            Verdict::Deny,
            "agent {who}: the recorded version stays in force"
        );
        assert!(
            matches!(built.report.of(&deny), Acceptance::InvalidUpdate(_, Some(1))),
            "agent {who}: {:?}",
            built.report.of(&deny)
        );
        let never = ObjectRef::cluster(Kind::AdminNetworkPolicy, "never-valid");
        assert!(
            matches!(built.report.of(&never), Acceptance::Invalid(_)),
            "agent {who}: {:?}",
            built.report.of(&never)
        );
    }
    assert_eq!(from_a.report.policies, from_b.report.policies, "the same status from both");
    // The leader keeps the record of the invalid policy (and records none for the other).
    until("the never-valid policy's condition", || condition(&api, "never-valid").is_some()).await;
    let message = condition(&api, "never-valid").unwrap()["message"].as_str().unwrap().to_string();
    assert!(message.contains("none of its rules apply"), "{message}");
    let records = a.records.records();
    assert_eq!(records.0.keys().map(|k| k.name.as_str()).collect::<Vec<_>>(), ["deny"]);
    assert_eq!(records.0[&deny].generation, Some(1));

    // Deleted and created again under the same name, still invalid: another object, whose
    // record the old one's is not.
    api.delete(ANP, "AdminNetworkPolicy", None, "deny");
    let mut again = anp("deny", 5000);
    again["spec"]["ingress"][0]["name"] = json!("x");
    api.apply(again);
    until("agent B sees the new object", || {
        b.source
            .admin_network_policies()
            .iter()
            .any(|p| p.metadata.name.as_deref() == Some("deny") && p.metadata.generation == Some(1))
    })
    .await;
    let recreated = b.build(2);
    assert_eq!(verdict(recreated.current.snapshot.decide(&flow)), Verdict::Allow);
    assert!(matches!(recreated.report.of(&deny), Acceptance::Invalid(_)));
}

/// Issue #19, item 5: two admin policies tied on priority with overlapping subjects both
/// get PriorityConflict, each naming the other (only the first of the tie had it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_tie_is_reported_on_every_policy_of_it() {
    let api = FakeApi::start();
    api.apply(node_a());
    api.apply(ns("a", json!({"kubernetes.io/metadata.name": "a"})));
    api.apply(pod("a", "p", "10.0.0.1", json!({})));
    api.apply(anp("first", 7));
    api.apply(anp("second", 7));
    let a = Agent::start(&api).await;
    let reports = a.lead(&api).await;
    reports.send_replace(Arc::new(a.build(1).report));
    let cond = |name: &str| condition(&api, name);
    until("both conditions", || cond("first").is_some() && cond("second").is_some()).await;
    for (me, other, order) in
        [("first", "second", "this policy first"), ("second", "first", "the other first")]
    {
        let c = cond(me).unwrap();
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str()),
            (Some("True"), Some("PriorityConflict")),
            "{me}: {c}"
        );
        let m = c["message"].as_str().unwrap();
        assert!(
            m.contains(&format!("shared with AdminNetworkPolicy {other}")) && m.contains(order),
            "{me}: {m}"
        );
    }
}

const ANTREA: &str = "crd.antrea.io/v1beta1";

fn antrea_tier(name: &str, priority: i64) -> Value {
    json!({"apiVersion": ANTREA, "kind": "Tier", "metadata": {"name": name},
           "spec": {"priority": priority}})
}

/// An Antrea ClusterNetworkPolicy in Tier `tier` that drops every pod's ingress from every
/// pod.
fn acnp(name: &str, tier: &str) -> Value {
    json!({"apiVersion": ANTREA, "kind": "ClusterNetworkPolicy", "metadata": {"name": name},
           "spec": {"tier": tier, "priority": 5, "appliedTo": [{"podSelector": {}}],
                    "ingress": [{"action": "Drop", "from": [{"namespaceSelector": {}}]}]}})
}

/// Issue #22: Antrea's Tiers, ClusterNetworkPolicies and NetworkPolicies are watched when
/// their CRDs exist, detected as the upstream CRDs are (404: absent, and picked up once
/// installed), and reach the inputs as stored, valid or not: the builder judges them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn antrea_objects_are_watched_once_their_crds_exist() {
    let api = FakeApi::start();
    for kind in ["Tier", "ClusterNetworkPolicy", "NetworkPolicy"] {
        api.uninstall(ANTREA, kind);
    }
    let (source, changes) = start(&api).await;
    until("initial lists without Antrea's CRDs", || source.initialized()).await;
    assert!(source.inputs().antrea.is_empty());
    let absent: Vec<String> =
        source.health().into_iter().filter(|(_, h)| h.absent).map(|(k, _)| k.to_string()).collect();
    assert_eq!(
        absent,
        [
            "tiers.crd.antrea.io",
            "clusternetworkpolicies.crd.antrea.io",
            "networkpolicies.crd.antrea.io"
        ]
    );
    assert!(source.stale_for().is_none(), "a missing CRD is not staleness");

    let before = changes.load(Ordering::SeqCst);
    for kind in ["Tier", "ClusterNetworkPolicy", "NetworkPolicy"] {
        api.install(ANTREA, kind);
    }
    api.apply(antrea_tier("later", 30));
    api.apply(antrea_tier("early", 20));
    api.apply(acnp("in-a-missing-tier", "nowhere"));
    api.apply(json!({"apiVersion": ANTREA, "kind": "NetworkPolicy",
                     "metadata": {"name": "q", "namespace": "shop"},
                     "spec": {"priority": 1, "appliedTo": [{"podSelector": {}}],
                              "egress": [{"action": "Reject"}]}}));
    // The upstream kinds of the same names are other resources.
    api.apply(network_policy("shop", "upstream"));
    // Each kind has its own watcher: the upstream NetworkPolicy may arrive after Antrea's
    // objects, so both are waited for (waiting for Antrea's alone failed in CI).
    until("Antrea's objects and the upstream NetworkPolicy", || {
        let inputs = source.inputs();
        let a = &inputs.antrea;
        a.tiers.len() == 2
            && a.cluster_network_policies.len() == 1
            && a.network_policies.len() == 1
            && inputs.network_policies.len() == 1
    })
    .await;
    until("reported", || changes.load(Ordering::SeqCst) > before).await;
    let inputs = source.inputs();
    assert_eq!(inputs.network_policies.len(), 1, "the upstream NetworkPolicy apart");
    assert!(inputs.cluster_network_policies.is_empty());
    let q = &inputs.antrea.network_policies[0];
    assert_eq!(q.metadata.namespace.as_deref(), Some("shop"));
    assert!(source.health().iter().all(|(_, h)| !h.absent));

    // Antrea's controller writing its status is no change for the engine.
    let g = source.generation();
    let mut realized = acnp("in-a-missing-tier", "nowhere");
    realized["status"] = json!({"phase": "Realized", "observedGeneration": 1,
                                "currentNodesRealized": 1, "desiredNodesRealized": 1});
    api.apply(realized);
    api.apply(ns("marker", json!({})));
    until("the marker", || source.inputs().namespaces.len() == 1).await;
    assert_eq!(source.generation(), g + 1, "only the new namespace counted as a change");

    // Uninstalled again: the kinds contribute nothing.
    for kind in ["Tier", "ClusterNetworkPolicy", "NetworkPolicy"] {
        api.uninstall(ANTREA, kind);
    }
    until("Antrea's objects gone", || source.inputs().antrea.is_empty()).await;
}

/// Issue #22, with issue #19's rule: an Antrea Drop policy served by the API server drops
/// (end to end: watched, admitted, compiled, decided); one naming a Tier that does not
/// exist is invalid, gets an Event (and no status: that is Antrea's), and is left out; one
/// whose Tier is deleted under it (Antrea refuses that; a cluster without Antrea's webhook
/// does not) stays in force as its recorded version, on an agent running then and on one
/// started after, and the leader keeps the Tier's record while the policy names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_antrea_policy_whose_tier_is_deleted_stays_in_force_on_every_agent() {
    use tierproxy::policy::{Flow, Protocol, Verdict};
    let flow = Flow {
        src: "10.0.0.1".parse().unwrap(),
        dst: "10.0.0.2".parse().unwrap(),
        protocol: Protocol::Tcp,
        dst_port: 80,
    };
    // The policy whose rule decided the server's ingress.
    let decided_by = |built: &tierproxy::agent::Built| {
        let s = &built.current.snapshot;
        let d = s.decide(&flow);
        match d.ingress.map(|o| o.basis) {
            Some(tierproxy::policy::Basis::Rule { hit, .. }) => {
                (d.verdict, Some(s.policy_ref(hit.policy).clone()))
            }
            _ => (d.verdict, None),
        }
    };
    let api = FakeApi::start();
    api.apply(node_a());
    api.apply(ns("a", json!({"kubernetes.io/metadata.name": "a"})));
    api.apply(ns("b", json!({"kubernetes.io/metadata.name": "b"})));
    api.apply(pod("a", "client", "10.0.0.1", json!({})));
    api.apply(pod("b", "server", "10.0.0.2", json!({})));
    api.apply(antrea_tier("dev", 10));
    api.apply(acnp("drop", "dev"));
    api.apply(acnp("never-valid", "nowhere"));
    let drop = ObjectRef::cluster(Kind::AntreaClusterNetworkPolicy, "drop");
    let never = ObjectRef::cluster(Kind::AntreaClusterNetworkPolicy, "never-valid");
    let dev = ObjectRef::cluster(Kind::AntreaTier, "dev");

    let a = Agent::start(&api).await;
    let reports = a.lead(&api).await;
    let built = a.build(1);
    assert_eq!(decided_by(&built), (Verdict::Deny, Some(drop.clone())));
    assert_eq!(built.report.valid.get(&drop), Some(&Some(1)));
    assert_eq!(built.report.valid.get(&dev), Some(&Some(1)));
    assert!(
        matches!(built.report.of(&never), Acceptance::Invalid(_)),
        "{:?}",
        built.report.of(&never)
    );
    reports.send_replace(Arc::new(built.report));
    until("the valid versions recorded", || {
        let r = a.records.records();
        r.0.contains_key(&drop) && r.0.contains_key(&dev)
    })
    .await;
    let cm = api.get("v1", "ConfigMap", Some("tierproxy-system"), lastgood::CONFIGMAP).unwrap();
    assert!(cm["data"]["antrea-tier.dev"].as_str().unwrap().contains("\"priority\":10"), "{cm}");

    // The Event about the invalid policy, in "default" (the ACNP is cluster-scoped), naming
    // the field; no status written on any of Antrea's objects.
    let events = || -> Vec<Value> {
        api.writes()
            .into_iter()
            .filter(|(m, p, _)| m == "POST" && p.contains("/events"))
            .map(|(_, _, b)| b)
            .collect()
    };
    until("the InvalidPolicy event", || !events().is_empty()).await;
    let e = &events()[0];
    assert_eq!(e["regarding"]["name"], "never-valid");
    assert_eq!(e["regarding"]["apiVersion"], ANTREA);
    assert_eq!(e["metadata"]["namespace"], "default");
    let note = e["note"].as_str().unwrap();
    assert!(note.contains("spec.tier") && note.contains("none of its rules apply"), "{note}");

    // The Tier is deleted under the policy.
    api.delete(ANTREA, "Tier", None, "dev");
    until("agent A sees the Tier gone", || a.source.antrea_tiers().is_empty()).await;
    let from_a = a.build(2);
    reports.send_replace(Arc::new(from_a.report.clone()));
    // Agent B starts only now: it never saw the Tier.
    let b = Agent::start(&api).await;
    let from_b = b.build(1);
    for (who, built) in [("A", &from_a), ("B", &from_b)] {
        assert_eq!(
            decided_by(built),
            (Verdict::Deny, Some(drop.clone())),
            "agent {who}: the recorded version stays in force, in its Tier as recorded"
        );
        assert!(
            matches!(built.report.of(&drop), Acceptance::InvalidUpdate(m, Some(1)) if m.contains("spec.tier")),
            "agent {who}: {:?}",
            built.report.of(&drop)
        );
        assert!(matches!(built.report.of(&never), Acceptance::Invalid(_)), "agent {who}");
    }
    assert_eq!(from_a.report.policies, from_b.report.policies, "the same report from both");
    until("the Event saying the recorded version stays", || {
        events().iter().any(|e| {
            e["regarding"]["name"] == "drop"
                && e["note"].as_str().is_some_and(|n| n.contains("generation 1) stays in force"))
        })
    })
    .await;
    // The leader keeps the Tier's record: the policy still names it.
    let records = a.records.records();
    assert!(records.0.contains_key(&dev) && records.0.contains_key(&drop), "{records:?}");
    assert!(
        !api.requests().iter().any(|r| !r.starts_with("GET") && r.contains("/apis/crd.antrea.io/")),
        "tierproxy writes nothing on Antrea's objects"
    );

    // The policy is deleted: nothing names the Tier any more, its record goes too.
    api.delete(ANTREA, "ClusterNetworkPolicy", None, "drop");
    until("agent A sees the policy gone", || a.source.antrea_cluster_network_policies().len() == 1)
        .await;
    let built = a.build(3);
    assert_eq!(decided_by(&built).0, Verdict::Allow);
    reports.send_replace(Arc::new(built.report));
    until("both records dropped", || {
        let r = a.records.records();
        !r.0.contains_key(&dev) && !r.0.contains_key(&drop)
    })
    .await;
}

const LEASE_NS: &str = "tierproxy-system";
const LEASE: &str = "tierproxy-policy-status";
const LEASES: &str = "/apis/coordination.k8s.io/v1/leases";

/// A scripted API server holding one invalid ANP, `bad` (priority 1001), and a source
/// that has listed it: what the election tests hand over.
async fn one_invalid_policy() -> (FakeApi, ApiSource) {
    let api = FakeApi::start();
    api.apply(anp("bad", 1001));
    let (source, _) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    (api, source)
}

/// A status writer (`status::run`) of identity `user`, as its own API user.
struct Writer {
    reports: tokio::sync::watch::Sender<Arc<Report>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    leader: Arc<status::LeaderState>,
}

impl Writer {
    async fn start(api: &FakeApi, source: &ApiSource, user: &str, lease_seconds: u64) -> Writer {
        let client =
            tierproxy::cluster::apiserver::client(Some(as_user(api, user)), user).await.unwrap();
        let (reports, rx) = tokio::sync::watch::channel(Arc::new(Report::default()));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let options = StatusOptions {
            lease_namespace: LEASE_NS.into(),
            lease_name: LEASE.into(),
            identity: user.into(),
            lease_seconds,
            leader: Default::default(),
        };
        let leader = options.leader.clone();
        let records = Arc::new(RecordStore::default());
        let task =
            tokio::spawn(status::run(client, source.clone(), options, rx, records, async move {
                let _ = stopped.await;
            }));
        Writer { reports, stop: Some(stop), task, leader }
    }

    fn report(&self, r: Report) {
        self.reports.send_replace(Arc::new(r));
    }

    fn stop(&mut self) {
        let _ = self.stop.take().map(|s| s.send(()));
    }
}

/// Revision `revision`'s report: policy "bad" is invalid, its priority `priority` out of
/// range (the condition's message names the value).
fn invalid(revision: u64, priority: i64) -> Report {
    let bad = ObjectRef::cluster(Kind::AdminNetworkPolicy, "bad");
    let problem = Problem::error(
        &bad,
        "spec.priority",
        tierproxy::policy::problem::ProblemKind::OutOfRange { value: priority, min: 0, max: 1000 },
    );
    Report::new(revision, &[problem], &[])
}

/// The holder of the status writers' Lease.
fn holder(api: &FakeApi) -> Option<String> {
    let lease = api.get("coordination.k8s.io/v1", "Lease", Some(LEASE_NS), LEASE)?;
    lease["spec"]["holderIdentity"].as_str().map(str::to_string)
}

/// Asserts that a leader's `requests` hold status writes between `from` and `lapsed` (the
/// request from which its lease had run out), and none from `lapsed` on.
fn writes_end_with_the_lease(requests: &[String], from: usize, lapsed: usize) {
    assert!(
        status_patches(&requests[from..lapsed]) > 0,
        "while its lease lasted, the leader wrote: {:?}",
        &requests[from..lapsed]
    );
    assert_eq!(
        status_patches(&requests[lapsed..]),
        0,
        "a status write once the lease had run out: {:?}",
        &requests[lapsed..]
    );
}

/// The message of tierproxy's condition on ANP `name`.
fn message(api: &FakeApi, name: &str) -> Option<String> {
    condition(api, name).and_then(|c| c["message"].as_str().map(str::to_string))
}

fn status_patches(requests: &[String]) -> usize {
    requests.iter().filter(|r| r.starts_with("PATCH") && r.contains("/status")).count()
}

/// How many times a writer tried to take or renew the Lease (each attempt reads it first).
fn lease_attempts(requests: &[String]) -> usize {
    requests
        .iter()
        .filter(|r| r.starts_with("GET") && r.contains(&format!("/leases/{LEASE}?")))
        .count()
}

/// Issue #19, item 2: a leader whose renewals fail (the API server is down) stops writing
/// once the lease its last renewal gave it has run out, even though it has not seen
/// another holder, and writes again only after a renewal succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_cannot_renew_stops_writing_when_its_lease_runs_out() {
    let (api, source) = one_invalid_policy().await;
    let lease = Duration::from_secs(2);
    let a = Writer::start(&api, &source, "a", lease.as_secs()).await;
    a.report(invalid(1, 1001));
    until("a writes", || message(&api, "bad").is_some_and(|m| m.contains("1001 is out"))).await;
    assert_eq!(holder(&api).as_deref(), Some("a"));

    // The outage. Every report from now on calls for a new condition, so a leader writes
    // (tries to) at each one.
    let down_at = Instant::now();
    let from = api.requests_by("a").len();
    api.set_down(true);
    let mut revision = 1;
    let mut lapsed: Option<usize> = None;
    loop {
        revision += 1;
        a.report(invalid(revision, 1000 + revision as i64));
        let requests = api.requests_by("a");
        // Past the lease (from a renewal before the outage), with a margin for a write
        // that started just before its end to reach the log.
        if lapsed.is_none() && down_at.elapsed() > lease + Duration::from_millis(500) {
            lapsed = Some(requests.len());
        }
        // Still trying to renew, and fed reports in between.
        if lapsed.is_some_and(|l| lease_attempts(&requests[l..]) >= 2) {
            break;
        }
        assert!(down_at.elapsed() < Duration::from_secs(15), "a's renewal attempts: {requests:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let requests = api.requests_by("a");
    writes_end_with_the_lease(&requests, from, lapsed.unwrap());

    // The API server is back: a renews (the Lease is still its own) and writes again, the
    // renewal first.
    let up = api.requests_by("a").len();
    api.set_down(false);
    revision += 1;
    let last = 1000 + revision as i64;
    a.report(invalid(revision, last));
    until("a writes again", || {
        message(&api, "bad").is_some_and(|m| m.contains(&format!("{last} is out")))
    })
    .await;
    let requests = &api.requests_by("a")[up..];
    let renewal = requests.iter().position(|r| r.starts_with("PUT") && r.contains("/leases/"));
    let write = requests.iter().position(|r| r.starts_with("PATCH") && r.contains("/status"));
    assert!(renewal.is_some() && renewal < write, "{requests:?}");
}

/// Issue #19, item 2: the leader's permission to the Lease is revoked (403 on its writes,
/// reads still work). It stops writing when the lease of its last renewal runs out, another
/// agent takes the Lease after that, and from then on only the new leader writes: the
/// condition, which the two write differently, never flips back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_may_no_longer_renew_gives_way_without_flapping() {
    let (api, source) = one_invalid_policy().await;
    // "a" writes "5001 is out of range" and, below, a new value with every report; "b"
    // writes "1002 is out of range".
    let lease = Duration::from_secs(6);
    let a = Writer::start(&api, &source, "a", lease.as_secs()).await;
    a.report(invalid(1, 5001));
    until("a writes", || message(&api, "bad").is_some_and(|m| m.contains("5001 is out"))).await;
    let b = Writer::start(&api, &source, "b", lease.as_secs()).await;
    b.report(invalid(1, 1002));
    until("b reads the Lease", || api.requests_by("b").iter().any(|r| r.contains("/leases"))).await;
    assert_eq!(holder(&api).as_deref(), Some("a"));

    // Revoked right after one of a's renewals: its lease runs out `lease` later.
    let lease_writes =
        |r: &[String]| r.iter().filter(|r| !r.starts_with("GET") && r.contains("/leases/")).count();
    let renewals = lease_writes(&api.requests_by("a"));
    until("a renews", || lease_writes(&api.requests_by("a")) > renewals).await;
    api.forbid("a", LEASES);
    let forbidden = Instant::now();
    let from = api.requests_by("a").len();
    let mut revision = 1;
    let mut lapsed: Option<usize> = None;
    let mut taken: Option<usize> = None;
    loop {
        revision += 1;
        a.report(invalid(revision, 5000 + revision as i64));
        b.report(invalid(revision, 1002));
        // With a margin for a write that started just before the end to reach the log.
        if lapsed.is_none() && forbidden.elapsed() > lease + Duration::from_millis(500) {
            lapsed = Some(api.requests_by("a").len());
        }
        let by_b = api.requests_by("b");
        if taken.is_none()
            && holder(&api).as_deref() == Some("b")
            && message(&api, "bad").is_some_and(|m| m.contains("1002 is out"))
        {
            taken = Some(by_b.len());
        }
        // b has renewed once since, and a, fed reports all along, had a condition to
        // write had it still thought it led.
        if lapsed.is_some() && taken.is_some_and(|t| lease_writes(&by_b[t..]) >= 1) {
            assert!(!a.task.is_finished());
            break;
        }
        assert!(
            forbidden.elapsed() < Duration::from_secs(20),
            "holder {:?}, condition {:?}; b's requests: {by_b:?}",
            holder(&api),
            message(&api, "bad"),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let by_a = api.requests_by("a");
    writes_end_with_the_lease(&by_a, from, lapsed.unwrap());
    let writers: Vec<&str> = api
        .writes()
        .iter()
        .filter(|(m, p, _)| m == "PATCH" && p.ends_with("/adminnetworkpolicies/bad/status"))
        .map(|(_, _, body)| {
            let m = body["status"]["conditions"][0]["message"].as_str().unwrap_or_default();
            if m.contains("1002 is out") { "b" } else { "a" }
        })
        .collect();
    let first_b = writers.iter().position(|w| *w == "b").unwrap();
    assert!(
        writers[first_b..].iter().all(|w| *w == "b"),
        "the old leader wrote after the new one: {writers:?}"
    );
    assert!(message(&api, "bad").unwrap().contains("1002 is out"));
    drop((a, b));
}

/// Issue #19, item 3: a leader told to stop releases the Lease, and another agent takes
/// over at once, not after the lease duration (15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_leader_releases_the_lease() {
    let (api, source) = one_invalid_policy().await;
    let mut a = Writer::start(&api, &source, "a", 15).await;
    a.report(invalid(1, 1001));
    until("a writes", || message(&api, "bad").is_some()).await;
    let b = Writer::start(&api, &source, "b", 15).await;
    b.report(invalid(1, 1002));
    until("b reads the Lease", || api.requests_by("b").iter().any(|r| r.contains("/leases"))).await;
    assert_eq!(holder(&api).as_deref(), Some("a"));
    assert!(a.leader.leading() && !b.leader.leading(), "the leader gauge: a leads, b does not");

    let stopped = Instant::now();
    a.stop();
    until("b holds the Lease", || holder(&api).as_deref() == Some("b")).await;
    assert!(stopped.elapsed() < Duration::from_secs(3), "taken over after {:?}", stopped.elapsed());
    until("b writes", || message(&api, "bad").is_some_and(|m| m.contains("1002 is out"))).await;
    tokio::time::timeout(Duration::from_secs(5), a.task).await.expect("a's writer ends").unwrap();
    assert!(!a.leader.leading() && b.leader.leading(), "the leader gauge: b leads, a stopped");
    drop(b);
}

/// Issue #19, item 9: a new leader with the same report posts no second InvalidPolicy
/// Event: the Event's name comes from the policy's uid, generation and message, and the
/// second create is refused (409 AlreadyExists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_does_not_post_the_same_event_again() {
    let (api, source) = one_invalid_policy().await;
    let events = || api.list("events.k8s.io/v1", "Event");
    let mut a = Writer::start(&api, &source, "a", 15).await;
    a.report(invalid(1, 1001));
    until("a posts the Event", || events().len() == 1).await;
    let b = Writer::start(&api, &source, "b", 15).await;
    b.report(invalid(1, 1001));
    a.stop();
    until("b holds the Lease", || holder(&api).as_deref() == Some("b")).await;
    until("b tries to post the Event", || {
        api.requests_by("b").iter().any(|r| r.starts_with("POST") && r.contains("/events"))
    })
    .await;
    let events = events();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["reason"], "InvalidPolicy");
    assert_eq!(events[0]["reportingInstance"], "a");
    drop(b);
}

/// Issue #19, item 4: `agent --dry-run --kube` reads the cluster and writes nothing to it
/// (no Lease, no status, no Event, no annotation), though a policy is invalid.
#[test]
fn a_dry_run_writes_nothing_to_the_cluster() {
    let api = FakeApi::start();
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"},
                     "status": {"addresses": [{"type": "InternalIP", "address": "172.18.0.2"}]}}));
    api.apply(ns("shop", json!({})));
    api.apply(pod("shop", "web-1", "10.0.0.5", json!({"app": "web"})));
    api.apply(anp("bad", 1001));
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tierproxy"))
        .args(["agent", "--kube", "--node", "node-a", "--dry-run"])
        .args(["--redirect-backend", "iptables", "--lease-namespace", LEASE_NS])
        .env("KUBECONFIG", api.kubeconfig(dir.path()))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("10.0.0.5"), "the API server's pod in the ruleset: {stdout}");
    let requests = api.requests();
    assert!(requests.iter().any(|r| r.starts_with("GET /apis/policy.networking.k8s.io/")));
    let writes: Vec<&String> = requests.iter().filter(|r| !r.starts_with("GET ")).collect();
    assert!(writes.is_empty(), "a dry run wrote: {writes:?}");
    // No status writer either: it would have read the Lease (before any attempt to take
    // it) as soon as it started.
    let status: Vec<&String> = requests.iter().filter(|r| r.contains("/leases")).collect();
    assert!(status.is_empty(), "a dry run started the status writer: {status:?}");
}

/// The same objects from the API server and from a YAML and a JSON manifest file (read as
/// the agent reads them, `manifest::Form::Compact`) compile to snapshots that decide alike
/// and report the same problems (issue #17: the file source keeps what this source keeps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_server_and_manifest_files_give_the_same_decisions() {
    use tierproxy::cluster::manifest::{self, Form};
    use tierproxy::policy::{Revision, Snapshot};
    use tierproxy::synth::{self, Shape};
    let shape = Shape {
        namespaces: 10,
        pods: 300,
        nodes: 4,
        network_policies: 20,
        admin_policies: 6,
        rules_per_admin_policy: 5,
        ..Shape::LOAD_TEST
    };
    let i = synth::cluster(shape, 11);
    fn values<T: serde::Serialize>(v: &[Arc<T>]) -> impl Iterator<Item = Value> + '_ {
        v.iter().map(|o| serde_json::to_value(o).unwrap())
    }
    let mut items: Vec<Value> = values(&i.namespaces)
        .chain(values(&i.nodes))
        .chain(values(&i.pods))
        .chain(values(&i.network_policies))
        .chain(values(&i.admin_network_policies))
        .chain(values(&i.baseline_admin_network_policies))
        .collect();
    // What real objects carry and neither source keeps.
    for o in &mut items {
        o["metadata"]["managedFields"] = json!([{"manager": "kubectl", "operation": "Update"}]);
    }
    // A terminated pod and a hostNetwork one.
    let mut done = pod("ns-1", "done", "10.200.0.1", json!({"app": "a1"}));
    done["status"]["phase"] = json!("Succeeded");
    let mut host = pod("ns-1", "host", "172.16.0.1", json!({"app": "a1"}));
    host["spec"]["hostNetwork"] = json!(true);
    items.extend([done, host]);

    let api = FakeApi::start();
    for o in &items {
        api.apply(o.clone());
    }
    let (source, _changes) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    let from_api = source.inputs();
    assert_eq!(from_api.pod_views.len(), 302);

    let dir = tempfile::tempdir().unwrap();
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let (yaml, json_file) = (dir.path().join("c.yaml"), dir.path().join("c.json"));
    std::fs::write(&yaml, serde_saphyr::to_string(&list).unwrap()).unwrap();
    std::fs::write(&json_file, list.to_string()).unwrap();
    let want = Snapshot::compile(&from_api, Revision(1));
    let lines = |problems: &[Problem]| {
        let mut v: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        v.sort();
        v
    };
    let mut flows = synth::flows(shape, 3000, 5);
    for ip in ["10.200.0.1", "172.16.0.1"] {
        for (src, dst) in [(ip, "10.128.0.2"), ("10.128.0.2", ip)] {
            flows.push(tierproxy::policy::Flow {
                src: src.parse().unwrap(),
                dst: dst.parse().unwrap(),
                protocol: tierproxy::policy::Protocol::Tcp,
                dst_port: 8080,
            });
        }
    }
    for file in [yaml, json_file] {
        let loaded = manifest::load_as(std::slice::from_ref(&file), Form::Compact);
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        assert!(loaded.inputs.pods.is_empty());
        assert_eq!(loaded.inputs.pod_views.len(), 302);
        let got = Snapshot::compile(&loaded.inputs, Revision(1));
        let mut problems = loaded.problems.clone();
        problems.extend(got.problems.iter().cloned());
        assert_eq!(lines(&problems), lines(&want.problems), "{}", file.display());
        assert_eq!(got.snapshot.pod_count(), want.snapshot.pod_count());
        assert_eq!(got.snapshot.policy_count(), want.snapshot.policy_count());
        for f in &flows {
            assert_eq!(
                got.snapshot.decide(f),
                want.snapshot.decide(f),
                "{}: {f:?}",
                file.display()
            );
        }
    }
}

/// `tierproxy explain --kube` reads the cluster's objects from the API server (the agent's
/// watchers and merge) and answers as `explain` does on a manifest of the same objects:
/// alone, with `-m` files merged in, and a hostNetwork pod named as a probe end (the API
/// source keeps pods as views). Without a usable kubeconfig it says so and exits 2.
#[test]
fn explain_kube_answers_as_explain_on_a_manifest_of_the_same_objects() {
    use std::process::Output;
    let node = |name: &str, ip: &str| {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
               "status": {"addresses": [{"type": "InternalIP", "address": ip}]}})
    };
    let mut host = pod("kube-system", "agent", "172.31.0.2", json!({}));
    host["spec"]["hostNetwork"] = json!(true);
    let objects = vec![
        node("node-a", "172.31.0.2"),
        ns("web", json!({"kubernetes.io/metadata.name": "web", "tier": "front"})),
        ns("db", json!({"kubernetes.io/metadata.name": "db"})),
        ns("kube-system", json!({"kubernetes.io/metadata.name": "kube-system"})),
        pod("web", "app", "10.0.1.1", json!({"app": "web"})),
        pod("db", "pg", "10.0.2.1", json!({"app": "pg"})),
        host,
        json!({"apiVersion": ANP, "kind": "AdminNetworkPolicy", "metadata": {"name": "front-not-db"},
               "spec": {"priority": 5, "subject": {"namespaces": {"matchLabels": {"tier": "front"}}},
                        "egress": [{"name": "no-db", "action": "Deny",
                                    "to": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "db"}}}],
                                    "ports": [{"portNumber": {"protocol": "TCP", "port": 5432}}]}]}}),
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
               "metadata": {"name": "pg-from-web", "namespace": "db"},
               "spec": {"podSelector": {}, "ingress": [{"from": [{"namespaceSelector": {}}],
                        "ports": [{"port": "http"}]}]}}),
    ];
    // Only in a file: the merge adds it.
    let extra = json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                       "metadata": {"name": "web-isolated", "namespace": "web"},
                       "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}});
    let api = FakeApi::start();
    for o in &objects {
        api.apply(o.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, items: &[Value]| {
        let path = dir.path().join(name);
        let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
        std::fs::write(&path, serde_saphyr::to_string(&list).unwrap()).unwrap();
        path
    };
    let cluster = write("cluster.yaml", &objects);
    let extra_file = write("extra.yaml", std::slice::from_ref(&extra));
    let probes = dir.path().join("probes.jsonl");
    std::fs::write(
        &probes,
        [
            r#"{"from": "web/app", "to": "db/pg", "port": 5432, "expect": "deny"}"#,
            r#"{"from": "web/app", "to": "db/pg", "port": 80}"#,
            r#"{"from": "db/pg", "to": "web/app", "port": 80, "protocol": "UDP"}"#,
            r#"{"from": "kube-system/agent", "to": "db/pg", "port": 80}"#,
            r#"{"from": "node/node-a", "to": "web/app", "port": 80}"#,
            r#"{"from": "192.0.2.9", "to": "db/pg", "port": 5432, "note": "external"}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let run = |args: &[&str], kubeconfig: &std::path::Path| -> Output {
        common::bin()
            .arg("explain")
            .args(args)
            .args(["--probes", probes.to_str().unwrap(), "-o", "json"])
            .env("KUBECONFIG", kubeconfig)
            .env("HOME", dir.path())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .expect("tierproxy runs")
    };
    let lines = |o: &Output| -> Vec<Value> {
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (c, x) = (cluster.to_str().unwrap(), extra_file.to_str().unwrap());

    let from_api = lines(&run(&["--kube"], &kubeconfig));
    assert_eq!(from_api, lines(&run(&["-m", c], &kubeconfig)));
    assert_eq!(from_api.len(), 6);
    assert_eq!(from_api[0]["verdict"], "deny");
    assert_eq!(from_api[3]["addresses"]["from"], "172.31.0.2", "the hostNetwork pod's address");
    let merged = lines(&run(&["--kube", "-m", x], &kubeconfig));
    assert_eq!(merged, lines(&run(&["-m", c, x], &kubeconfig)));
    assert_ne!(merged, from_api, "the file's NetworkPolicy isolates web/app");
    assert!(
        api.requests()
            .iter()
            .any(|r| r.contains("/apis/policy.networking.k8s.io/v1alpha1/adminnetworkpolicies"))
    );

    let none = run(&["--kube"], &dir.path().join("no-such-kubeconfig"));
    assert_eq!(none.status.code(), Some(2));
    let said = String::from_utf8_lossy(&none.stderr);
    assert!(said.contains("error: reading the API server: configuring the client"), "{said}");
}

/// Issue #22: `explain --kube` reads Antrea's objects as the agent does and decides as on a
/// manifest of the same objects; an invalid one served by the API server makes it refuse
/// to decide (exit 2), naming the object and the field.
#[test]
fn explain_kube_reads_antrea_objects_and_refuses_invalid_ones() {
    use std::process::Output;
    let objects = vec![
        node_a(),
        ns("a", json!({"kubernetes.io/metadata.name": "a"})),
        ns("b", json!({"kubernetes.io/metadata.name": "b"})),
        pod("a", "client", "10.0.0.1", json!({})),
        pod("b", "server", "10.0.0.2", json!({})),
        antrea_tier("dev", 10),
        acnp("drop", "dev"),
    ];
    let api = FakeApi::start();
    for o in &objects {
        api.apply(o.clone());
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.yaml");
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    std::fs::write(&file, serde_saphyr::to_string(&list).unwrap()).unwrap();
    let kubeconfig = api.kubeconfig(dir.path());
    let run = |args: &[&str]| -> Output {
        common::bin()
            .arg("explain")
            .args(args)
            .args(["--from", "a/client", "--to", "b/server", "--port", "80", "-o", "json"])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", dir.path())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .expect("tierproxy runs")
    };
    let answer = |o: &Output| -> Value {
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let from_api = answer(&run(&["--kube"]));
    assert_eq!(from_api, answer(&run(&["-m", file.to_str().unwrap()])));
    assert_eq!(from_api["verdict"], "deny", "{from_api}");

    let mut bad = acnp("bad", "dev");
    bad["spec"]["priority"] = json!(0.5);
    api.apply(bad);
    let refused = run(&["--kube"]);
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.lines().any(|l| l.starts_with("error: ClusterNetworkPolicy.crd.antrea.io bad")
            && l.contains("spec.priority")),
        "{said}"
    );
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.168.0.10"}],
                      "conditions": [{"type": "Ready", "status": "True"}]}})
}

fn network_policy(ns: &str, name: &str) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
           "metadata": {"name": name, "namespace": ns},
           "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}})
}

/// Issue #19, items 7 and 11: every list, the first and each relist after an error, asks
/// for the watch cache's state (`resourceVersion=0`), not a quorum read from etcd; every
/// request names the agent and its node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_come_from_the_watch_cache_and_requests_name_the_agent() {
    let api = FakeApi::start();
    api.apply(ns("shop", json!({})));
    // More than a page of pods: the watch cache answers them whole.
    for i in 0..600 {
        api.apply(pod("shop", &format!("web-{i}"), "10.0.0.5", json!({})));
    }
    let (source, _changes) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    assert_eq!(source.inputs().pod_views.len(), 600);
    let pod_lists = || {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
            .count()
    };
    assert_eq!(pod_lists(), 1, "600 pods in one list, not pages of 500");
    api.set_down(true);
    until("every watcher failing", || {
        source.health().iter().all(|(_, h)| h.failing_since.is_some())
    })
    .await;
    let mark = api.requests().len();
    api.set_down(false);
    until("every kind relisted", || relisted(&api, mark, None)).await;

    let lists: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("GET /api") && !r.contains("watch=true"))
        .collect();
    assert!(lists.len() >= 14, "{lists:?}");
    for l in &lists {
        assert!(
            l.contains("resourceVersion=0&") && l.contains("resourceVersionMatch=NotOlderThan"),
            "a list from the watch cache: {l}"
        );
    }

    // Paged quorum reads where asked for: `limit` and no resourceVersion.
    let mark = api.requests().len();
    let paged = ApiSource::start(
        client(&api).await,
        SourceConfig { page_size: Some(200), ..fast() },
        || {},
    );
    until("initial paged lists", || paged.initialized()).await;
    assert_eq!(paged.inputs().pod_views.len(), 600);
    let pages: Vec<String> = api.requests()[mark..]
        .iter()
        .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
        .cloned()
        .collect();
    assert_eq!(pages.len(), 3, "{pages:?}");
    assert!(pages.iter().all(|p| p.contains("limit=200") && !p.contains("resourceVersion")));

    let want = format!("tierproxy/{} ({NODE})", env!("CARGO_PKG_VERSION"));
    let agents = api.user_agents();
    assert_eq!(agents.len(), api.requests().len());
    assert!(agents.iter().all(|a| *a == want), "{want:?} on every request: {agents:?}");
}

/// Issue #19, item 8: a relist whose objects equal the store's (after an outage, after 410
/// Gone) moves no generation, so the agent rebuilds nothing; one that brings a change moves
/// it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relist_moves_the_generation_only_when_the_content_changed() {
    let api = FakeApi::start();
    api.apply(ns("shop", json!({"env": "prod"})));
    api.apply(node("node-a"));
    api.apply(pod("shop", "web-1", "10.0.0.5", json!({"app": "web"})));
    api.apply(pod("shop", "web-2", "10.0.0.6", json!({"app": "web"})));
    api.apply(network_policy("shop", "web"));
    api.apply(anp("deny-all", 10));
    let (source, _changes) = start(&api).await;
    until("initial lists", || source.initialized()).await;
    let g = source.generation();

    // An outage: every watcher fails, then relists the same objects.
    api.set_down(true);
    until("every watcher failing", || {
        source.health().iter().all(|(_, h)| h.failing_since.is_some())
    })
    .await;
    let mark = api.requests().len();
    api.set_down(false);
    until("every kind relisted", || relisted(&api, mark, None)).await;
    assert_eq!(source.generation(), g, "relists of unchanged objects are no change");
    until("recovered", || source.stale_for().is_none()).await;

    // 410 Gone: the watches end, the history is compacted; every kind relists (again and
    // again, until a change lets a watch start after the compaction), unchanged.
    let mark = api.requests().len();
    api.compact();
    api.close_watches();
    until("every kind relisted after 410", || relisted(&api, mark, None)).await;
    assert_eq!(source.generation(), g, "relists after 410 of unchanged objects are no change");

    // A change lets the watches start again: the namespaces' relist brings it, once.
    api.apply(ns("marker", json!({})));
    let rv = api.get("v1", "Namespace", None, "marker").unwrap()["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string();
    until("every kind watching from the new resourceVersion", || relisted(&api, mark, Some(&rv)))
        .await;
    assert_eq!(source.inputs().namespaces.len(), 2);
    assert_eq!(source.generation(), g + 1, "one relist brought a change");

    // An outage during which a pod goes: its relist moves the generation once.
    api.set_down(true);
    until("every watcher failing", || {
        source.health().iter().all(|(_, h)| h.failing_since.is_some())
    })
    .await;
    api.delete("v1", "Pod", Some("shop"), "web-2");
    let mark = api.requests().len();
    api.set_down(false);
    until("every kind relisted", || relisted(&api, mark, None)).await;
    assert_eq!(pod_names(&source), ["web-1"]);
    assert_eq!(source.generation(), g + 2, "one relist brought a change");

    // An outage during which a policy's status is written (by the status writer of another
    // agent): no change for the engine, but the store takes it (the status writer reads
    // the conditions from it).
    api.set_down(true);
    until("every watcher failing", || {
        source.health().iter().all(|(_, h)| h.failing_since.is_some())
    })
    .await;
    let mut with_status = anp("deny-all", 10);
    with_status["status"] = json!({"conditions": [{"type": "tierproxy.io/Accepted", "status": "True",
        "reason": "Accepted", "message": "", "lastTransitionTime": "2026-11-24T00:00:00Z"}]});
    api.apply(with_status);
    let mark = api.requests().len();
    api.set_down(false);
    until("every kind relisted", || relisted(&api, mark, None)).await;
    let conditions =
        source.admin_network_policies()[0].status.as_ref().map_or(0, |s| s.conditions.len());
    assert_eq!(conditions, 1, "the store has the status the relist brought");
    assert_eq!(source.generation(), g + 2, "a status is no change for the engine");
}

/// Issue #19, item 10: after an outage longer than the backoff cap, the watchers notice the
/// API server back within the prober's bound (1.5 probe intervals and round trips), not at
/// their next backoff retry; while it lasts, `staleness` names the failing kinds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_back_after_a_long_outage_is_noticed_within_the_probe_bound() {
    let api = FakeApi::start();
    api.apply(ns("shop", json!({})));
    let config = SourceConfig {
        backoff_initial: Duration::from_secs(1),
        backoff_max: Duration::from_secs(3),
        probe_interval: Duration::from_millis(100),
        ..fast()
    };
    let source = ApiSource::start(client(&api).await, config, || {});
    until("initial lists", || source.initialized()).await;
    assert!(source.staleness().is_none());

    api.set_down(true);
    let down = Instant::now();
    let namespace_errors = || {
        source.health().into_iter().find(|(k, _)| *k == WatchedKind::Namespace).unwrap().1.errors
    };
    // Longer than the cap, with the retries' step at the cap (three errors: 1 s, 2 s, 3 s).
    until("the outage at the backoff cap", || {
        namespace_errors() >= 3 && down.elapsed() > Duration::from_secs(3)
    })
    .await;
    let stale = source.staleness().expect("stale during the outage");
    assert!(stale.starts_with("stale: pods for "), "{stale}");
    assert!(stale.contains("namespaces for ") && stale.contains("503"), "{stale}");

    api.set_down(false);
    let back = Instant::now();
    api.apply(ns("created-after", json!({})));
    until("the namespace created after the outage", || source.inputs().namespaces.len() == 2).await;
    let took = back.elapsed();
    // 1.5 probe intervals (150 ms) and the round trips, far below the 3 s cap; generous for
    // a loaded machine.
    assert!(took < Duration::from_millis(1000), "noticed {took:?} after the server was back");
    until("no kind stale", || source.staleness().is_none()).await;
}

/// Issue #19, item 12: with `TIERPROXY_LOG=info` (the shipped `deploy/agent.env`), an
/// agent whose API server is down logs its own WARN per resource, not kube's client's
/// ERROR line per failed request.
#[test]
fn an_outage_logs_no_kube_client_error_per_request() {
    let api = FakeApi::start();
    api.set_down(true);
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("agent.log");
    let mut agent = common::bin()
        .args(["agent", "--kube", "--node", "n1", "--dry-run", "--kube-retry-max-ms", "100"])
        .arg("--log")
        .arg(&log)
        .env("KUBECONFIG", api.kubeconfig(dir.path()))
        .env("TIERPROXY_LOG", "info")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("tierproxy runs");
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    let start = Instant::now();
    // Every kind has said it failed, and many requests have failed since.
    while !(text().matches("watch failed").count() >= 7 && api.requests().len() >= 50) {
        if start.elapsed() > Duration::from_secs(20) || agent.try_wait().unwrap().is_some() {
            let _ = agent.kill();
            panic!("no WARN per kind and 50 failed requests in 20 s: {}", text());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.kill().unwrap();
    agent.wait().unwrap();
    let text = text();
    let errors: Vec<&str> =
        text.lines().filter(|l| l.contains("ERROR") && l.contains("kube_client")).collect();
    assert!(errors.is_empty(), "{} kube_client ERROR lines: {errors:?}", errors.len());
}
