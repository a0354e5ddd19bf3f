//! Policy status: one agent of the cluster, elected with a `coordination.k8s.io` Lease,
//! writes a condition on each AdminNetworkPolicy, BaselineAdminNetworkPolicy and
//! ClusterNetworkPolicy saying whether tierproxy accepted it, and a Kubernetes Event
//! (`events.k8s.io/v1`, type Warning, reason `InvalidPolicy`) for each invalid one
//! (issue #6, "Status"). Antrea's Tiers, ClusterNetworkPolicies and NetworkPolicies
//! (`crd.antrea.io`, issue #22) get the Event only: their status is Antrea's controller's,
//! and tierproxy writes nothing on them; their Event says what is enforced instead (the
//! recorded last good version, or nothing).
//!
//! - **The condition.** Type [`CONDITION_TYPE`] (`tierproxy.io/Accepted`; KEP-2091 leaves
//!   condition names to implementations, and a domain-qualified type cannot collide with
//!   another implementation's). `status: "True"` with reason `Accepted`, or with reason
//!   `PriorityConflict` on every policy of a tie, naming the others and which is evaluated
//!   first (it is enforced, ordered by name); `status: "False"` with reason `Invalid` and
//!   the validation error (no valid version is recorded: the policy is left out and none of
//!   its rules apply, Deny and Pass rules neither), or reason `InvalidUpdate` when the last
//!   good version recorded for it ([`super::lastgood`]) stays in force. `observedGeneration` is
//!   the object's `metadata.generation`; `lastTransitionTime` changes only when `status`
//!   does.
//! - **How it is written.** Server-side apply of the status subresource with field manager
//!   `tierproxy`, so the condition is ours alone and other implementations' conditions are
//!   untouched (the upstream CRDs key `status.conditions` by `type`). A status is written
//!   only when it differs from the stored one: a steady cluster causes no writes.
//! - **The Event.** Named after the policy, its uid, generation and the message
//!   (`invalid_policy_event`) and created, not recorded: a new leader that finds the same
//!   problem gets 409 AlreadyExists and posts nothing, so there is one Event per problem
//!   and policy generation, whoever leads. In namespace [`EVENT_NAMESPACE`] for the
//!   cluster-scoped kinds, in the policy's own for an Antrea NetworkPolicy.
//! - **The last good versions.** Under the same lease, after the conditions, the leader
//!   records the version of every policy the snapshot compiled as valid in the ConfigMap
//!   of [`super::lastgood`], which every agent reads.
//! - **Who writes it.** The leader elected by the Lease ([`lease`]); every other agent
//!   only enforces. A leader writes only within the lease its last successful renewal gave
//!   it: when renewals fail it stops before another agent may take the Lease, and it
//!   starts again only after a renewal succeeds; a leader that finds the Lease taken (its
//!   watch shows it and a read confirms it) stops at once. A stopping agent stops writing
//!   and releases the Lease, so that another takes over at once.
//!
//! Sources: issue #6; KEP-2091 "Monitoring Requirements" (status conditions);
//! Kubernetes API conventions, "Typical status properties" (`metav1.Condition`).
use std::collections::{BTreeMap, HashMap};
use std::hash::Hasher;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::events::v1 as events;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};

use super::apiserver::ApiSource;
use super::lease::{self, Leadership, LeaseOptions, leading_until};
use crate::policy::api::{v1alpha1, v1alpha2};
use crate::policy::problem::ProblemKind;
use crate::policy::{Kind, ObjectRef, Problem};

/// The condition type tierproxy writes.
pub const CONDITION_TYPE: &str = "tierproxy.io/Accepted";
/// The field manager of tierproxy's status writes (server-side apply).
pub const FIELD_MANAGER: &str = "tierproxy";
/// Default name of the Lease that elects the status writer.
pub const DEFAULT_LEASE_NAME: &str = "tierproxy-policy-status";
/// Default Lease duration (seconds): a leader that stops renewing is replaced after it.
pub const DEFAULT_LEASE_SECONDS: u64 = 15;
/// Namespace of the Events about policies: they are cluster-scoped, and Events of
/// cluster-scoped objects go to `default` (as kube's and client-go's recorders do).
pub const EVENT_NAMESPACE: &str = "default";
/// How often the leader compares every policy's status with what it should be, besides
/// after each new snapshot (catches a status someone else overwrote).
pub const RESYNC: Duration = Duration::from_secs(60);

