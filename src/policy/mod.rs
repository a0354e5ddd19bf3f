//! The policy core: API types → compiled [`Snapshot`] → [`Decision`].
//!
//! Pure by design (DESIGN §4): nothing in here knows about tokio, the kube client,
//! netfilter or OpenTelemetry, so every rule of the tiered model can be tested as a plain
//! function call. Three stages, as in DESIGN §5:
//!
//! 1. [`api`]: serde types of the upstream APIs, checked by [`validate`];
//! 2. [`compile`]: [`Inputs`] (API objects + cluster state) → an immutable, indexed
//!    [`Snapshot`] with a [`Revision`];
//! 3. [`eval`]: [`Snapshot::decide`] turns a [`Flow`] into a [`Decision`] that names the
//!    tier, policy and rule that decided each direction.
pub mod antrea_tiers;
pub mod api;
pub mod cidr;
pub mod compile;
pub mod eval;
pub mod labels;
mod matcher;
pub mod model;
pub mod ports;
pub mod problem;
pub mod selector;
mod snapshot;
pub mod validate;

pub use compile::{Compiled, Inputs, PodView};
pub use eval::{Basis, Decision, Flow, FlowKey, Outcome, RuleHit, RuleInfo, Verdict};
pub use model::{Action, Direction, Endpoint, Revision, Tier};
pub use ports::Protocol;
pub use problem::{Kind, ObjectRef, Problem, ProblemKind, Severity};
pub use snapshot::Snapshot;
