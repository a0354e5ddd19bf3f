//! Last good versions of the admin policies and of Antrea's objects, recorded where every
//! agent reads them (issue #19, item 1; issue #22 for Antrea's kinds).
//!
//! **The rule.** An AdminNetworkPolicy, BaselineAdminNetworkPolicy or ClusterNetworkPolicy,
//! or an Antrea Tier, ClusterNetworkPolicy or NetworkPolicy ([`RECORDED`]), whose current
//! version is invalid is enforced as the version recorded for it in the ConfigMap
//! [`CONFIGMAP`] of the agents' namespace, if there is one for the same object (same
//! `metadata.uid`) and it is valid; otherwise it is left out of the snapshot and none of
//! its rules apply. The answer depends only on what the API server holds (the policy and
//! the ConfigMap), never on what an agent saw before it started, so every agent gives the
//! same answer for the same API state whatever its start time (a DaemonSet rollout no longer
//! turns "last good version kept" into "left out").
//!
//! **A Tier removed under its policies.** An Antrea policy is valid only if the Tier it
//! names exists, so its validity can change without the policy changing. Antrea's API
//! promises that it does not: its webhook refuses to delete a Tier that a policy names
//! ("tier is referenced by N policies"). tierproxy keeps that promise for the policies it
//! enforces: a deleted Tier's record stays while a policy (in the store, or in a record)
//! names it, and a policy that names it is enforced as its recorded version, with the Tier
//! at its recorded priority ([`ghost_tier`]); both are reported (the policy is invalid: its
//! Tier does not exist). So deleting a Tier under its policies changes no decision (their
//! Drop rules keep dropping, their Allow rules keep allowing), as if the delete had been
//! refused; a policy without a valid record (created while its Tier was missing) is left
//! out, as any invalid policy is. A Tier created again under the name is another object:
//! the policies are validated against it, the record is not used.
//!
//! **Who records.** The agent holding the policy status Lease ([`super::status`]): after each
//! snapshot, every object of the recorded kinds whose current version that snapshot
//! compiled as valid (its `metadata.generation` is the one compiled) is recorded with its
//! uid, generation and spec; an object that is invalid now keeps its record; records of
//! objects that no longer exist are dropped, but for a Tier's while a policy names it
//! (above). One server-side apply of the ConfigMap, only when its content changes (a steady
//! cluster causes no writes). A valid version that is replaced before the leader recorded
//! it is never the last good one: the one before it is (at most one snapshot's delay,
//! about 100 ms).
//!
//! **Why a ConfigMap.** Recording on the policies themselves (an annotation) would need the
//! right to patch them, which is the right to rewrite their specs; the ConfigMap needs
//! writes to one named object of the agents' own namespace (deploy/rbac.yaml). A record is
//! only ever used in place of an invalid version, so whoever could forge one could equally
//! have written that policy.
//!
//! **Limits.** A ConfigMap holds at most 1 MiB; past [`MAX_BYTES`] the leader writes no new
//! records and says so (rate-limited); the records already there stay usable. NetworkPolicies
//! are not recorded: the API server validates them itself, and one from a manifest file that
//! is invalid is left out. With manifest files only (no `--kube`) nothing is recorded and an
//! invalid policy is left out on every node alike.
//!
//! Sources: issue #19 item 1; ConfigMap size limit (Kubernetes "ConfigMaps" concept page:
//! "The data stored in a ConfigMap cannot exceed 1 MiB").
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::watcher;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::status::Report;
use crate::policy::antrea_tiers::tier_object_name;
use crate::policy::api::{antrea, v1alpha1, v1alpha2};
use crate::policy::{Inputs, Kind, ObjectRef};

/// The kinds whose last good versions are recorded.
pub const RECORDED: [Kind; 6] = [
    Kind::AdminNetworkPolicy,
    Kind::BaselineAdminNetworkPolicy,
    Kind::ClusterNetworkPolicy,
    Kind::AntreaTier,
    Kind::AntreaClusterNetworkPolicy,
    Kind::AntreaNetworkPolicy,
];

/// Name of the ConfigMap, in the agents' namespace (`--lease-namespace`), that holds the
/// records.
pub const CONFIGMAP: &str = "tierproxy-last-good";

/// Most bytes of records the leader writes (keys and values; the API server refuses a
/// ConfigMap over 1 MiB, and the rest of the object needs room).
pub const MAX_BYTES: usize = 900 * 1024;

