#!/usr/bin/env python3
"""Validate Kubernetes manifests offline (run by tests/deploy_manifests.rs; see deploy/README.md).

Every YAML document of every file given (``-`` reads standard input) is checked:

- a built-in kind (DaemonSet, ClusterRole, ...) against the JSON schemas of each Kubernetes
  release named by ``--k8s-version`` (default: 1.31 and 1.37), in strict mode (unknown fields
  are errors), with the schemas the PyPI package ``kubernetes-validate`` bundles;
- a CustomResourceDefinition as a built-in kind, and its ``openAPIV3Schema`` against the
  rules of a structural schema that this script can check (every node has a ``type``, no
  ``$ref``/``nullable`` in a union, ``required`` names declared properties);
- an object of a kind one of the CRDs (``--crds DIR``, and any CRD in the input) defines,
  against that CRD's ``openAPIV3Schema``, with unknown fields as errors (the API server prunes
  them, and ``kubectl apply``'s default field validation rejects them), plus
  ``metadata.name`` and the CRD's scope.

Not checked: CEL rules (``x-kubernetes-validations``): no CEL evaluator with Kubernetes'
libraries (``isCIDR``) is at hand here; ``tierproxy check`` enforces the same rules for
AdminNetworkPolicy, BaselineAdminNetworkPolicy and ClusterNetworkPolicy. A document of a
kind with no schema (a Kustomization, say) is an error unless ``--skip-kind`` names it.

Exit status: 0 every document valid, 1 some document invalid, 2 bad usage, 3 a Python package
is missing.
Prints one line per problem, then a summary line.
"""

import argparse
import glob
import os
import re
import sys

try:
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:  # the Rust test turns this exit status into SKIPPED or a failure
    print(f"validate_manifests: missing Python package: {e.name} "
          "(pip install kubernetes-validate)", file=sys.stderr)
    sys.exit(3)

DEFAULT_VERSIONS = ["1.31", "1.37"]
# metadata.name of an object: a DNS-1123 subdomain (apimachinery IsDNS1123Subdomain).
SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def load_docs(path):
    """(path, index, document) for every non-empty YAML document in path."""
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    for i, doc in enumerate(yaml.safe_load_all(text)):
        if doc is not None:
            yield path, i, doc


