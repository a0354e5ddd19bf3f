//! Object metadata, names, labels and ports as apimachinery checks them: the syntax every
//! kind here shares.
//!
//! Sources: apimachinery `pkg/api/validation` (`ValidateObjectMeta`) and
//! `pkg/util/validation` (`IsDNS1123Label`, `IsDNS1123Subdomain`, `IsQualifiedName`,
//! `IsValidLabelValue`, `IsValidPortName`, `IsValidPortNum`, `IsValidIP`).

use std::borrow::Cow;
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::policy::labels::LabelSet;
use crate::policy::problem::{ProblemKind, Severity};

use super::{
    MAX_ANNOTATIONS_BYTES, MAX_LABEL_LEN, MAX_PORT, MAX_PORT_NAME_LEN, MAX_SUBDOMAIN_LEN, Path,
    Sink, invalid,
};

/// Which name syntax `metadata.name` must follow.
#[derive(Clone, Copy)]
pub(super) enum NameRule {
    /// `NameIsDNSLabel` (namespaces).
    Label,
    /// `NameIsDNSSubdomain` (everything else here).
    Subdomain,
}

/// apimachinery `ValidateObjectMeta`, the parts that apply to objects read from files.
pub(super) fn object_meta(s: &mut Sink<'_>, meta: &ObjectMeta, rule: NameRule, namespaced: bool) {
    // "name or generateName is required"; a file has no server to expand generateName.
    match meta.name.as_deref() {
        None | Some("") => s.error(&Path::root("metadata.name"), ProblemKind::Required),
        Some(name) => {
            let errs = match rule {
                NameRule::Label => dns1123_label_errors(name),
                NameRule::Subdomain => dns1123_subdomain_errors(name),
            };
            if !errs.is_empty() {
                s.error(&Path::root("metadata.name"), invalid(name, errs.join("; ")));
            }
        }
    }
    match (namespaced, meta.namespace.as_deref()) {
        (true, None | Some("")) => {
            s.error(&Path::root("metadata.namespace"), ProblemKind::Required)
        }
        // ValidateNamespaceName is NameIsDNSLabel.
        (true, Some(ns)) => {
            let errs = dns1123_label_errors(ns);
            if !errs.is_empty() {
                s.error(&Path::root("metadata.namespace"), invalid(ns, errs.join("; ")));
            }
        }
        (false, None | Some("")) => {}
        // apiserver rest.EnsureObjectNamespaceMatchesRequestNamespace: "cluster-scoped,
        // clear namespace": the field is dropped, not rejected.
        (false, Some(ns)) => s.warning(
            &Path::root("metadata.namespace"),
            invalid(ns, "this kind is cluster-scoped; the API server drops metadata.namespace"),
        ),
    }
    if let Some(labels) = &meta.labels {
        // ValidateLabels: "ValidateLabelName" for keys, "IsValidLabelValue" for values.
        labels_map(s, &Path::root("metadata.labels"), labels, Severity::Error);
    }
    if let Some(annotations) = &meta.annotations {
        // ValidateAnnotations: keys are qualified names ("strings.ToLower(k)"), and
        // "annotations: Too long: must have at most 262144 bytes" in total.
        let path = Path::root("metadata.annotations");
        let mut total = 0usize;
        for (k, v) in annotations {
            total = total.saturating_add(k.len()).saturating_add(v.len());
            let lower = if k.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(k.to_ascii_lowercase())
            } else {
                Cow::Borrowed(k.as_str())
            };
            let errs = qualified_name_errors(&lower);
            if !errs.is_empty() {
                s.error(&path.key(k), invalid(k, errs.join("; ")));
            }
        }
        if total > MAX_ANNOTATIONS_BYTES {
            s.error(&path, ProblemKind::TooLong { len: total, max: MAX_ANNOTATIONS_BYTES });
        }
    }
}

pub(super) fn labels_map(s: &mut Sink<'_>, path: &Path<'_>, labels: &impl LabelSet, sev: Severity) {
    for (k, v) in labels.pairs() {
        // Valid entries, nearly all of them, are checked without building messages.
        if !is_qualified_name(k) || !is_label_value(v) {
            label_problems(s, &path.key(k), k, v, sev);
        }
    }
}

/// The problems of one `labels` entry: its key's, then its value's.
#[cold]
fn label_problems(s: &mut Sink<'_>, field: &Path<'_>, k: &str, v: &str, sev: Severity) {
    let errs = qualified_name_errors(k);
    if !errs.is_empty() {
        s.push(sev, field, invalid(k, errs.join("; ")));
    }
    let errs = label_value_errors(v);
    if !errs.is_empty() {
        s.push(sev, field, invalid(v, errs.join("; ")));
    }
}