/// One policy's recorded version: the value of its key in the ConfigMap, as JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// `metadata.uid` of the object recorded: a policy deleted and created again under the
    /// same name is another object, and its records are not its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// `metadata.generation` of the version recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// The version's `spec`.
    pub spec: serde_json::Value,
}

/// Every record, by policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Records(pub BTreeMap<ObjectRef, Record>);

/// The first part of a ConfigMap key for `kind`: the upstream kinds in lower case
/// (`adminnetworkpolicy`), Antrea's with `antrea-` before (`antrea-clusternetworkpolicy`:
/// two kinds share the name, and a `.` would be ambiguous, since names hold dots).
fn key_prefix(kind: Kind) -> String {
    let lower = kind.as_str().to_ascii_lowercase();
    match kind {
        Kind::AntreaTier | Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy => {
            format!("antrea-{lower}")
        }
        _ => lower,
    }
}

/// The ConfigMap key of `r`: `<prefix>.<name>` (`adminnetworkpolicy.deny-all`,
/// `antrea-tier.dev`), `<prefix>.<namespace>.<name>` for an Antrea NetworkPolicy
/// (`antrea-networkpolicy.shop.web`). A name is a DNS subdomain and a namespace a DNS label
/// (no dots), so the key is a valid ConfigMap key and names one object.
pub fn key(r: &ObjectRef) -> String {
    match &r.namespace {
        Some(ns) => format!("{}.{ns}.{}", key_prefix(r.kind), r.name),
        None => format!("{}.{}", key_prefix(r.kind), r.name),
    }
}

/// The object a ConfigMap key names, if it is one of the [`RECORDED`] kinds.
fn parse_key(k: &str) -> Option<ObjectRef> {
    let (prefix, rest) = k.split_once('.')?;
    let kind = RECORDED.into_iter().find(|c| key_prefix(*c) == prefix)?;
    if crate::policy::validate::is_namespaced(kind) {
        let (ns, name) = rest.split_once('.')?;
        (!ns.is_empty() && !name.is_empty()).then(|| ObjectRef::namespaced(kind, ns, name))
    } else {
        (!rest.is_empty()).then(|| ObjectRef::cluster(kind, rest))
    }
}

impl Records {
    /// The records of a ConfigMap's `data`, and an error text for each entry that is not one
    /// (unknown key, value that is not a [`Record`]): such an entry is skipped.
    pub fn from_data(data: &BTreeMap<String, String>) -> (Records, Vec<String>) {
        let mut out = BTreeMap::new();
        let mut errors = Vec::new();
        for (k, v) in data {
            let Some(r) = parse_key(k) else {
                errors.push(format!(
                    "ConfigMap {CONFIGMAP}: key {k:?} names no recorded policy kind"
                ));
                continue;
            };
            match serde_json::from_str::<Record>(v) {
                Ok(rec) => {
                    out.insert(r, rec);
                }
                Err(e) => errors.push(format!("ConfigMap {CONFIGMAP}: data.{k}: {e}")),
            }
        }
        (Records(out), errors)
    }

    /// The ConfigMap `data` holding these records.
    pub fn to_data(&self) -> BTreeMap<String, String> {
        self.0
            .iter()
            .map(|(r, rec)| (key(r), serde_json::to_string(rec).unwrap_or_else(|_| "{}".into())))
            .collect()
    }
}

