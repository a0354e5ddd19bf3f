//! Last good versions of the admin policies, recorded where every agent reads them
//! (issue #19, item 1).
//!
//! **The rule.** An AdminNetworkPolicy, BaselineAdminNetworkPolicy or ClusterNetworkPolicy
//! whose current version is invalid is enforced as the version recorded for it in the
//! ConfigMap [`CONFIGMAP`] of the agents' namespace, if there is one for the same object
//! (same `metadata.uid`) and it is valid; otherwise it is left out of the snapshot and none
//! of its rules apply. The answer depends only on what the API server holds (the policy and
//! the ConfigMap), never on what an agent saw before it started, so every agent gives the
//! same answer for the same API state whatever its start time (a DaemonSet rollout no longer
//! turns "last good version kept" into "left out").
//!
//! **Who records.** The agent holding the policy status Lease ([`super::status`]): after each
//! snapshot, every policy of the three kinds whose current version that snapshot compiled as
//! valid (its `metadata.generation` is the one compiled) is recorded with its uid,
//! generation and spec; a policy that is invalid now keeps its record; records of policies
//! that no longer exist are dropped. One server-side apply of the ConfigMap, only when its
//! content changes (a steady cluster causes no writes). A valid version that is replaced
//! before the leader recorded it is never the last good one: the one before it is (at most
//! one snapshot's delay, about 100 ms).
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
use crate::policy::api::{v1alpha1, v1alpha2};
use crate::policy::{Inputs, Kind, ObjectRef};

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

/// The ConfigMap key of `r`: `<kind in lower case>.<name>` (`adminnetworkpolicy.deny-all`;
/// a policy name is a DNS subdomain, so the key is a valid ConfigMap key).
pub fn key(r: &ObjectRef) -> String {
    format!("{}.{}", r.kind.as_str().to_ascii_lowercase(), r.name)
}

/// The policy a ConfigMap key names, if it is one of the three recorded kinds.
fn parse_key(k: &str) -> Option<ObjectRef> {
    let (kind, name) = k.split_once('.')?;
    let kind =
        [Kind::AdminNetworkPolicy, Kind::BaselineAdminNetworkPolicy, Kind::ClusterNetworkPolicy]
            .into_iter()
            .find(|c| c.as_str().eq_ignore_ascii_case(kind))?;
    (!name.is_empty()).then(|| ObjectRef::cluster(kind, name))
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

/// Puts back, in `inputs`, the recorded version of each policy named in `invalid` (the
/// object with its recorded spec: metadata as it is now), when a record of that object
/// exists (same uid when both have one). Returns the policies put back, each with the
/// generation recorded. A record that does not decode is not used. The caller compiles
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
        let Some(slot) = list.iter_mut().find(|o| o.meta().name.as_deref() == Some(&r.name)) else {
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
            _ => false,
        };
        if done && !kept.iter().any(|(k, _)| k == r) {
            kept.push((r.clone(), rec.generation));
        }
    }
    kept
}

/// One policy as the status writer's store holds it now, for [`desired`].
#[derive(Debug, Clone)]
pub struct Current {
    /// The policy.
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
            object: ObjectRef::cluster(kind, o.meta().name.clone().unwrap_or_default()),
            uid: o.meta().uid.clone(),
            generation: o.meta().generation,
            spec: serde_json::to_value(spec).unwrap_or(serde_json::Value::Null),
        }
    }
}

/// What the records should be, from the records now (`records`), the policies in the store
/// now (`current`) and the last snapshot's `report`: a policy whose current generation the
/// snapshot compiled as valid is recorded at that generation; any other policy keeps its
/// record if it is the same object (uid); a record of a policy no longer in the store is
/// dropped.
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
