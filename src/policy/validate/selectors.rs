//! Label selectors as apimachinery `ValidateLabelSelector` checks them, for NetworkPolicy
//! (errors) and inside the policy CRDs ([`CRD_SELECTOR_SEVERITY`](super::CRD_SELECTOR_SEVERITY)).
//!
//! Source: apimachinery `pkg/apis/meta/v1/validation` (`ValidateLabelSelector`,
//! `ValidateLabelSelectorRequirement`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

use crate::policy::api::{NamespacedPod, SelectorRef};
use crate::policy::labels::LabelSet;
use crate::policy::problem::{ObjectRef, Problem, ProblemKind, Severity};

use super::apimachinery::{
    is_label_value, is_qualified_name, label_value_errors, labels_map, qualified_name_errors,
};
use super::{CRD_SELECTOR_SEVERITY, Object, Path, SELECTOR_OPERATORS, Sink, invalid};

/// Validates a label selector as apimachinery `ValidateLabelSelector` does (with
/// `AllowInvalidLabelValueInSelector: false`, as on create): `matchLabels` keys are
/// qualified names and values valid label values; each `matchExpressions` entry has a
/// qualified-name key, an operator of `In`, `NotIn`, `Exists`, `DoesNotExist`, at least
/// one value for `In`/`NotIn`, none for `Exists`/`DoesNotExist`, and valid label values.
///
/// Problems are errors, as for built-in kinds (NetworkPolicy). Inside the policy CRDs the
/// validators here use [`CRD_SELECTOR_SEVERITY`] instead, because the API server does not
/// run this check on custom resources.
///
/// `sel` is either kind of selector (`&api::LabelSelector` or k8s-openapi's).
pub fn label_selector<'a>(
    sel: impl Into<SelectorRef<'a>>,
    object: &ObjectRef,
    path: &str,
    out: &mut Vec<Problem>,
) {
    let mut s = Sink { object: Object::Given(object), out };
    selector(&mut s, sel, &Path::root(path), Severity::Error);
}

pub(super) fn selector<'a>(
    s: &mut Sink<'_>,
    sel: impl Into<SelectorRef<'a>>,
    path: &Path<'_>,
    sev: Severity,
) {
    let sel = sel.into();
    // Valid selectors, nearly all of them, are checked without building messages.
    if !is_valid_selector(sel) {
        selector_problems(s, sel, path, sev);
    }
}

/// `true` iff [`selector`] finds no problem in `sel`.
#[inline]
fn is_valid_selector(sel: SelectorRef<'_>) -> bool {
    let SelectorRef { match_expressions, match_labels } = sel;
    match_labels.is_none_or(|l| l.pairs().all(|(k, v)| is_qualified_name(k) && is_label_value(v)))
        && match_expressions.is_none_or(|reqs| reqs.iter().all(is_valid_requirement))
}

/// `true` iff [`requirement`] finds no problem in `req`.
fn is_valid_requirement(req: &LabelSelectorRequirement) -> bool {
    let LabelSelectorRequirement { key, operator, values } = req;
    let values: &[String] = values.as_deref().unwrap_or_default();
    let operator_ok = match operator.as_str() {
        "In" | "NotIn" => !values.is_empty(),
        "Exists" | "DoesNotExist" => values.is_empty(),
        _ => false,
    };
    operator_ok && is_qualified_name(key) && values.iter().all(|v| is_label_value(v))
}

/// A label selector inside an Antrea-native policy (`crd.antrea.io/v1beta1`): the
/// admission webhook checks `matchLabels` (`validate.go checkSelectorsLabels`:
/// `IsQualifiedName` keys, `IsValidLabelValue` values) and the CRD schema the
/// `matchExpressions` operator enum (`In`, `NotIn`, `Exists`, `DoesNotExist`): those are
/// errors. The rest of `ValidateLabelSelector` is not run on custom resources
/// ([`CRD_SELECTOR_SEVERITY`]).
pub(super) fn antrea_selector<'a>(
    s: &mut Sink<'_>,
    sel: impl Into<SelectorRef<'a>>,
    path: &Path<'_>,
) {
    let sel = sel.into();
    if is_valid_selector(sel) {
        return;
    }
    let SelectorRef { match_expressions, match_labels } = sel;
    if let Some(labels) = match_labels {
        labels_map(s, &path.field("matchLabels"), &labels, Severity::Error);
    }
    if let Some(reqs) = match_expressions {
        let path = path.field("matchExpressions");
        for (i, req) in reqs.iter().enumerate() {
            requirement(s, req, &path.index(i), CRD_SELECTOR_SEVERITY, Severity::Error);
        }
    }
}

/// The problems of a selector, in the order [`selector`] reports them.
#[cold]
#[inline(never)]
fn selector_problems(s: &mut Sink<'_>, sel: SelectorRef<'_>, path: &Path<'_>, sev: Severity) {
    let SelectorRef { match_expressions, match_labels } = sel;
    if let Some(labels) = match_labels {
        labels_map(s, &path.field("matchLabels"), &labels, sev);
    }
    if let Some(reqs) = match_expressions {
        let path = path.field("matchExpressions");
        for (i, req) in reqs.iter().enumerate() {
            requirement(s, req, &path.index(i), sev, sev);
        }
    }
}