/// Puts back, in `inputs`, the recorded version of each object named in `invalid` (the
/// object with its recorded spec: metadata as it is now), when a record of that object
/// exists (same uid when both have one). Returns the objects put back, each with the
/// generation recorded. A record that does not decode is not used. The caller validates
/// again: a recorded version that is itself invalid is then left out.
pub fn put_back(
    inputs: &mut Inputs,
    records: &Records,
    invalid: &[ObjectRef],
) -> Vec<(ObjectRef, Option<i64>)> {
    fn swap<T, S>(
        list: &mut [Arc<T>],
        r: &ObjectRef,
        rec: &Record,
        spec: impl Fn(&mut T) -> &mut S,
    ) -> bool
    where
        T: Resource + Clone,
        S: DeserializeOwned,
    {
        let named = |o: &Arc<T>| {
            o.meta().name.as_deref() == Some(&r.name)
                && r.namespace.as_ref().is_none_or(|ns| {
                    crate::policy::compile::meta_namespace(o.meta()) == ns.as_str()
                })
        };
        let Some(slot) = list.iter_mut().find(|o| named(o)) else {
            return false;
        };
        if let (Some(a), Some(b)) = (slot.meta().uid.as_deref(), rec.uid.as_deref())
            && a != b
        {
            return false;
        }
        let Ok(recorded) = serde_json::from_value::<S>(rec.spec.clone()) else { return false };
        let mut o = (**slot).clone();
        *spec(&mut o) = recorded;
        *slot = Arc::new(o);
        true
    }
    let mut kept = Vec::new();
    for r in invalid {
        let Some(rec) = records.0.get(r) else { continue };
        let done = match r.kind {
            Kind::AdminNetworkPolicy => swap(
                &mut inputs.admin_network_policies,
                r,
                rec,
                |o: &mut v1alpha1::AdminNetworkPolicy| &mut o.spec,
            ),
            Kind::BaselineAdminNetworkPolicy => swap(
                &mut inputs.baseline_admin_network_policies,
                r,
                rec,
                |o: &mut v1alpha1::BaselineAdminNetworkPolicy| &mut o.spec,
            ),
            Kind::ClusterNetworkPolicy => swap(
                &mut inputs.cluster_network_policies,
                r,
                rec,
                |o: &mut v1alpha2::ClusterNetworkPolicy| &mut o.spec,
            ),
            Kind::AntreaTier => {
                swap(&mut inputs.antrea.tiers, r, rec, |o: &mut antrea::Tier| &mut o.spec)
            }
            Kind::AntreaClusterNetworkPolicy => swap(
                &mut inputs.antrea.cluster_network_policies,
                r,
                rec,
                |o: &mut antrea::ClusterNetworkPolicy| &mut o.spec,
            ),
            Kind::AntreaNetworkPolicy => swap(
                &mut inputs.antrea.network_policies,
                r,
                rec,
                |o: &mut antrea::NetworkPolicy| &mut o.spec,
            ),
            _ => false,
        };
        if done && !kept.iter().any(|(k, _)| k == r) {
            kept.push((r.clone(), rec.generation));
        }
    }
    kept
}

/// The Tier that `r`'s record describes (its name, uid and recorded spec), for a Tier
/// deleted while a policy names it (module docs): what the policies' recorded versions are
/// validated and compiled with. `None` if `r` is no Tier or its spec does not decode.
pub fn ghost_tier(r: &ObjectRef, rec: &Record) -> Option<antrea::Tier> {
    if r.kind != Kind::AntreaTier {
        return None;
    }
    let spec: antrea::TierSpec = serde_json::from_value(rec.spec.clone()).ok()?;
    let mut tier = antrea::Tier::new(&r.name, spec);
    tier.metadata.uid.clone_from(&rec.uid);
    tier.metadata.generation = rec.generation;
    Some(tier)
}

/// The Tier object name an Antrea policy's spec (as JSON, a record's or a current one's)
/// names: `spec.tier` through [`tier_object_name`] (omitted: `application`).
fn tier_named(spec: &serde_json::Value) -> String {
    tier_object_name(spec.get("tier").and_then(|t| t.as_str()).unwrap_or("")).into_owned()
}

/// One object as the status writer's store holds it now, for [`desired`].
#[derive(Debug, Clone)]
pub struct Current {
    /// The object.
    pub object: ObjectRef,
    /// `metadata.uid`.
    pub uid: Option<String>,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `spec`, as JSON.
    pub spec: serde_json::Value,
}

impl Current {
    /// `o` (of kind `kind`) as a [`Current`].
    pub fn of<K: Resource, S: Serialize>(o: &K, kind: Kind, spec: &S) -> Current {
        Current {
            object: crate::policy::validate::object_ref(kind, o.meta()),
            uid: o.meta().uid.clone(),
            generation: o.meta().generation,
            spec: serde_json::to_value(spec).unwrap_or(serde_json::Value::Null),
        }
    }
}