/// What tierproxy makes of one policy in the snapshot in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acceptance {
    /// Valid and enforced.
    Accepted,
    /// Valid and enforced, but its priority equals another's whose subjects overlap; the
    /// tie is broken by name. The message names the others.
    PriorityConflict(String),
    /// Invalid, with no recorded last good version: left out of the snapshot, none of its
    /// rules apply (its Deny and Pass rules neither; what they matched is decided by the
    /// policies after it). The validation errors.
    Invalid(String),
    /// The latest version is invalid; the last good version recorded for it
    /// ([`super::lastgood`]) stays in force. The validation errors, and the generation in
    /// force.
    InvalidUpdate(String, Option<i64>),
}

/// Each policy's [`Acceptance`], from one snapshot's build.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The snapshot's revision.
    pub revision: u64,
    /// By policy; an object of the [`reported`] kinds that is missing here was valid and
    /// had no conflict.
    pub policies: BTreeMap<ObjectRef, Acceptance>,
    /// The objects of the recorded kinds ([`super::lastgood::RECORDED`]) whose version as
    /// given was valid, with the `metadata.generation` compiled: what the leader may record
    /// as their last good version ([`super::lastgood`]).
    pub valid: BTreeMap<ObjectRef, Option<i64>>,
}

impl Report {
    /// Builds the report of one snapshot from its problems (decoding, validation and
    /// [`crate::policy::compile::priority_conflicts`]) and the policies whose recorded last
    /// good version was put back, with its generation ([`super::lastgood::put_back`]).
    pub fn new(revision: u64, problems: &[Problem], kept: &[(ObjectRef, Option<i64>)]) -> Report {
        let mut policies: BTreeMap<ObjectRef, Acceptance> = BTreeMap::new();
        let mut errors: BTreeMap<&ObjectRef, Vec<String>> = BTreeMap::new();
        let mut conflicts: BTreeMap<&ObjectRef, Vec<String>> = BTreeMap::new();
        for p in problems.iter().filter(|p| reported(p.object.kind)) {
            let text = if p.field.is_empty() {
                p.kind.to_string()
            } else {
                format!("{}: {}", p.field, p.kind)
            };
            if p.is_error() {
                errors.entry(&p.object).or_default().push(text);
            } else if matches!(p.kind, ProblemKind::PriorityConflict { .. }) {
                conflicts.entry(&p.object).or_default().push(text);
            }
        }
        for (object, texts) in conflicts {
            policies.insert(object.clone(), Acceptance::PriorityConflict(texts.join("; ")));
        }
        for (object, texts) in errors {
            let text = texts.join("; ");
            let a = match kept.iter().find(|(k, _)| k == object) {
                Some((_, generation)) => Acceptance::InvalidUpdate(text, *generation),
                None => Acceptance::Invalid(text),
            };
            policies.insert(object.clone(), a);
        }
        Report { revision, policies, valid: BTreeMap::new() }
    }

    /// The acceptance of `object` (missing: [`Acceptance::Accepted`]).
    pub fn of(&self, object: &ObjectRef) -> Acceptance {
        self.policies.get(object).cloned().unwrap_or(Acceptance::Accepted)
    }
}

/// Whether tierproxy writes a status condition on objects of `kind`.
pub fn carries_status(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::AdminNetworkPolicy | Kind::BaselineAdminNetworkPolicy | Kind::ClusterNetworkPolicy
    )
}

/// Whether a [`Report`] gives the acceptance of objects of `kind`, and the leader posts
/// Events about the invalid ones: the [`carries_status`] kinds and Antrea's Tier,
/// ClusterNetworkPolicy and NetworkPolicy (Events only).
pub fn reported(kind: Kind) -> bool {
    carries_status(kind)
        || matches!(
            kind,
            Kind::AntreaTier | Kind::AntreaClusterNetworkPolicy | Kind::AntreaNetworkPolicy
        )
}