/// apimachinery `ValidateLabelSelectorRequirement`; an operator outside the enum is
/// reported at `operator_sev`, the rest at `sev`.
fn requirement(
    s: &mut Sink<'_>,
    req: &LabelSelectorRequirement,
    path: &Path<'_>,
    sev: Severity,
    operator_sev: Severity,
) {
    let LabelSelectorRequirement { key, operator, values } = req;
    let values: &[String] = values.as_deref().unwrap_or_default();
    match operator.as_str() {
        // "must be specified when `operator` is 'In' or 'NotIn'"
        "In" | "NotIn" => {
            if values.is_empty() {
                s.push(sev, &path.field("values"), ProblemKind::Required);
            }
        }
        // "may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
        "Exists" | "DoesNotExist" => {
            if !values.is_empty() {
                s.push(
                    sev,
                    &path.field("values"),
                    invalid(
                        values.join(","),
                        "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    ),
                );
            }
        }
        // "not a valid selector operator"
        _ => s.push(
            operator_sev,
            &path.field("operator"),
            ProblemKind::NotInEnum { value: operator.clone(), allowed: SELECTOR_OPERATORS },
        ),
    }
    let errs = qualified_name_errors(key);
    if !errs.is_empty() {
        s.push(sev, &path.field("key"), invalid(key, errs.join("; ")));
    }
    for (j, v) in values.iter().enumerate() {
        let errs = label_value_errors(v);
        if !errs.is_empty() {
            s.push(sev, &path.field("values").index(j), invalid(v, errs.join("; ")));
        }
    }
}

pub(super) fn namespaced_pod(s: &mut Sink<'_>, pods: &NamespacedPod, path: &Path<'_>) {
    let NamespacedPod { namespace_selector, pod_selector } = pods;
    selector(s, namespace_selector, &path.field("namespaceSelector"), CRD_SELECTOR_SEVERITY);
    selector(s, pod_selector, &path.field("podSelector"), CRD_SELECTOR_SEVERITY);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::api::LabelSelector;
    use crate::policy::problem::Kind;
    use crate::policy::validate::apimachinery::qualified_name_messages;
    use crate::policy::validate::table::*;

    #[test]
    fn public_label_selector_reports_errors() {
        let sel: LabelSelector =
            de(json!({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["1"]}]}));
        let object = ObjectRef::cluster(Kind::Namespace, "x");
        let mut out = Vec::new();
        label_selector(&sel, &object, "spec.sel", &mut out);
        assert_eq!(
            out,
            vec![Problem::error(
                &object,
                "spec.sel.matchExpressions[0].operator",
                not_in("Gt", SELECTOR_OPERATORS)
            )]
        );
    }

    proptest::proptest! {
        /// The fast checks valid input takes agree with the full checks that report
        /// problems: the same inputs pass.
        #[test]
        fn fast_checks_agree_with_full_checks(
            key in "[a-zA-Z0-9./_-]{0,6}(/[a-zA-Z0-9._-]{0,4})?",
            value in "[a-zA-Z0-9._ -]{0,5}",
            long in 60usize..70,
            op in proptest::sample::select(vec!["In", "NotIn", "Exists", "DoesNotExist", "Gt", ""]),
            values in proptest::collection::vec("[a-z0-9._-]{0,3}", 0..3),
            labels in proptest::collection::btree_map("[a-z0-9/_.-]{0,4}", "[a-z0-9_.-]{0,3}", 0..3),
        ) {
            let long_name = "a".repeat(long);
            for k in [key.as_str(), value.as_str(), long_name.as_str()] {
                proptest::prop_assert_eq!(is_qualified_name(k), qualified_name_messages(k).is_empty(), "{}", k);
                proptest::prop_assert_eq!(is_label_value(k), label_value_errors(k).is_empty(), "{}", k);
            }
            let sel: LabelSelector = de(json!({
                "matchLabels": labels,
                "matchExpressions": [{"key": key, "operator": op, "values": values}],
            }));
            let object = ObjectRef::cluster(Kind::Namespace, "x");
            let mut out = Vec::new();
            selector_problems(&mut Sink { object: Object::Given(&object), out: &mut out }, (&sel).into(), &Path::root("p"), Severity::Error);
            proptest::prop_assert_eq!(is_valid_selector((&sel).into()), out.is_empty(), "{:?}", sel);
            // NetworkPolicy's k8s-openapi selector from the same JSON: the same problems.
            let map: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector =
                de(serde_json::to_value(&sel).unwrap());
            let mut from_map = Vec::new();
            selector_problems(&mut Sink { object: Object::Given(&object), out: &mut from_map }, (&map).into(), &Path::root("p"), Severity::Error);
            proptest::prop_assert_eq!(out, from_map);
        }
    }
}
