"""Render the kustomize directories under deploy/kubernetes/ and validate what they render.

Core kinds are checked with ``kubernetes-validate`` (the API's own OpenAPI schemas, strict: an
unknown field is an error, where the API server would drop it without a word). The
prometheus-operator kinds are checked against the operator's CRD schemas vendored under
tests/fixtures/prometheus_operator/, made just as strict: a structural CRD schema prunes unknown
fields on the server, so a misspelt ``groupBy`` would otherwise vanish at apply time.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from tests import support

KUSTOMIZE = support.REPO / "deploy" / "kubernetes"
TARGETS = {
    "base": KUSTOMIZE,
    "kube-prometheus-stack": KUSTOMIZE / "overlays" / "kube-prometheus-stack",
    "plain-prometheus": KUSTOMIZE / "overlays" / "plain-prometheus",
}
OPERATOR_GROUP = "monitoring.coreos.com"
OPERATOR_SCHEMAS = support.REPO / "tests" / "fixtures" / "prometheus_operator"
# The oldest Kubernetes minor most managed offerings still run, and a recent one.
KUBERNETES_VERSIONS = ("1.30", "1.34")


def render(path: Path) -> list[dict]:
    """What ``kubectl kustomize PATH`` renders; without kubectl skip locally, fail under CI."""
    kubectl = support.require_tool("kubectl")
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {path.relative_to(support.REPO)}:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _strict(node: Any) -> Any:
    """The schema with ``additionalProperties: false`` wherever it lists properties and keeps no
    unknown fields (what the server would prune, the test rejects)."""
    if isinstance(node, list):
        return [_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def operator_validator(kind: str) -> jsonschema.protocols.Validator:
    path = OPERATOR_SCHEMAS / f"{kind}.schema.yaml"
    assert path.is_file(), f"no vendored schema for {kind} (tests/fixtures/prometheus_operator/vendor.py)"
    schema = _strict(yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def problems(obj: dict) -> list[str]:
    """Why ``obj`` would be refused or changed by the API server (empty: it validates)."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("apiVersion", "").split("/")[0] == OPERATOR_GROUP:
        validator = operator_validator(obj["kind"])
        return [f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    out = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            out.append(f"{name} (Kubernetes {version}): {'/'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            out.append(f"{name}: no Kubernetes {version} schema ({exc})")
    return out