def structural_problems(schema, where):
    """Problems that make an openAPIV3Schema non-structural (apiextensions
    `validateStructuralInvariants`, the subset that matters for generated schemas)."""
    out = []
    if not isinstance(schema, dict):
        return [f"{where}: not an object"]
    if "$ref" in schema:
        out.append(f"{where}: $ref is not allowed")
    special = schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields")
    if "type" not in schema and not special:
        out.append(f"{where}: no type")
    for key in ("anyOf", "oneOf", "allOf"):
        for j, sub in enumerate(schema.get(key, [])):
            for bad in ("type", "nullable", "default", "description"):
                if bad in sub:
                    out.append(f"{where}.{key}[{j}]: {bad} is not allowed inside {key}")
    props = schema.get("properties", {})
    for name in schema.get("required", []):
        if name not in props:
            out.append(f"{where}: required {name!r} is not a property")
    for name, sub in props.items():
        out.extend(structural_problems(sub, f"{where}.{name}"))
    if isinstance(schema.get("items"), dict):
        out.extend(structural_problems(schema["items"], f"{where}[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        out.extend(structural_problems(schema["additionalProperties"], f"{where}{{}}"))
    return out


def to_json_schema(schema):
    """A Draft 4 JSON schema from an OpenAPI v3 structural schema: `nullable` becomes a null
    type, int-or-string becomes a union, and objects with properties refuse others unless
    they preserve unknown fields. x-kubernetes-* keys are left for the validator to ignore."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "oneOf", "allOf"):
            out[key] = [to_json_schema(v) for v in value]
        elif key in ("nullable", "format") or key.startswith("x-kubernetes-"):
            # format: Kubernetes ignores unknown formats and checks only a few; leave it.
            continue
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_index(docs):
    """{(group, version, kind): (json schema, scope)} of every CRD in docs."""
    index = {}
    for _, _, doc in docs:
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        spec = doc.get("spec", {})
        for v in spec.get("versions", []):
            schema = (v.get("schema") or {}).get("openAPIV3Schema")
            if schema is None:
                continue
            schema = to_json_schema(schema)
            # The API server validates metadata itself; the CRD schema leaves it open.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            schema["properties"].setdefault("apiVersion", {"type": "string"})
            schema["properties"].setdefault("kind", {"type": "string"})
            index[(spec.get("group"), v.get("name"), spec.get("names", {}).get("kind"))] = (
                schema, spec.get("scope"))
    return index


def describe(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name', '?')}"


def path_of(error):
    return ".".join(str(p) for p in error.absolute_path) or "(root)"


def check_custom(doc, schema, scope):
    problems = []
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not SUBDOMAIN.match(name) or len(name) > 253:
        problems.append(f"metadata.name {name!r} is not a DNS-1123 subdomain")
    if scope == "Cluster" and "namespace" in meta:
        problems.append("metadata.namespace is set on a cluster-scoped kind")
    validator = jsonschema.Draft4Validator(schema)
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        problems.append(f"{path_of(e)}: {e.message}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="YAML files, directories (*.yaml) or - (stdin)")
    ap.add_argument("--crds", action="append", default=[],
                    help="a directory or file of CRDs whose kinds objects may have")
    ap.add_argument("--k8s-version", action="append", dest="versions",
                    help=f"Kubernetes release(s) to validate against (default {DEFAULT_VERSIONS})")
    ap.add_argument("--skip-kind", action="append", default=[],
                    help="apiVersion/kind to skip, e.g. kustomize.config.k8s.io/v1beta1/Kustomization")
    ap.add_argument("--only-kind", action="append", default=[],
                    help="validate only documents of these kinds (others are counted as skipped)")
    args = ap.parse_args()
    versions = args.versions or DEFAULT_VERSIONS

    def expand(paths):
        for p in paths:
            if os.path.isdir(p):
                yield from sorted(glob.glob(os.path.join(p, "*.yaml")))
            else:
                yield p

    crd_docs = [d for p in expand(args.crds) for d in load_docs(p)]
    docs = [d for p in expand(args.files) for d in load_docs(p)]
    crds = crd_index(crd_docs + docs)

    problems, checked, skipped = [], {}, 0
    for path, i, doc in docs:
        where = f"{path}: document {i} ({describe(doc)})"
        if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
            problems.append(f"{where}: not a Kubernetes object (no apiVersion/kind)")
            continue
        api_version, kind = doc["apiVersion"], doc["kind"]
        if f"{api_version}/{kind}" in args.skip_kind or (args.only_kind and kind not in args.only_kind):
            skipped += 1
            continue
        group, _, version = api_version.rpartition("/")
        if (group, version, kind) in crds:
            schema, scope = crds[(group, version, kind)]
            problems.extend(f"{where}: {p}" for p in check_custom(doc, schema, scope))
            checked[kind] = checked.get(kind, 0) + 1
            continue
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where}: Kubernetes {v}: {path_of(e)}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                problems.append(f"{where}: {e.message}")
                break
        if kind == "CustomResourceDefinition":
            for v in doc.get("spec", {}).get("versions", []):
                schema = (v.get("schema") or {}).get("openAPIV3Schema")
                if schema is None:
                    problems.append(f"{where}: version {v.get('name')} has no openAPIV3Schema")
                    continue
                problems.extend(f"{where}: not structural: {p}"
                                for p in structural_problems(schema, "openAPIV3Schema"))
        checked[kind] = checked.get(kind, 0) + 1

    for p in problems:
        print(p)
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(checked.items()))
    print(f"validate_manifests: {sum(checked.values())} objects checked ({kinds}), "
          f"{skipped} skipped, {len(problems)} problems; Kubernetes {', '.join(versions)} "
          f"(kubernetes-validate {kubernetes_validate.__version__}), {len(crds)} CRD kinds")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
