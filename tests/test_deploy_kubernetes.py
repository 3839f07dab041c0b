"""deploy/kubernetes: every manifest is valid against Kubernetes' own schemas (kubernetes-validate,
which bundles them: no network), and the pieces agree with each other and with the server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from opentgi.cli import build_parser, settings_from
from opentgi.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for p in MANIFESTS for d in _docs(p)}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_kubernetes(path):
    import kubernetes_validate

    for doc in _docs(path):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_validator_rejects_a_broken_manifest():
    import kubernetes_validate

    broken = _docs(DEPLOY / "deployment.yaml")[0]
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_service_probes_and_hpa_fit_the_deployment():
    docs = _all()
    deployment = docs[("Deployment", "opentgi")]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    labels = pod["metadata"]["labels"]
    service = docs[("Service", "opentgi")]
    assert service["spec"]["selector"].items() <= labels.items()
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    env = _env(container)
    assert port_names["http"] == int(env["PORT"]) == int(pod["metadata"]["annotations"]["prometheus.io/port"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    # the settings the pod's environment gives the server
    settings = settings_from(build_parser().parse_args(["serve"]), {k: v for k, v in env.items() if v})
    assert (settings.hostname, settings.port, settings.num_shard) == ("0.0.0.0", 8080, 1)
    hpa = docs[("HorizontalPodAutoscaler", "opentgi")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "opentgi"}
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "tgi_queue_size"
    assert re.search(rf"^{metric} ", Metrics().render()[0].decode(), re.M)  # the server exports it
    rules = yaml.safe_load(docs[("ConfigMap", "prometheus-adapter")]["data"]["config.yaml"])["rules"]
    assert any(metric in r["seriesQuery"] and r["name"]["as"] == metric for r in rules)


def test_multi_node_recipe_is_one_env_rendezvous():
    docs = _all()
    leader = docs[("StatefulSet", "opentgi-tp-leader")]
    workers = docs[("StatefulSet", "opentgi-tp-worker")]
    lead_env = _env(leader["spec"]["template"]["spec"]["containers"][0])
    work = workers["spec"]["template"]["spec"]["containers"][0]
    work_env = _env(work)
    world = int(lead_env["WORLD_SIZE"])
    assert world == int(work_env["WORLD_SIZE"]) == 1 + workers["spec"]["replicas"]
    assert lead_env["MASTER_ADDR"] == work_env["MASTER_ADDR"] == "opentgi-tp-leader"
    assert lead_env["MASTER_PORT"] == work_env["MASTER_PORT"]
    rendezvous = docs[("Service", "opentgi-tp-leader")]
    assert rendezvous["spec"]["ports"][0]["port"] == int(lead_env["MASTER_PORT"])
    assert rendezvous["spec"]["selector"].items() <= leader["spec"]["template"]["metadata"]["labels"].items()
    assert "RANK=$((POD_INDEX + 1))" in work["command"][-1]
    parse = build_parser().parse_args(["serve"])
    rank0 = settings_from(parse, {k: v for k, v in lead_env.items() if v})
    rank1 = settings_from(parse, {**{k: v for k, v in work_env.items() if v and k != "POD_INDEX"}, "RANK": "1"})
    assert (rank0.num_shard, rank0.shard_rank, rank1.num_shard, rank1.shard_rank) == (world, 0, world, 1)
    assert (rank1.master_addr, rank1.master_port) == ("opentgi-tp-leader", 29500)