/// The condition `acceptance` calls for on an object at `generation`, or `None` when
/// `existing` (the object's conditions) already says so. `now` is the transition time of a
/// new status.
pub fn desired_condition(
    acceptance: &Acceptance,
    generation: Option<i64>,
    existing: &[Condition],
    now: Time,
) -> Option<Condition> {
    let (status, reason, message) = match acceptance {
        Acceptance::Accepted => ("True", "Accepted", "enforced by tierproxy".to_string()),
        Acceptance::PriorityConflict(m) => (
            "True",
            "PriorityConflict",
            format!(
                "enforced by tierproxy; equal priority with overlapping subjects, ordered by name: {m}"
            ),
        ),
        Acceptance::Invalid(m) => (
            "False",
            "Invalid",
            format!(
                "not enforced: invalid, and no valid earlier version is recorded, so none of \
                 its rules apply (Deny and Pass rules neither; the traffic they matched is \
                 decided by the policies after it): {m}"
            ),
        ),
        Acceptance::InvalidUpdate(m, generation) => (
            "False",
            "InvalidUpdate",
            format!(
                "this version is invalid; the last good version recorded{} stays in force: {m}",
                generation.map(|g| format!(" (generation {g})")).unwrap_or_default()
            ),
        ),
    };
    // metav1.Condition's message is at most 32768 bytes.
    let mut message = message;
    if message.len() > 32_768 {
        let mut cut = 32_765;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push_str("...");
    }
    let old = existing.iter().find(|c| c.type_ == CONDITION_TYPE);
    if let Some(c) = old
        && c.status == status
        && c.reason == reason
        && c.message == message
        && c.observed_generation == generation
    {
        return None;
    }
    let last_transition_time = match old {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => now,
    };
    Some(Condition {
        type_: CONDITION_TYPE.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    })
}

/// Where and as whom the status writer takes part in the election.
#[derive(Debug, Clone)]
pub struct StatusOptions {
    /// Namespace of the Lease (the agent's own; `POD_NAMESPACE` from the downward API).
    pub lease_namespace: String,
    /// Name of the Lease ([`DEFAULT_LEASE_NAME`]).
    pub lease_name: String,
    /// This agent's identity in the Lease (`POD_NAME`; the node name if unset).
    pub identity: String,
    /// Lease duration in seconds ([`DEFAULT_LEASE_SECONDS`]).
    pub lease_seconds: u64,
    /// Where the writer says whether it leads, for the agent's metrics.
    pub leader: Arc<LeaderState>,
}

/// Whether this agent's status writer leads now: until the end of the lease its last
/// successful renewal gave ([`lease::Leadership`]), read by the agent's metrics
/// (`tierproxy_policy_status_leader`). Leading lapses with the lease even when nothing
/// is written in between.
#[derive(Debug, Default)]
pub struct LeaderState(std::sync::Mutex<Option<tokio::time::Instant>>);

impl LeaderState {
    /// Whether the writer leads now.
    pub fn leading(&self) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|until| tokio::time::Instant::now() < until)
    }

    fn set(&self, until: Option<tokio::time::Instant>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = until;
    }
}