/// What the records should be, from the records now (`records`), the objects in the store
/// now (`current`) and the last snapshot's `report`: an object whose current generation the
/// snapshot compiled as valid is recorded at that generation; any other object keeps its
/// record if it is the same object (uid); a record of an object no longer in the store is
/// dropped, except a Tier's while an Antrea policy in `current` or in the records kept
/// names it (module docs: a Tier is not deleted under its policies).
pub fn desired(records: &Records, current: &[Current], report: &Report) -> Records {
    let mut out = BTreeMap::new();
    for c in current {
        let valid_now = report.valid.get(&c.object).is_some_and(|g| *g == c.generation);
        if valid_now {
            out.insert(
                c.object.clone(),
                Record { uid: c.uid.clone(), generation: c.generation, spec: c.spec.clone() },
            );
        } else if let Some(old) = records.0.get(&c.object)
            && (old.uid.is_none() || old.uid == c.uid)
        {
            out.insert(c.object.clone(), old.clone());
        }
    }
    let is_policy =
        |k: Kind| matches!(k, Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy);
    let named: std::collections::BTreeSet<String> = current
        .iter()
        .filter(|c| is_policy(c.object.kind))
        .map(|c| tier_named(&c.spec))
        .chain(out.iter().filter(|(r, _)| is_policy(r.kind)).map(|(_, rec)| tier_named(&rec.spec)))
        .collect();
    for (r, rec) in &records.0 {
        if r.kind == Kind::AntreaTier
            && named.contains(&r.name)
            && !current.iter().any(|c| c.object == *r)
        {
            out.insert(r.clone(), rec.clone());
        }
    }
    Records(out)
}

/// The records as the agent last read them from the API server, and whether the first read
/// is done. Shared between the watcher, the snapshot builder and the status writer.
#[derive(Debug, Default)]
pub struct RecordStore {
    records: RwLock<Records>,
    initialized: AtomicBool,
    version: AtomicU64,
}