/// A port number with `Minimum=1`, `Maximum=65535`.
pub(super) fn check_port(s: &mut Sink<'_>, path: &Path<'_>, value: i32) {
    if !(1..=MAX_PORT).contains(&value) {
        s.error(
            path,
            ProblemKind::OutOfRange { value: value.into(), min: 1, max: MAX_PORT.into() },
        );
    }
}

/// Parses an IP as `IsValidIPForLegacyField` does with strict validation (the
/// `StrictIPCIDRValidation` behaviour): no leading zeros in IPv4 octets, no zones, no
/// IPv4-mapped IPv6 addresses.
pub(super) fn parse_ip(s: &str) -> Result<IpAddr, &'static str> {
    let ip: IpAddr = s.parse().map_err(|_| "must be a valid IP address")?;
    if let IpAddr::V6(v6) = ip
        && v6.to_ipv4_mapped().is_some()
    {
        return Err("must not be an IPv4-mapped IPv6 address");
    }
    Ok(ip)
}

fn is_lower_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// `[a-z0-9]([-a-z0-9]*[a-z0-9])?`
fn matches_dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(&f), Some(&l)) => {
            is_lower_alnum(f)
                && is_lower_alnum(l)
                && b.iter().all(|&c| is_lower_alnum(c) || c == b'-')
        }
        _ => false,
    }
}