/// Runs the status writer until `stop` completes: takes part in the Lease election
/// ([`lease`]) and, while leading, writes conditions and Events after every new
/// [`Report`], every [`RESYNC`] and on becoming the leader. Each write is bounded by the
/// leadership: none starts, and none is waited for, past the end of the lease that the last
/// successful renewal gave. On `stop` it stops writing and then releases the Lease (within
/// [`lease::RELEASE_TIMEOUT`]). Errors are logged and retried; none stops enforcement.
pub async fn run(
    client: Client,
    source: ApiSource,
    options: StatusOptions,
    mut reports: tokio::sync::watch::Receiver<Arc<Report>>,
    records: Arc<super::lastgood::RecordStore>,
    stop: impl Future<Output = ()>,
) {
    let (leading, mut lead) = tokio::sync::watch::channel(None);
    let (stop_election, election_stopped) = tokio::sync::oneshot::channel::<()>();
    let election = tokio::spawn(lease::run(
        client.clone(),
        LeaseOptions {
            namespace: options.lease_namespace.clone(),
            name: options.lease_name.clone(),
            identity: options.identity.clone(),
            duration: Duration::from_secs(options.lease_seconds.max(1)),
            field_manager: FIELD_MANAGER.to_string(),
        },
        leading,
        async move {
            let _ = election_stopped.await;
        },
    ));
    let mut writer = Writer {
        client,
        identity: options.identity.clone(),
        announced: HashMap::new(),
        written: HashMap::new(),
        record_error: None,
    };
    let namespace = options.lease_namespace.clone();
    let mut resync = tokio::time::interval(RESYNC);
    let mut was_leading = false;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            () = &mut stop => break,
            r = lead.changed() => {
                if r.is_err() {
                    break;
                }
                options.leader.set(*lead.borrow());
                // A renewal only moves the lease's end: nothing new to write.
                if was_leading && leading_until(&lead).is_some() {
                    continue;
                }
            }
            r = reports.changed() => if r.is_err() { break },
            _ = resync.tick() => {}
        }
        was_leading = leading_until(&lead).is_some();
        if was_leading {
            let report = reports.borrow().clone();
            tokio::select! {
                biased;
                () = &mut stop => break,
                // Cut short by the lease's end: the next renewal syncs again.
                done = async {
                    writer.sync(&source, &report, &lead).await
                        && writer.record(&source, &report, &namespace, &records, &lead).await
                } => was_leading = done,
            }
        }
    }
    options.leader.set(None);
    let _ = stop_election.send(());
    let _ = election.await;
}

/// The three cluster-scoped policy kinds whose status tierproxy writes.
trait StatusPolicy:
    Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug
{
    /// Its kind, for [`ObjectRef`]s.
    const KIND: Kind;
    /// Its `status.conditions` (empty without a status).
    fn conditions(&self) -> &[Condition];
}

/// Implements [`StatusPolicy`] for a policy type whose `status` holds `conditions`.
macro_rules! status_policy {
    ($ty:ty, $kind:expr) => {
        impl StatusPolicy for $ty {
            const KIND: Kind = $kind;
            fn conditions(&self) -> &[Condition] {
                self.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default()
            }
        }
    };
}
status_policy!(v1alpha1::AdminNetworkPolicy, Kind::AdminNetworkPolicy);
status_policy!(v1alpha1::BaselineAdminNetworkPolicy, Kind::BaselineAdminNetworkPolicy);
status_policy!(v1alpha2::ClusterNetworkPolicy, Kind::ClusterNetworkPolicy);

/// The leader's writes.
struct Writer {
    client: Client,
    /// This agent's identity (the Events' `reportingInstance`).
    identity: String,
    /// The invalid policies whose Event exists (posted here, or found already posted):
    /// (object, generation) → message.
    announced: HashMap<(ObjectRef, Option<i64>), String>,
    /// The last condition written per policy, with the object's resourceVersion in the
    /// store at that time: until the store has seen the write (its resourceVersion moves),
    /// the same condition is not written again.
    written: HashMap<ObjectRef, (Option<String>, Condition)>,
    /// The last error recording the last good versions, logged once.
    record_error: Option<String>,
}

impl Writer {
    /// Writes every status that differs from `report`, and Events for newly invalid
    /// policies, while `lead` lets this agent lead. Returns false if the lease ran out
    /// first.
    async fn sync(&mut self, source: &ApiSource, report: &Report, lead: &Leadership) -> bool {
        if report.revision == 0 {
            return true;
        }
        for p in source.admin_network_policies() {
            if !self.one(&*p, report, lead).await {
                return false;
            }
        }
        for p in source.baseline_admin_network_policies() {
            if !self.one(&*p, report, lead).await {
                return false;
            }
        }
        for p in source.cluster_network_policies() {
            if !self.one(&*p, report, lead).await {
                return false;
            }
        }
        for t in source.antrea_tiers() {
            if !self.event(&*t, Kind::AntreaTier, report, lead).await {
                return false;
            }
        }
        for p in source.antrea_cluster_network_policies() {
            if !self.event(&*p, Kind::AntreaClusterNetworkPolicy, report, lead).await {
                return false;
            }
        }
        for p in source.antrea_network_policies() {
            if !self.event(&*p, Kind::AntreaNetworkPolicy, report, lead).await {
                return false;
            }
        }
        true
    }

