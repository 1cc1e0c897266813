"""The deployment files lint, validate against the Kubernetes schemas, and agree with the code.

No Docker engine or cluster runs here: the Dockerfiles are parsed (dockerfile-parse), the
manifests are rendered with ``kubectl kustomize`` when kubectl is installed and validated with
``kubernetes-validate`` (the API's OpenAPI schemas, strict: unknown fields fail), and the shutdown
timings are checked against the settings they must cover.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import psutil
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from yamllint import linter
from yamllint.config import YamlLintConfig

from catalog.models import Pool
from tests import procs, rkeys
from tests.factories import make_key, make_model, make_tenant

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"  # the oldest release still supported by the big clouds
LINT = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 110}\n"
                      "  document-start: disable\n  truthy: {check-keys: false}\n")
ROLES = {"gateway", "worker", "housekeeping", "beat", "migrate"}


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def manifests() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in docs(p)]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def config() -> dict[str, str]:
    return by_kind("ConfigMap")["inference-gateway-config"]["data"]


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: p.name)
def test_yaml_lints(path: Path) -> None:
    problems = [f"{p.line}: {p.message}" for p in linter.run(path.read_text(), LINT)]
    assert not problems, problems


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_schema_check_rejects_a_bad_manifest() -> None:
    bad = {**by_kind("Deployment")["gateway"]}
    bad["spec"] = {**bad["spec"], "replicas": "two"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.integration
def test_kustomize_renders_valid_manifests() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    rendered = [d for d in yaml.safe_load_all(out) if d]
    assert len(rendered) == len(manifests())
    for doc in rendered:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["namespace"] == "inference-gateway"
    images = {c["image"] for d in rendered if d["kind"] in ("Deployment", "Job")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images and all(i.startswith("registry.example.com/") for i in images), images


CELL_OVERLAYS = sorted(p.parent for p in (DEPLOY / "cells").glob("*/kustomization.yaml"))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", CELL_OVERLAYS, ids=lambda p: p.name)
@pytest.mark.integration
def test_each_cell_overlay_renders_the_base_with_its_cell(overlay: Path) -> None:
    """docs/adr/0019: one overlay per regional cell; every object carries the cell, the shared
    config names it (CELL), and the probes' Host stays allowed."""
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    rendered = [d for d in yaml.safe_load_all(out) if d]
    assert len(rendered) == len(manifests())
    for doc in rendered:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"]["labels"]["inference-gateway/cell"] == overlay.name
    (cfg,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    assert cfg["data"]["CELL"] == overlay.name
    gateway = next(d for d in rendered if d["kind"] == "Deployment"
                   and d["metadata"]["name"] == "gateway")
    probe = gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    host = {h["name"]: h["value"] for h in probe["httpGet"]["httpHeaders"]}["Host"]
    assert host in cfg["data"]["ALLOWED_HOSTS"].split(",")


def test_there_are_cell_overlays_and_cells_stay_out_of_the_config() -> None:
    assert len(CELL_OVERLAYS) >= 2
    # CELLS holds every cell's Redis URL (with its password): the Secret's, never the config's.
    assert "CELLS" not in config()


def pod(name: str, kind: str = "Deployment") -> dict[str, Any]:
    return by_kind(kind)[name]["spec"]["template"]["spec"]


def test_gateway_probes_autoscaler_and_drain() -> None:
    spec = pod("gateway")
    (c,) = spec["containers"]
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"]["path"] == "/healthz"
        host = {h["name"]: h["value"] for h in probe["httpGet"]["httpHeaders"]}["Host"]
        assert host in config()["ALLOWED_HOSTS"].split(",")  # else Django answers 400
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = float(config()["GATEWAY_SHUTDOWN_SECONDS"])
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + grace + 5
    hpa = by_kind("HorizontalPodAutoscaler")["gateway"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "gateway"}
    assert hpa["minReplicas"] >= 2


def test_one_worker_per_gpu_with_a_drain_long_enough() -> None:
    workers = {n: d for n, d in by_kind("Deployment").items()
               if d["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "worker"}
    assert workers
    for name in workers:
        spec = pod(name)
        (c,) = spec["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert spec["terminationGracePeriodSeconds"] >= float(config()["WORKER_DRAIN_SECONDS"]) + 10
        assert {"name": "ENGINE_POOL", "value": workers[name]["metadata"]["labels"][
            "inference-gateway/pool"]} in c["env"]


def test_every_pod_runs_unprivileged_with_secrets_from_a_secret() -> None:
    for kind in ("Deployment", "Job"):
        for name in by_kind(kind):
            spec = pod(name, kind)
            assert spec["securityContext"]["runAsNonRoot"] is True
            for c in spec["containers"]:
                assert c["args"][0] in ROLES
                refs = [r for src in c["envFrom"] for r in src.values()]
                assert {"name": "inference-gateway-secrets"} in refs
                assert not any(e["name"] in ("SECRET_KEY", "DATABASE_URL", "REDIS_URL")
                               for e in c.get("env", []))  # secrets never inline


def test_each_disruption_budget_selects_a_deployment() -> None:
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in by_kind("Deployment").values()]
    for name, pdb in by_kind("PodDisruptionBudget").items():
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= lab.items() for lab in labels), name


def parse(path: Path) -> DockerfileParser:
    with path.open("rb") as f:  # a path not named "Dockerfile" would be taken for a directory
        parsed = DockerfileParser(fileobj=io.BytesIO(f.read()))
    return parsed


def test_dockerfiles() -> None:
    app = parse(DEPLOY / "Dockerfile")
    assert app.baseimage == "python:3.11-slim"
    vllm = parse(DEPLOY / "Dockerfile.vllm")
    assert vllm.baseimage.startswith("vllm/vllm-openai:")
    match = re.search(r"^ARG VLLM_VERSION=v(\S+)$", vllm.content, re.M)  # an ARG before FROM
    assert match is not None
    version = match.group(1)
    assert f'"vllm=={version}"' in (ROOT / "pyproject.toml").read_text()  # same vLLM everywhere
    for parsed in (app, vllm):
        instructions = parsed.structure
        users = [i["value"] for i in instructions if i["instruction"] == "USER"]
        assert users and not users[-1].startswith(("0", "root")), users
        assert any(i["instruction"] == "RUN" and "pip install" in i["value"]
                   for i in instructions)
        for i in instructions:
            if i["instruction"] == "COPY":
                for src in i["value"].split()[:-1]:
                    assert (ROOT / src).exists(), src
        assert '"/app/deploy/entrypoint.sh"' in "".join(
            i["value"] for i in instructions if i["instruction"] == "ENTRYPOINT")


@pytest.mark.integration
def test_entrypoint_knows_every_role_used() -> None:
    script = DEPLOY / "entrypoint.sh"
    assert script.stat().st_mode & 0o111
    subprocess.run(["sh", "-n", str(script)], check=True)
    text = script.read_text()
    assert all(f"  {role})" in text for role in ROLES)
    compose = docs(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    assert {"postgres", "redis", "gateway-1", "gateway-2", "worker", "beat"} <= services.keys()
    for name, svc in services.items():
        if "command" in svc and name not in ("postgres", "redis"):
            assert svc["command"][0] in ROLES, name


@pytest.mark.integration
def test_entrypoint_rejects_a_worker_without_a_pool() -> None:
    done = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "worker"], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "pool" in done.stderr


@pytest.mark.integration
def test_the_image_starts_uvicorn_with_the_one_command_line(tmp_path: Path) -> None:
    """Review 3: the entrypoint lacked --no-proxy-headers. The command line is built in one place
    (infra.uvicorn_command) and the entrypoint's gateway role goes through it."""
    from infra.uvicorn_command import uvicorn_argv

    stub = tmp_path / "python3"  # the image's python, replaced by one that shows its arguments
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    done = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "gateway", "--log-level", "info"],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "PORT": "8123"})
    args = done.stdout.split()
    assert args[:2] == ["-m", "infra.uvicorn_command"], done.stdout + done.stderr
    command = uvicorn_argv("python3", args[2:])
    assert command[:4] == ["python3", "-m", "uvicorn", "gateway.asgi:application"]
    assert "--no-proxy-headers" in command and "--proxy-headers" not in command
    assert command[command.index("--port") + 1] == "8123"
    assert "gateway.httpproto:BoundedHttpToolsProtocol" in command
    # Nowhere else writes a uvicorn command line for the gateway.
    starts = re.compile(r"""-m["', ]+uvicorn""")
    writers = [p.relative_to(ROOT).as_posix() for d in ("deploy", "gateway", "workers", "tests",
                                                        "scripts", "infra")
               for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", "")
               and p.is_file() and p.name != "test_deploy.py"
               and starts.search(p.read_text(errors="ignore"))]
    assert writers == ["infra/uvicorn_command.py"], writers