/// `IsDNS1123Label`.
fn dns1123_label_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_LABEL_LEN {
        errs.push(format!("must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !matches_dns1123_label(s) {
        errs.push(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or \
             '-', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `IsDNS1123Subdomain`.
fn dns1123_subdomain_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_SUBDOMAIN_LEN {
        errs.push(format!("must be no more than {MAX_SUBDOMAIN_LEN} characters"));
    }
    if !s.split('.').all(matches_dns1123_label) {
        errs.push(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
             characters, '-' or '.', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]`
fn matches_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter().all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

/// [`qualified_name_errors`] is empty: checked without building messages.
pub(super) fn is_qualified_name(s: &str) -> bool {
    // The common case, a name without prefix: the name part's character class has no '/'.
    if s.len() <= MAX_LABEL_LEN && matches_qualified_name_part(s) {
        return true;
    }
    let name = match s.bytes().position(|c| c == b'/') {
        None => s,
        Some(i) => {
            let prefix = &s[..i];
            if prefix.is_empty()
                || prefix.len() > MAX_SUBDOMAIN_LEN
                || !prefix.split('.').all(matches_dns1123_label)
            {
                return false;
            }
            // A second '/' fails the name part's character class.
            &s[i + 1..]
        }
    };
    name.len() <= MAX_LABEL_LEN && matches_qualified_name_part(name)
}

/// `IsQualifiedName`: label keys and annotation keys.
pub(super) fn qualified_name_errors(s: &str) -> Vec<String> {
    if is_qualified_name(s) { Vec::new() } else { qualified_name_messages(s) }
}

/// The messages of [`qualified_name_errors`], worked out in full.
pub(super) fn qualified_name_messages(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    // `s.split('/')` has one part (a name), two (prefix and name) or more (invalid).
    let name = match s.split_once('/') {
        None => s,
        Some((prefix, name)) if !name.contains('/') => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_owned());
            } else {
                errs.extend(
                    dns1123_subdomain_errors(prefix)
                        .into_iter()
                        .map(|m| format!("prefix part {m}")),
                );
            }
            name
        }
        Some(_) => {
            errs.push(
                "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and \
                 must start and end with an alphanumeric character, with an optional DNS \
                 subdomain prefix and '/'"
                    .to_owned(),
            );
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_owned());
    } else if name.len() > MAX_LABEL_LEN {
        errs.push(format!("name part must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !matches_qualified_name_part(name) {
        errs.push(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start \
             and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// [`label_value_errors`] is empty.
pub(super) fn is_label_value(s: &str) -> bool {
    s.len() <= MAX_LABEL_LEN && (s.is_empty() || matches_qualified_name_part(s))
}

/// `IsValidLabelValue`: empty, or a qualified-name part of at most 63 characters.
pub(super) fn label_value_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_LABEL_LEN {
        errs.push(format!("must be no more than {MAX_LABEL_LEN} characters"));
    }
    if !s.is_empty() && !matches_qualified_name_part(s) {
        errs.push(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', \
             '_' or '.', and must start and end with an alphanumeric character"
                .to_owned(),
        );
    }
    errs
}

/// `IsValidPortName` (IANA_SVC_NAME, RFC 6335): at most 15 characters of `[-a-z0-9]`, at
/// least one letter, no `--`, no leading or trailing `-`.
pub(super) fn port_name_errors(s: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if s.len() > MAX_PORT_NAME_LEN {
        errs.push(format!("must be no more than {MAX_PORT_NAME_LEN} characters"));
    }
    if s.is_empty() || !s.bytes().all(|c| is_lower_alnum(c) || c == b'-') {
        errs.push(
            "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)".to_owned(),
        );
    }
    if !s.bytes().any(|c| c.is_ascii_lowercase()) {
        errs.push("must contain at least one letter (a-z)".to_owned());
    }
    if s.contains("--") {
        errs.push("must not contain consecutive hyphens".to_owned());
    }
    if s.starts_with('-') || s.ends_with('-') {
        errs.push("must not begin or end with a hyphen".to_owned());
    }
    errs
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::json;

    use super::*;
    use crate::policy::validate::is_domain_name;
    use crate::policy::validate::table::*;

    /// This file's rows of the table (one per rule).
    pub(in crate::policy::validate) fn rows() -> Vec<Row> {
        use ProblemKind as P;
        use Target::*;
        vec![
            // ---- metadata ------------------------------------------------------------
            row(
                "metadata_name_required",
                Anp,
                |v| v["metadata"] = json!({}),
                vec![err("metadata.name", P::Required)],
            ),
            row(
                "metadata_name_dns1123_subdomain",
                Anp,
                |v| v["metadata"]["name"] = json!("Bad_Name"),
                vec![err(
                    "metadata.name",
                    inv(
                        "Bad_Name",
                        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "metadata_name_max_253",
                Cnp,
                |v| v["metadata"]["name"] = json!("a".repeat(254)),
                vec![err(
                    "metadata.name",
                    inv(&"a".repeat(254), "must be no more than 253 characters"),
                )],
            ),
            row(
                "metadata_namespace_dropped_for_cluster_scoped",
                Anp,
                |v| v["metadata"]["namespace"] = json!("prod"),
                vec![warn(
                    "metadata.namespace",
                    inv(
                        "prod",
                        "this kind is cluster-scoped; the API server drops metadata.namespace",
                    ),
                )],
            ),
            row(
                "metadata_label_key_qualified_name",
                Anp,
                |v| v["metadata"]["labels"] = json!({"-x": "y"}),
                vec![err(
                    "metadata.labels[-x]",
                    inv(
                        "-x",
                        "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
                    ),
                )],
            ),
            row(
                "metadata_annotation_key_qualified_name",
                Np,
                |v| v["metadata"]["annotations"] = json!({"a/b/c": "y"}),
                vec![err(
                    "metadata.annotations[a/b/c]",
                    inv(
                        "a/b/c",
                        "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character, with an optional DNS subdomain prefix and '/'",
                    ),
                )],
            ),
            row(
                "metadata_annotations_total_256k",
                Np,
                |v| {
                    v["metadata"]["annotations"] = json!({"big": "x".repeat(MAX_ANNOTATIONS_BYTES)})
                },
                vec![err(
                    "metadata.annotations",
                    P::TooLong { len: MAX_ANNOTATIONS_BYTES + 3, max: MAX_ANNOTATIONS_BYTES },
                )],
            ),
        ]
    }

    #[test]
    fn each_rule_reports_exactly_its_problem() {
        check(rows());
    }

    #[test]
    fn qualified_names_and_label_values() {
        for ok in ["app", "app.kubernetes.io/name", "A_b.c-D", "example.com/X", "a"] {
            assert!(qualified_name_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["", "/a", "a/", "a/b/c", "-a", "a_", "Example.com/a", "a b", &"a".repeat(64)] {
            assert!(!qualified_name_errors(bad).is_empty(), "{bad}");
        }
        for ok in ["", "a", "a.b_c-d", &"a".repeat(63)] {
            assert!(label_value_errors(ok).is_empty(), "{ok}");
        }
        for bad in ["-", "a-", "a b", &"a".repeat(64)] {
            assert!(!label_value_errors(bad).is_empty(), "{bad}");
        }
    }

    proptest::proptest! {
        /// No input string makes a syntax helper panic (byte slicing, empty strings,
        /// multi-byte characters).
        #[test]
        fn syntax_helpers_never_panic(s in "\\PC{0,80}") {
            let _ = is_domain_name(&s);
            let _ = qualified_name_errors(&s);
            let _ = label_value_errors(&s);
            let _ = port_name_errors(&s);
            let _ = dns1123_label_errors(&s);
            let _ = dns1123_subdomain_errors(&s);
            let _ = parse_ip(&s);
        }
    }
}