    /// Writes one policy's condition and Event where needed; false if the lease ran out
    /// before a write was done.
    async fn one<K: StatusPolicy>(&mut self, obj: &K, report: &Report, lead: &Leadership) -> bool {
        let name = obj.name_any();
        let object = ObjectRef::cluster(K::KIND, name.clone());
        let acceptance = report.of(&object);
        let generation = obj.meta().generation;
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let version = obj.meta().resource_version.clone();
        let pending = |c: &Condition| {
            self.written.get(&object).is_some_and(|(v, w)| {
                *v == version
                    && (&w.status, &w.reason, &w.message, w.observed_generation)
                        == (&c.status, &c.reason, &c.message, c.observed_generation)
            })
        };
        if let Some(cond) = desired_condition(&acceptance, generation, obj.conditions(), now)
            && !pending(&cond)
        {
            let Some(until) = leading_until(lead) else { return false };
            let api: Api<K> = Api::all(self.client.clone());
            let patch = serde_json::json!({
                "apiVersion": K::api_version(&()),
                "kind": K::kind(&()),
                "status": { "conditions": [cond] },
            });
            let params = PatchParams::apply(FIELD_MANAGER).force();
            let patch = Patch::Apply(&patch);
            let write = api.patch_status(&name, &params, &patch);
            match tokio::time::timeout_at(until, write).await {
                Err(_) => return false,
                Ok(Ok(_)) => {
                    tracing::info!(object = %object, status = %cond.status, reason = %cond.reason, "policy status written");
                    self.written.insert(object.clone(), (version, cond));
                }
                Ok(Err(e)) => {
                    tracing::warn!(object = %object, error = %e, "cannot write policy status; retried at the next change or resync")
                }
            }
        }
        if let Acceptance::Invalid(m) | Acceptance::InvalidUpdate(m, _) = &acceptance {
            return self.post(obj, &object, m.clone(), lead).await;
        }
        true
    }

    /// Posts the Event about `obj` (of kind `kind`, one of Antrea's, which carry no
    /// tierproxy status) where `report` says it is invalid; its note says what is enforced
    /// in its place. False if the lease ran out first.
    async fn event<K: Resource<DynamicType = ()>>(
        &mut self,
        obj: &K,
        kind: Kind,
        report: &Report,
        lead: &Leadership,
    ) -> bool {
        let object = crate::policy::validate::object_ref(kind, obj.meta());
        let note = match report.of(&object) {
            Acceptance::Invalid(m) => {
                let outcome = if kind == Kind::AntreaTier {
                    "the policies naming it are invalid"
                } else {
                    "none of its rules apply"
                };
                format!(
                    "not enforced: invalid, and no valid earlier version is recorded, so {outcome}: {m}"
                )
            }
            Acceptance::InvalidUpdate(m, generation) => format!(
                "this version is invalid; the last good version recorded{} stays in force: {m}",
                generation.map(|g| format!(" (generation {g})")).unwrap_or_default()
            ),
            Acceptance::Accepted | Acceptance::PriorityConflict(_) => return true,
        };
        self.post(obj, &object, note, lead).await
    }

    /// Posts the InvalidPolicy Event saying `message` about `obj` (named `object`), unless
    /// it was posted (or found posted) for this generation already. False if the lease ran
    /// out first.
    async fn post<K: Resource<DynamicType = ()>>(
        &mut self,
        obj: &K,
        object: &ObjectRef,
        message: String,
        lead: &Leadership,
    ) -> bool {
        let key = (object.clone(), obj.meta().generation);
        if self.announced.get(&key) == Some(&message) {
            return true;
        }
        let Some(until) = leading_until(lead) else { return false };
        let event = invalid_policy_event(obj, object, &message, &self.identity);
        let namespace = event.metadata.namespace.as_deref().unwrap_or(EVENT_NAMESPACE);
        let api: Api<events::Event> = Api::namespaced(self.client.clone(), namespace);
        let params = PostParams { dry_run: false, field_manager: Some(FIELD_MANAGER.to_string()) };
        match tokio::time::timeout_at(until, api.create(&params, &event)).await {
            Err(_) => return false,
            Ok(Ok(_)) => {
                tracing::info!(object = %object, event = ?event.metadata.name, "InvalidPolicy event posted");
                self.announced.insert(key, message);
            }
            // Posted before, by this agent or an earlier leader.
            Ok(Err(kube::Error::Api(s))) if s.code == 409 => {
                self.announced.insert(key, message);
            }
            Ok(Err(e)) => {
                tracing::warn!(object = %object, error = %e, "cannot post the InvalidPolicy event; retried at the next change or resync")
            }
        }
        true
    }
}