# -- the entrypoint's roles, started here as the image starts them (no Docker needed) ---------


def entry(role: str, *args: str, env: dict[str, str]) -> procs.Proc:
    # The image's python3 is the one with the project installed: here, this virtualenv's.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return procs.Proc(f"entry-{role}", ["sh", str(DEPLOY / "entrypoint.sh"), role, *args],
                      procs.child_env({**env, "PATH": path}))


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_entrypoint_starts_a_gateway_and_a_worker_that_serve(redis_client) -> None:
    Pool.objects.create(name="entry-pool", model=make_model("sim-entry"), max_sequences=4)
    _, plain = make_key(make_tenant())
    port = procs.free_port()
    env = {"PORT": str(port), "GATEWAY_SHUTDOWN_SECONDS": "2", "LOG_LEVEL": "WARNING"}
    gw = entry("gateway", env=env)
    worker = entry("worker", "entry-pool", env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_for_http(url + "/healthz", gw)
        procs.wait_until(lambda: redis_client.zcard(rkeys.workers_key("entry-pool")) > 0, 60,
                         "the worker to register", worker)
        # exec: the signalled process is the server itself, not a shell that would swallow it.
        assert "uvicorn" in " ".join(psutil.Process(gw.pid).cmdline())
        assert "--no-proxy-headers" in psutil.Process(gw.pid).cmdline()
        assert "celery" in " ".join(psutil.Process(worker.pid).cmdline())
        answer = httpx.post(url + "/v1/chat/completions", timeout=30,
                            headers={"Authorization": f"Bearer {plain}"},
                            json={"model": "sim-entry", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 200, answer.text
        # A graceful stop within GATEWAY_SHUTDOWN_SECONDS (uvicorn re-raises the SIGTERM it
        # handled, so the status is -15 or 0 depending on its version), not a SIGKILL.
        assert gw.terminate(timeout=10) in (0, -15), gw.logs()[-2000:]
        assert "Finished server process" in gw.logs()
    finally:
        for p in (gw, worker):
            p.stop()