impl RecordStore {
    /// The records now.
    pub fn records(&self) -> Records {
        self.records.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the first read (a list of the ConfigMap, found or not) is done.
    pub fn initialized(&self) -> bool {
        self.initialized.load(Ordering::Acquire)
    }

    /// Increases with every change of the records.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    fn set(&self, records: Records) -> bool {
        let mut r = self.records.write().unwrap_or_else(|e| e.into_inner());
        if *r == records {
            return false;
        }
        *r = records;
        self.version.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// Records from a ConfigMap, logging entries that are not records.
fn read(cm: &ConfigMap) -> Records {
    let (records, errors) = Records::from_data(&cm.data.clone().unwrap_or_default());
    for e in errors {
        tracing::warn!("{e}; entry not used");
    }
    records
}

/// Watches the ConfigMap [`CONFIGMAP`] in `namespace` into `store` until the runtime stops;
/// `on_change` is called after each change of the records. A ConfigMap that does not exist
/// holds no records; an error (the API server unreachable, no RBAC to read it) keeps the
/// records last read and retries with backoff (1 s to 30 s); the first read counts as done
/// after a first error too, so that an agent without this permission still starts (with no
/// records: an invalid policy is left out).
pub async fn watch(
    client: Client,
    namespace: String,
    store: Arc<RecordStore>,
    on_change: impl Fn() + Send + Sync + 'static,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);
    // From the watch cache, as the other watchers list (issue #19, item 7).
    let config =
        watcher::Config::default().fields(&format!("metadata.name={CONFIGMAP}")).any_semantic();
    let mut delay = Duration::from_secs(1);
    let mut warned = false;
    loop {
        let mut events = std::pin::pin!(watcher(api.clone(), config.clone()));
        let mut listing: Option<Records> = None;
        while let Some(event) = events.next().await {
            let changed = match event {
                Ok(watcher::Event::Init) => {
                    listing = Some(Records::default());
                    false
                }
                Ok(watcher::Event::InitApply(cm)) => {
                    if cm.metadata.name.as_deref() == Some(CONFIGMAP) {
                        listing = Some(read(&cm));
                    }
                    false
                }
                Ok(watcher::Event::InitDone) => {
                    delay = Duration::from_secs(1);
                    warned = false;
                    let changed = store.set(listing.take().unwrap_or_default());
                    store.initialized.store(true, Ordering::Release);
                    changed
                }
                Ok(watcher::Event::Apply(cm)) if cm.metadata.name.as_deref() == Some(CONFIGMAP) => {
                    store.set(read(&cm))
                }
                Ok(watcher::Event::Delete(cm))
                    if cm.metadata.name.as_deref() == Some(CONFIGMAP) =>
                {
                    store.set(Records::default())
                }
                Ok(_) => false,
                Err(e) => {
                    if !warned {
                        warned = true;
                        tracing::warn!(
                            error = %e,
                            configmap = %format!("{namespace}/{CONFIGMAP}"),
                            "cannot read the recorded last good policy versions; retrying \
                             (an invalid policy without a readable record is left out)"
                        );
                    }
                    store.initialized.store(true, Ordering::Release);
                    break;
                }
            };
            if changed {
                on_change();
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Writes `want` as the ConfigMap's data (server-side apply, field manager
/// [`super::status::FIELD_MANAGER`]) when it differs from what `store` read. Past
/// [`MAX_BYTES`] nothing is written and `Err` says so.
///
/// # Errors
/// The records are too large, or the API server refused the write.
pub async fn write(
    client: &Client,
    namespace: &str,
    store: &RecordStore,
    want: &Records,
) -> Result<bool, String> {
    if *want == store.records() {
        return Ok(false);
    }
    let data = want.to_data();
    let bytes: usize = data.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_BYTES {
        return Err(format!(
            "the last good versions take {bytes} bytes, more than the {MAX_BYTES} one ConfigMap \
             may hold; not recorded"
        ));
    }
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let cm = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": CONFIGMAP,
            "labels": {"app.kubernetes.io/name": "tierproxy"},
        },
        "data": data,
    });
    api.patch(
        CONFIGMAP,
        &PatchParams::apply(super::status::FIELD_MANAGER).force(),
        &Patch::Apply(&cm),
    )
    .await
    .map_err(|e| format!("writing ConfigMap {namespace}/{CONFIGMAP}: {e}"))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anp(
        name: &str,
        uid: &str,
        generation: i64,
        priority: i32,
    ) -> Arc<v1alpha1::AdminNetworkPolicy> {
        Arc::new(
            serde_json::from_value(serde_json::json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1", "kind": "AdminNetworkPolicy",
                "metadata": {"name": name, "uid": uid, "generation": generation},
                "spec": {"priority": priority, "subject": {"namespaces": {}},
                         "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}
            }))
            .unwrap(),
        )
    }

    #[test]
    fn records_round_trip_through_configmap_data_and_bad_entries_are_named() {
        let r = ObjectRef::cluster(Kind::AdminNetworkPolicy, "deny-all");
        let rec = Record {
            uid: Some("u1".into()),
            generation: Some(3),
            spec: serde_json::json!({"priority": 5}),
        };
        let records = Records([(r.clone(), rec.clone())].into());
        let mut data = records.to_data();
        assert_eq!(data.keys().collect::<Vec<_>>(), ["adminnetworkpolicy.deny-all"]);
        assert_eq!(Records::from_data(&data), (records.clone(), vec![]));
        data.insert("pod.x".into(), "{}".into());
        data.insert("clusternetworkpolicy.y".into(), "not json".into());
        let (got, errors) = Records::from_data(&data);
        assert_eq!(got, records);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(
            errors.iter().any(|e| e.contains("pod.x"))
                && errors.iter().any(|e| e.contains("data.clusternetworkpolicy.y")),
            "{errors:?}"
        );
    }

    #[test]
    fn an_invalid_policy_gets_its_recorded_spec_only_for_the_same_object() {
        let mut inputs = Inputs {
            admin_network_policies: vec![anp("a", "u1", 4, 5000), anp("b", "u2", 2, 5000)],
            ..Inputs::default()
        };
        let a = ObjectRef::cluster(Kind::AdminNetworkPolicy, "a");
        let b = ObjectRef::cluster(Kind::AdminNetworkPolicy, "b");
        let good = |uid: &str, g| Record {
            uid: Some(uid.into()),
            generation: Some(g),
            spec: serde_json::to_value(&anp("x", uid, g, 7).spec).unwrap(),
        };
        // b's record belongs to an earlier object of that name (another uid).
        let records = Records([(a.clone(), good("u1", 3)), (b.clone(), good("old", 1))].into());
        let kept = put_back(&mut inputs, &records, &[a.clone(), b.clone()]);
        assert_eq!(kept, vec![(a, Some(3))]);
        let by = |n: &str| {
            inputs
                .admin_network_policies
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(n))
                .unwrap()
                .clone()
        };
        assert_eq!(by("a").spec.priority, 7, "recorded spec put back");
        assert_eq!(by("a").metadata.generation, Some(4), "metadata as it is now");
        assert_eq!(by("b").spec.priority, 5000, "another object's record is not used");
    }

    /// Antrea's kinds have keys of their own (Antrea and upstream both have a
    /// ClusterNetworkPolicy), an Antrea NetworkPolicy's with its namespace; each parses
    /// back to its object, a name with dots included.
    #[test]
    fn antrea_keys_name_one_object_and_round_trip() {
        let objects = [
            ObjectRef::cluster(Kind::ClusterNetworkPolicy, "x.y"),
            ObjectRef::cluster(Kind::AntreaClusterNetworkPolicy, "x.y"),
            ObjectRef::cluster(Kind::AntreaTier, "dev"),
            ObjectRef::namespaced(Kind::AntreaNetworkPolicy, "shop", "web.v2"),
        ];
        let keys: Vec<String> = objects.iter().map(key).collect();
        assert_eq!(
            keys,
            [
                "clusternetworkpolicy.x.y",
                "antrea-clusternetworkpolicy.x.y",
                "antrea-tier.dev",
                "antrea-networkpolicy.shop.web.v2"
            ]
        );
        for (k, r) in keys.iter().zip(&objects) {
            assert_eq!(parse_key(k).as_ref(), Some(r), "{k}");
        }
        assert_eq!(parse_key("antrea-networkpolicy.no-name"), None);
    }

    /// A Tier's record outlives its object while an Antrea policy (in the store, or in a
    /// record kept) names it; once none does, it is dropped as any other.
    #[test]
    fn a_deleted_tiers_record_stays_while_a_policy_names_it() {
        let tier = ObjectRef::cluster(Kind::AntreaTier, "dev");
        let p = ObjectRef::cluster(Kind::AntreaClusterNetworkPolicy, "p");
        let rec =
            |spec: serde_json::Value| Record { uid: Some("u".into()), generation: Some(1), spec };
        let records = Records(
            [
                (tier.clone(), rec(serde_json::json!({"priority": 10}))),
                (p.clone(), rec(serde_json::json!({"tier": "dev", "priority": 5}))),
            ]
            .into(),
        );
        let current = |tier: &str| Current {
            object: p.clone(),
            uid: Some("u".into()),
            generation: Some(2),
            spec: serde_json::json!({"tier": tier, "priority": 5}),
        };
        // The policy names the deleted Tier now (and is invalid: its record is kept).
        let want = desired(&records, &[current("dev")], &Report::default());
        assert!(want.0.contains_key(&tier) && want.0.contains_key(&p), "{want:?}");
        // It names another Tier now, but its record (kept: invalid now) names the deleted one.
        let want = desired(&records, &[current("ops")], &Report::default());
        assert!(want.0.contains_key(&tier), "{want:?}");
        // Valid now in another Tier: recorded anew; nothing names the deleted Tier.
        let mut report = Report::default();
        report.valid.insert(p.clone(), Some(2));
        let want = desired(&records, &[current("ops")], &report);
        assert!(!want.0.contains_key(&tier), "{want:?}");
        // The policy is gone too.
        assert!(desired(&records, &[], &Report::default()).0.is_empty());
    }

    #[test]
    fn the_leader_records_valid_versions_keeps_records_of_invalid_ones_and_drops_deleted() {
        let r = |n: &str| ObjectRef::cluster(Kind::AdminNetworkPolicy, n);
        let cur = |n: &str, uid: &str, g: i64, p: i32| {
            let o = anp(n, uid, g, p);
            Current::of(&*o, Kind::AdminNetworkPolicy, &o.spec)
        };
        let old = |uid: &str, g: i64| Record {
            uid: Some(uid.into()),
            generation: Some(g),
            spec: serde_json::json!({"priority": 1}),
        };
        let records = Records(
            [
                (r("valid"), old("u1", 1)),
                (r("broken"), old("u2", 1)),
                (r("gone"), old("u3", 1)),
                (r("recreated"), old("u4", 1)),
            ]
            .into(),
        );
        let mut report = Report::default();
        report.valid.insert(r("valid"), Some(2));
        report.valid.insert(r("new"), Some(1));
        // "stale": the snapshot compiled generation 1, the store already holds 2.
        report.valid.insert(r("stale"), Some(1));
        let current = vec![
            cur("valid", "u1", 2, 10),
            cur("broken", "u2", 5, 5000),
            cur("new", "u5", 1, 20),
            cur("stale", "u6", 2, 30),
            cur("recreated", "u7", 1, 5000),
        ];
        let want = desired(&records, &current, &report);
        let names: Vec<&str> = want.0.keys().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["broken", "new", "valid"]);
        assert_eq!(want.0[&r("valid")].generation, Some(2));
        assert_eq!(want.0[&r("valid")].spec["priority"], 10);
        assert_eq!(want.0[&r("broken")], old("u2", 1), "an invalid policy keeps its record");
    }
}