/// The Warning Event `InvalidPolicy` about `obj` (named `object`), whose validation says
/// `message`. Its name is `<policy name>.<hash>`, the hash (64-bit FNV-1a) taken over the
/// policy's uid, generation and the Event's note: the same problem of the same object
/// version gets the same name whichever agent leads, so a second create is refused with
/// 409 AlreadyExists instead of posting it again (until the API server's event TTL, one
/// hour by default, removes it). Its namespace: the object's (an Antrea NetworkPolicy), or
/// [`EVENT_NAMESPACE`] for a cluster-scoped object. Fields: `events.k8s.io/v1` Event
/// (eventTime, reportingController and reportingInstance are required of new Events).
fn invalid_policy_event<K: Resource<DynamicType = ()>>(
    obj: &K,
    object: &ObjectRef,
    message: &str,
    instance: &str,
) -> events::Event {
    let note = truncate(format!("{object}: {message}"), 1024);
    let name = obj.name_any();
    let uid = obj.meta().uid.as_deref().unwrap_or(&name);
    let mut h = fnv::FnvHasher::default();
    for part in [uid.as_bytes(), &obj.meta().generation.unwrap_or(0).to_le_bytes(), note.as_bytes()]
    {
        h.write(&(part.len() as u64).to_le_bytes());
        h.write(part);
    }
    // An object name is at most 253 characters (a DNS subdomain); the suffix takes 17.
    let mut cut = name.len().min(253 - 17);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let prefix = name[..cut].trim_end_matches(['.', '-']);
    events::Event {
        metadata: ObjectMeta {
            name: Some(format!("{prefix}.{:016x}", h.finish())),
            namespace: Some(
                obj.meta().namespace.clone().unwrap_or_else(|| EVENT_NAMESPACE.to_string()),
            ),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(k8s_openapi::jiff::Timestamp::now())),
        action: Some("Validate".into()),
        reason: Some("InvalidPolicy".into()),
        note: Some(note),
        regarding: Some(obj.object_ref(&())),
        reporting_controller: Some(FIELD_MANAGER.into()),
        reporting_instance: Some(instance.to_string()),
        type_: Some("Warning".into()),
        ..events::Event::default()
    }
}

