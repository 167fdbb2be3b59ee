"""``kubectl kustomize`` renders the base and each overlay, and every object validates."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import yaml

from alerts import generate
from tests import support
from tests.deploy.manifests import OPERATOR_GROUP, TARGETS, problems, render

# What each rendering must hold, by kind (at least this many).
REQUIRED = {
    "base": {"Deployment": 2, "Service": 2, "ServiceMonitor": 1, "PrometheusRule": 1, "ConfigMap": 4,
             "Secret": 1, "ServiceAccount": 1, "Role": 1, "RoleBinding": 1, "NetworkPolicy": 2},
    "kube-prometheus-stack": {"Deployment": 2, "Service": 2, "ServiceMonitor": 1, "PrometheusRule": 1,
                              "ConfigMap": 4, "AlertmanagerConfig": 1, "ServiceAccount": 1, "Role": 1,
                              "RoleBinding": 1, "NetworkPolicy": 2},
    "plain-prometheus": {"Deployment": 2, "Service": 2, "ConfigMap": 5, "Secret": 1, "ServiceAccount": 1,
                         "Role": 1, "RoleBinding": 1, "NetworkPolicy": 2},
}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param, render(TARGETS[request.param])


def _one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name)]
    assert len(found) == 1, f"{kind}/{name}*: {len(found)} found"
    return found[0]


def test_renders_the_expected_objects(rendered: tuple[str, list[dict]]) -> None:
    target, objs = rendered
    kinds = Counter(o["kind"] for o in objs)
    short = {k: (n, kinds[k]) for k, n in REQUIRED[target].items() if kinds[k] < n}
    assert not short, f"{target}: kind: (wanted, rendered) {short}"
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), f"{target}: duplicate objects"


def test_every_object_validates(rendered: tuple[str, list[dict]]) -> None:
    target, objs = rendered
    found = [p for o in objs for p in problems(o)]
    assert not found, f"{target}:\n" + "\n".join(found)


def test_plain_prometheus_needs_no_operator() -> None:
    objs = render(TARGETS["plain-prometheus"])
    assert not [o["kind"] for o in objs if o["apiVersion"].startswith(OPERATOR_GROUP)]
    service = _one(objs, "Service", "prefixscope-exporter")
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9400"
    rules = _one(objs, "ConfigMap", "prefixscope-rules")["data"]["prefixscope.rules.yaml"]
    committed = (support.REPO / "alerts" / "generated" / generate.RULES_FILE).read_text(encoding="utf-8")
    assert yaml.safe_load(rules) == yaml.safe_load(committed)


def test_kube_prometheus_stack_objects_carry_the_release_label() -> None:
    objs = render(TARGETS["kube-prometheus-stack"])
    operator = [o for o in objs if o["apiVersion"].startswith(OPERATOR_GROUP)]
    assert {o["kind"] for o in operator} == {"ServiceMonitor", "PrometheusRule", "AlertmanagerConfig"}
    assert all(o["metadata"]["labels"]["release"] == "kube-prometheus-stack" for o in operator)
    # One path for the Alertmanager configuration: the AlertmanagerConfig, not also the Secret.
    assert not [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "prefixscope-alertmanager"]


def test_exporter_deployment_wiring(rendered: tuple[str, list[dict]]) -> None:
    _, objs = rendered
    deployment = _one(objs, "Deployment", "prefixscope-exporter")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["prefixscope"] and container["args"][0] == "export"
    config_arg = next(a for a in container["args"] if a.startswith("--config.file="))
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert {"requests", "limits"} <= set(container["resources"])
    # The config file the args name is the generated ConfigMap's key, mounted where they say.
    mount = next(m for m in container["volumeMounts"] if config_arg.removeprefix("--config.file=").startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = _one(objs, "ConfigMap", "prefixscope-exporter-config")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert config_arg.rsplit("/", 1)[1] in config_map["data"]
    config = yaml.safe_load(config_map["data"]["exporter.yaml"])
    # Listening beyond loopback the exporter refuses to start without the intake's token.
    token_file = config["records"]["http"]["bearer_token_file"]
    token_mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    assert next(v for v in pod["volumes"] if v["name"] == token_mount["name"])["secret"]["secretName"]
    assert pod["serviceAccountName"] == "prefixscope"
    service = _one(objs, "Service", "prefixscope-exporter")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_service_monitor_selects_the_exporter_service() -> None:
    objs = render(TARGETS["base"])
    monitor = _one(objs, "ServiceMonitor", "prefixscope-exporter")
    service = _one(objs, "Service", "prefixscope-exporter")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_dashboards_are_the_generated_json_labelled_for_the_sidecar() -> None:
    objs = render(TARGETS["base"])
    boards = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    committed = sorted((support.REPO / "dashboards" / "generated").glob("*.json"))
    assert len(boards) == len(committed)
    data = {k: v for o in boards for k, v in o["data"].items()}
    for path in committed:
        assert json.loads(data[f"prefixscope-{path.name}"]) == json.loads(path.read_text(encoding="utf-8"))


def test_prometheusrule_is_the_generated_one() -> None:
    objs = render(TARGETS["base"])
    rule = _one(objs, "PrometheusRule", "prefixscope")
    committed = yaml.safe_load((support.REPO / "alerts" / "generated" / "prefixscope.prometheusrule.yaml").read_text())
    assert rule["spec"] == committed["spec"]


def test_generate_writes_the_kubernetes_files() -> None:
    """The catalogue's copies under deploy/ are part of ``prefixscope generate`` (and its --check)."""
    from prefixscope import thresholds

    files = generate.build(thresholds.load(thresholds.DEFAULT_PATH, runbooks_dir=thresholds.RUNBOOKS_DIR))
    deploy = {p for p in files if p.is_relative_to(support.REPO / "deploy")}
    assert len(deploy) == 5
    stale = [str(p.relative_to(support.REPO)) for p in deploy if p.read_text(encoding="utf-8") != files[p]]
    assert not stale, f"run `prefixscope generate`: {stale}"


def test_an_overlay_of_ones_own_sets_image_and_config(tmp_path: Path) -> None:
    """The overlay docs/operating.md has users write on top of kube-prometheus-stack's."""
    mine = tmp_path / "my-prefixscope"
    mine.mkdir()
    (mine / "exporter.yaml").write_text("workers: []\n# mine\n", encoding="utf-8")
    overlay = os.path.relpath(TARGETS["kube-prometheus-stack"], mine)
    (mine / "kustomization.yaml").write_text(
        f"resources: [{overlay}]\n"
        "images: [{name: prefixscope, newName: registry.example.com/prefixscope, newTag: 0.1.0}]\n"
        "configMapGenerator: [{name: prefixscope-exporter-config, behavior: replace, files: [exporter.yaml]}]\n",
        encoding="utf-8")
    objs = render(mine)
    images = {c["image"] for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com/prefixscope:0.1.0"}
    config = _one(objs, "ConfigMap", "prefixscope-exporter-config")
    assert "# mine" in config["data"]["exporter.yaml"]
    volumes = _one(objs, "Deployment", "prefixscope-exporter")["spec"]["template"]["spec"]["volumes"]
    assert config["metadata"]["name"] in {v.get("configMap", {}).get("name") for v in volumes}