impl Writer {
    /// Records the last good version of every policy `report` compiled as valid
    /// ([`super::lastgood`]), in the ConfigMap of `namespace`, when the records change,
    /// while the lease lasts (false if it ran out first). A failure is logged (at most once
    /// per distinct error) and retried at the next report or resync.
    async fn record(
        &mut self,
        source: &ApiSource,
        report: &Report,
        namespace: &str,
        store: &super::lastgood::RecordStore,
        lead: &Leadership,
    ) -> bool {
        use super::lastgood::{self, Current};
        if report.revision == 0 || !store.initialized() {
            return true;
        }
        let mut current = Vec::new();
        current.extend(
            source
                .admin_network_policies()
                .iter()
                .map(|p| Current::of(&**p, Kind::AdminNetworkPolicy, &p.spec)),
        );
        current.extend(
            source
                .baseline_admin_network_policies()
                .iter()
                .map(|p| Current::of(&**p, Kind::BaselineAdminNetworkPolicy, &p.spec)),
        );
        current.extend(
            source
                .cluster_network_policies()
                .iter()
                .map(|p| Current::of(&**p, Kind::ClusterNetworkPolicy, &p.spec)),
        );
        current.extend(
            source.antrea_tiers().iter().map(|t| Current::of(&**t, Kind::AntreaTier, &t.spec)),
        );
        current.extend(
            source
                .antrea_cluster_network_policies()
                .iter()
                .map(|p| Current::of(&**p, Kind::AntreaClusterNetworkPolicy, &p.spec)),
        );
        current.extend(
            source
                .antrea_network_policies()
                .iter()
                .map(|p| Current::of(&**p, Kind::AntreaNetworkPolicy, &p.spec)),
        );
        let want = lastgood::desired(&store.records(), &current, report);
        let Some(until) = leading_until(lead) else { return false };
        let write = lastgood::write(&self.client, namespace, store, &want);
        match tokio::time::timeout_at(until, write).await {
            Err(_) => return false,
            Ok(Ok(written)) => {
                if written {
                    tracing::info!(policies = want.0.len(), "last good policy versions recorded");
                }
                self.record_error = None;
            }
            Ok(Err(e)) => {
                if self.record_error.as_deref() != Some(e.as_str()) {
                    tracing::warn!(error = %e, "cannot record the last good policy versions; retried at the next change or resync");
                    self.record_error = Some(e);
                }
            }
        }
        true
    }
}

/// `s` cut to at most `max` bytes (an Event's note is at most 1 kB).
fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max - 3;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Problem;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn report_names_errors_updates_and_conflicts() {
        let bad = ObjectRef::cluster(Kind::AdminNetworkPolicy, "bad");
        let kept = ObjectRef::cluster(Kind::AdminNetworkPolicy, "kept");
        let tie = ObjectRef::cluster(Kind::AdminNetworkPolicy, "tie");
        let np = ObjectRef::namespaced(Kind::NetworkPolicy, "ns", "np");
        let problems = vec![
            Problem::error(
                &bad,
                "spec.priority",
                ProblemKind::OutOfRange { value: 1001, min: 0, max: 1000 },
            ),
            Problem::error(&kept, "spec.subject", ProblemKind::Required),
            Problem::warning(
                &tie,
                "spec.priority",
                ProblemKind::PriorityConflict {
                    priority: 5,
                    other: bad.clone(),
                    overlap: 2,
                    first: true,
                },
            ),
            Problem::error(&np, "spec", ProblemKind::Required),
        ];
        let r = Report::new(3, &problems, &[(kept.clone(), Some(2))]);
        assert_eq!(
            r.of(&bad),
            Acceptance::Invalid("spec.priority: 1001 is out of range 0..=1000".into())
        );
        assert!(
            matches!(r.of(&kept), Acceptance::InvalidUpdate(m, Some(2)) if m.starts_with("spec.subject"))
        );
        assert!(matches!(r.of(&tie), Acceptance::PriorityConflict(_)));
        assert_eq!(
            r.of(&ObjectRef::cluster(Kind::AdminNetworkPolicy, "good")),
            Acceptance::Accepted
        );
        assert!(!r.policies.contains_key(&np), "NetworkPolicies carry no tierproxy status");
    }

    #[test]
    fn a_condition_is_written_only_when_it_changes() {
        let c = desired_condition(&Acceptance::Accepted, Some(2), &[], t(100)).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.observed_generation),
            ("True", "Accepted", Some(2))
        );
        // Unchanged: nothing to write.
        assert!(
            desired_condition(&Acceptance::Accepted, Some(2), std::slice::from_ref(&c), t(200))
                .is_none()
        );
        // New generation, same status: written, transition time kept.
        let c3 =
            desired_condition(&Acceptance::Accepted, Some(3), std::slice::from_ref(&c), t(300))
                .unwrap();
        assert_eq!(c3.last_transition_time, t(100));
        // Status flips: new transition time.
        let bad = Acceptance::Invalid("spec.priority: too big".into());
        let c4 = desired_condition(&bad, Some(4), std::slice::from_ref(&c3), t(400)).unwrap();
        assert_eq!((c4.status.as_str(), c4.reason.as_str()), ("False", "Invalid"));
        assert_eq!(c4.last_transition_time, t(400));
        assert!(c4.message.contains("spec.priority: too big"));
        // Someone else's condition is not ours.
        let other = Condition { type_: "Ready-In-Zone-a".into(), ..c4.clone() };
        assert!(desired_condition(&bad, Some(4), &[other], t(500)).is_some());
    }

    /// Issue #19, item 9: the Event's name depends on the policy's uid, generation and
    /// message only (not on the time or the leader), and is a valid object name.
    #[test]
    fn an_events_name_is_fixed_by_the_problem_and_the_policys_generation() {
        let anp = |name: &str, uid: &str, generation: i64| -> v1alpha1::AdminNetworkPolicy {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "policy.networking.k8s.io/v1alpha1", "kind": "AdminNetworkPolicy",
                "metadata": {"name": name, "uid": uid, "generation": generation},
                "spec": {"priority": 1001, "subject": {"namespaces": {}}}
            }))
            .unwrap()
        };
        let object = |name: &str| ObjectRef::cluster(Kind::AdminNetworkPolicy, name);
        let name = |p: &v1alpha1::AdminNetworkPolicy, m: &str, instance: &str| {
            let e = invalid_policy_event(p, &object(&p.name_any()), m, instance);
            assert_eq!(e.metadata.namespace.as_deref(), Some(EVENT_NAMESPACE));
            assert_eq!(e.regarding.as_ref().and_then(|r| r.name.as_deref()), Some(&*p.name_any()));
            e.metadata.name.unwrap()
        };
        let p = anp("bad", "u1", 3);
        let n = name(&p, "too big", "a");
        assert!(n.starts_with("bad.") && n.len() == "bad.".len() + 16, "{n}");
        assert_eq!(name(&p, "too big", "b"), n, "whichever agent posts it");
        assert_ne!(name(&anp("bad", "u1", 4), "too big", "a"), n, "a new generation");
        assert_ne!(name(&p, "too small", "a"), n, "another problem");
        assert_ne!(name(&anp("bad", "u2", 3), "too big", "a"), n, "a re-created policy");
        // A name of 253 characters: cut so that the whole is one again, not ending in '.'.
        let long = format!("{}.{}", "a".repeat(235), "b".repeat(17));
        let n = name(&anp(&long, "u1", 1), "too big", "a");
        assert!(n.len() <= 253 && !n.contains(".."), "{n}");
    }

    /// Antrea's objects are in the report (for their Events), and an Event about an
    /// Antrea NetworkPolicy goes to its own namespace.
    #[test]
    fn antrea_objects_are_reported_and_their_events_go_to_their_namespace() {
        let annp: crate::policy::api::antrea::NetworkPolicy =
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "shop", "uid": "u1", "generation": 1},
                "spec": {"tier": "nope", "priority": 1}
            }))
            .unwrap();
        let r = crate::policy::validate::object_ref(Kind::AntreaNetworkPolicy, &annp.metadata);
        let tier = ObjectRef::cluster(Kind::AntreaTier, "t");
        let problems = vec![
            Problem::error(&r, "spec.tier", ProblemKind::Required),
            Problem::error(&tier, "spec.priority", ProblemKind::Required),
        ];
        let report = Report::new(1, &problems, &[(tier.clone(), Some(4))]);
        assert!(matches!(report.of(&r), Acceptance::Invalid(m) if m.starts_with("spec.tier")));
        assert!(matches!(report.of(&tier), Acceptance::InvalidUpdate(_, Some(4))));
        let e = invalid_policy_event(&annp, &r, "spec.tier: nope", "a");
        assert_eq!(e.metadata.namespace.as_deref(), Some("shop"));
        let regarding = e.regarding.unwrap();
        assert_eq!(regarding.api_version.as_deref(), Some("crd.antrea.io/v1beta1"));
        assert_eq!(regarding.namespace.as_deref(), Some("shop"));
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        let m = "é".repeat(20_000);
        let c = desired_condition(&Acceptance::Invalid(m), None, &[], t(1)).unwrap();
        assert!(c.message.len() <= 32_768 && c.message.ends_with("..."));
        assert!(truncate("ü".repeat(600), 1024).len() <= 1024);
    }
}
