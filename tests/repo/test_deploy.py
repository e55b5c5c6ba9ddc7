"""deploy/: what `deploy/render.sh` writes is valid Kubernetes, runs real pdserve command lines
and scrapes real metrics; the image installs the project as the README does; and `pdserve
health`, the probes' command, tells a ready role from a dead or foreign one.

Built-in kinds are validated with kubernetes-validate (it bundles the API's JSON schemas, so
this runs offline); KEDA's ScaledObject is a custom resource it does not know, validated
against deploy/schemas/keda-scaledobject.schema.json instead.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.paths import REPO_ROOT

from pdserve import security
from pdserve.app.cli import COMMANDS, SECURED_ROLES

ROOT = REPO_ROOT
DEPLOY = ROOT / "deploy"
OVERLAYS = ("gpu", "cpu", "autoscale")
KUBERNETES_VERSION = "1.30.0"  # the oldest minor the manifests promise to work on
CUSTOM_SCHEMAS = {"ScaledObject": DEPLOY / "schemas" / "keda-scaledobject.schema.json"}
POD_FIELDS = {"metadata.name": "pool-abc12-xyz34", "metadata.namespace": "pdserve",
              "status.podIP": "10.1.2.3"}


# ---- rendering ------------------------------------------------------------------------------
def render(overlay: str, out: Path, key_path: Path) -> list[dict]:
    result = subprocess.run(
        ["bash", str(DEPLOY / "render.sh"), str(out), overlay], capture_output=True, text=True,
        timeout=120, env=dict(os.environ, CLUSTER_KEY_FILE=str(key_path),
                              PYTHON=sys.executable))
    assert result.returncode == 0, result.stderr
    return [yaml.safe_load(path.read_text()) for path in sorted(out.glob("*.yaml"))]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("deploy")
    key_path = tmp / "cluster.key"  # render.sh makes it (pdserve keygen) on the first render
    return {overlay: render(overlay, tmp / overlay, key_path) for overlay in OVERLAYS}


def find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [(f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"])
            for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def test_render_writes_the_default_deployment(rendered, tmp_path):
    objects = rendered["gpu"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Namespace", "pdserve"), ("StatefulSet", "etcd"), ("Service", "etcd"),
            ("StatefulSet", "store-master"), ("StatefulSet", "store-data"),
            ("Deployment", "prefill"), ("Deployment", "decode"), ("Deployment", "router"),
            ("Service", "router"), ("Secret", "pdserve-cluster-key"),
            ("ConfigMap", "pdserve-grafana-dashboard"),
            ("ConfigMap", "pdserve-prometheus")} <= kinds
    assert objects[0]["kind"] == "Namespace"  # files are in apply order
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "pdserve", obj["metadata"]["name"]
    for pool in ("prefill", "decode"):
        container = find(objects, "Deployment", pool)["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"] == "pdserve:0.1.0-cuda"
    # the SSD tier: the data node's --disk-dir is its own volume claim
    store = find(objects, "StatefulSet", "store-data")
    claim = store["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    container = store["spec"]["template"]["spec"]["containers"][0]
    disk_dir = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--disk-dir="))
    assert {"name": claim, "mountPath": disk_dir} in container["volumeMounts"]
    # the Secret holds a key the roles accept
    secret = find(objects, "Secret", "pdserve-cluster-key")
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(base64.b64decode(secret["data"]["cluster.key"]))
    security.ClusterKey.load(key_file)


def test_cpu_overlay_requests_no_gpu(rendered):
    text = yaml.safe_dump_all(rendered["cpu"])
    assert "nvidia.com/gpu" not in text
    for pool in ("prefill", "decode"):
        container = find(rendered["cpu"], "Deployment", pool)["spec"]["template"]["spec"][
            "containers"][0]
        assert "--device=cpu" in container["args"] and container["image"] == "pdserve:0.1.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_etcd_initial_cluster_names_every_member(rendered, overlay):
    etcd = find(rendered[overlay], "StatefulSet", "etcd")
    args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    initial = next(a.split("=", 1)[1] for a in args if a.startswith("--initial-cluster="))
    members = [entry.split("=")[0] for entry in initial.split(",")]
    assert members == [f"etcd-{i}" for i in range(etcd["spec"]["replicas"])]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_render_matches_kubectl_kustomize(rendered, overlay, tmp_path):
    """Where kubectl is at hand, its kustomize builds the same objects from the same folders
    (deploy/render.py is a stand-in for it, not a dialect)."""
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("cluster.key"))
    secret = find(rendered[overlay], "Secret", "pdserve-cluster-key")
    (copy / "base" / "cluster.key").write_bytes(base64.b64decode(secret["data"]["cluster.key"]))
    result = subprocess.run(["kubectl", "kustomize", str(copy / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

    def normalized(objects: list[dict]) -> dict:
        by_name = {}
        for obj in objects:
            if obj["kind"] == "Secret":  # kustomize wraps base64 at 76 columns
                obj = {**obj, "data": {k: "".join(v.split()) for k, v in obj["data"].items()}}
            by_name[(obj["kind"], obj["metadata"]["name"])] = obj
        return by_name

    kustomized = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert normalized(kustomized) == normalized(rendered[overlay])


# ---- schema validation ----------------------------------------------------------------------
def validate(obj: dict) -> None:
    if obj["kind"] in CUSTOM_SCHEMAS:
        schema = json.loads(CUSTOM_SCHEMAS[obj["kind"]].read_text())
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_against_the_kubernetes_schema(rendered, overlay):
    for obj in rendered[overlay]:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc}")


def test_validation_catches_a_broken_manifest(rendered):
    decode = find(rendered["gpu"], "Deployment", "decode")
    broken = json.loads(json.dumps(decode))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbee"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    scaled = json.loads(json.dumps(find(rendered["autoscale"], "ScaledObject", "decode")))
    del scaled["spec"]["triggers"][0]["metadata"]["query"]
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_scaled_objects_follow_the_controller_for_their_pool(rendered):
    objects = rendered["autoscale"]
    for pool in ("prefill", "decode"):
        scaled = find(objects, "ScaledObject", pool)
        target = scaled["spec"]["scaleTargetRef"]
        assert target["kind"] == "Deployment"
        find(objects, "Deployment", target["name"])
        query = scaled["spec"]["triggers"][0]["metadata"]["query"]
        assert query == f'max(pdserve:controller_needed_workers{{role="{pool}"}})'
    router = find(objects, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    assert "--controller=recommend" in router["args"]  # flip would fight the autoscaler


# ---- the command lines ----------------------------------------------------------------------
def role_parser(name: str) -> argparse.ArgumentParser:
    """The parser `pdserve NAME` builds (pdserve/app/cli.py), erroring instead of exiting."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"pdserve {name}", exit_on_error=False)
    module.add_arguments(parser)
    if name in SECURED_ROLES:
        parser.add_argument("--insecure-plaintext", action="store_true")
    parser.set_defaults(command=name)
    return parser


class BadCommandLine(ValueError):
    pass


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """Parse `pdserve ...` argv with the real parser, then build its config where the role
    has one (so values the config refuses fail too)."""
    if argv[0] != "pdserve" or argv[1] not in COMMANDS:
        raise BadCommandLine(f"not a pdserve command: {argv[:2]}")
    parser = role_parser(argv[1])
    try:
        args, unknown = parser.parse_known_args(argv[2:])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise BadCommandLine(f"{argv}: {exc}") from None
    if unknown:
        raise BadCommandLine(f"{argv}: unknown arguments {unknown}")
    module = importlib.import_module(COMMANDS[argv[1]][0])
    if hasattr(module, "config_from_args"):
        try:
            module.config_from_args(args)
        except ValueError as exc:
            raise BadCommandLine(f"{argv}: {exc}") from None
    return args


def container_env(container: dict, objects: list[dict]) -> dict[str, str]:
    """The variables Kubernetes expands $(NAME) from: envFrom ConfigMaps, then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            env[entry["name"]] = POD_FIELDS[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(argv: list[str], env: dict[str, str], where: str) -> list[str]:
    def value(match: re.Match) -> str:
        if match.group(1) not in env:  # Kubernetes would pass "$(NAME)" on, literally
            pytest.fail(f"{where}: $({match.group(1)}) is not defined in the container's env")
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg) for arg in argv]


def pdserve_command_lines(objects: list[dict]) -> list[tuple[str, list[str]]]:
    """Every pdserve command line in the pod specs: containers and exec probes."""
    lines = []
    for where, pod in pod_specs(objects):
        for container in pod["containers"]:
            env = container_env(container, objects)
            argv = container.get("command", []) + container.get("args", [])
            if argv and argv[0] == "pdserve":
                lines.append((where, expand(argv, env, where)))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container.get(probe, {}).get("exec", {}).get("command")
                if command:
                    assert command[0] == "pdserve", f"{where} {probe}: {command}"
                    lines.append((f"{where} {probe}", expand(command, env, where)))
    return lines


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pdserve_command_line_parses(rendered, overlay):
    lines = pdserve_command_lines(rendered[overlay])
    roles = {argv[1] for _, argv in lines}
    assert {"router", "prefill", "decode", "store", "health"} <= roles
    for where, argv in lines:
        try:
            args = parse_command_line(argv)
        except BadCommandLine as exc:
            pytest.fail(f"{overlay}: {where}: {exc}")
        if argv[1] != "health":  # with --discovery, every role needs no other address
            assert args.discovery == "etcd://etcd:2379", where
            for flag in ("prefill", "decode", "colocated", "store", "store_master",
                         "master_address"):
                assert not getattr(args, flag, None), f"{where}: --{flag} with discovery"


def test_the_command_line_check_refuses_an_unknown_flag():
    parse_command_line(["pdserve", "decode", "--model=/m", "--port=8100",
                        "--discovery=etcd://etcd:2379"])
    with pytest.raises(BadCommandLine, match="no-such-flag"):
        parse_command_line(["pdserve", "decode", "--model=/m", "--port=8100",
                            "--no-such-flag=1"])
    with pytest.raises(BadCommandLine):
        parse_command_line(["pdserve", "store", "--role=data", "--dram-blocks=0"])


# ---- the image --------------------------------------------------------------------------------
def test_dockerfile_installs_the_project_the_readme_way():
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"pip install torch==(\S+) && pip install -e '\.\[([a-z,]+)\]'", readme)
    assert install, "the README's install line changed: update deploy/Dockerfile with it"
    torch_version, readme_extras = install.group(1), set(install.group(2).split(","))
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", dockerfile).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    assert re.fullmatch(r"ARG PYTHON_IMAGE=python:3\.11-slim", instructions[0])
    assert instructions[1] == "FROM ${PYTHON_IMAGE}"
    assert f"ARG TORCH_VERSION={torch_version}" in instructions
    extras = next(i for i in instructions if i.startswith("ARG EXTRAS="))
    assert set(extras.split("=", 1)[1].split(",")) == readme_extras - {"test"}
    runs = [i for i in instructions if i.startswith("RUN ")]
    torch_run = next(k for k, r in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in r)
    project_run = next(k for k, r in enumerate(runs) if 'pip install ".[${EXTRAS}]"' in r)
    assert torch_run < project_run  # torch first, pinned, as the README says
    # the one folder pyproject.toml installs (the source tree is the package tree) is copied in
    assert 'include = ["pdserve*"]' in (ROOT / "pyproject.toml").read_text()
    assert "COPY pdserve ./pdserve" in instructions
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert "!pdserve/" in ignore


# ---- metrics the dashboard and the autoscaler read ------------------------------------------
def exported_metric_names() -> set[str]:
    """Series names the router's /metrics carries (pdserve/router/metrics.py): histograms and
    summaries as _bucket/_sum/_count, counters as _total."""
    source = (ROOT / "pdserve" / "router" / "metrics.py").read_text()
    names = set()
    for base in re.findall(r'"(pdserve:[a-z0-9_]+)"', source):
        base = base.removesuffix("_total")
        names |= {base, f"{base}_total", f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def test_dashboard_and_autoscaler_query_exported_metrics(rendered):
    dashboard_map = find(rendered["gpu"], "ConfigMap", "pdserve-grafana-dashboard")
    assert dashboard_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    dashboard = json.loads(dashboard_map["data"]["pdserve-dashboard.json"])
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [trigger["metadata"]["query"]
                for obj in rendered["autoscale"] if obj["kind"] == "ScaledObject"
                for trigger in obj["spec"]["triggers"]]
    used = {name for query in queries for name in re.findall(r"pdserve:[a-z0-9_]+", query)}
    assert {"pdserve:time_to_first_token_seconds_bucket",
            "pdserve:request_time_per_output_token_seconds_bucket",
            "pdserve:kv_cache_usage_perc", "pdserve:kv_transfer_bytes_total",
            "pdserve:controller_recommended_workers", "pdserve:controller_needed_workers"} <= used
    assert used <= exported_metric_names(), used - exported_metric_names()
    scrape = yaml.safe_load(find(rendered["gpu"], "ConfigMap", "pdserve-prometheus")["data"][
        "scrape.yaml"])
    router_pod = find(rendered["gpu"], "Deployment", "router")["spec"]["template"]
    assert scrape[0]["kubernetes_sd_configs"][0]["namespaces"]["names"] == ["pdserve"]
    assert router_pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


# ---- pdserve health ---------------------------------------------------------------------------
def health(*argv: str, key_path: Path | None = None, timeout_s: float = 60) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != security.KEY_FILE_ENV}
    if key_path is not None:
        env[security.KEY_FILE_ENV] = str(key_path)
    result = subprocess.run([sys.executable, "-m", "pdserve.app.cli", "health", *argv],
                            capture_output=True, text=True, timeout=timeout_s, env=env)
    output = (result.stdout + result.stderr).strip()
    assert len(output.splitlines()) == 1, output  # one line, never a traceback
    return result.returncode, output


@pytest.fixture(scope="module")
def roles(llama_dir, tmp_path_factory):
    """A real cluster, kept small for a probe test: the store, one colocated worker (the same
    worker process and status request as prefill and decode) and a router."""
    from helpers.cluster_util import NUM_BLOCKS, Roles

    cluster = Roles(llama_dir, tmp_path_factory.mktemp("health-logs"), num_decode=0)
    worker = f"tcp://127.0.0.1:{cluster.prefill_port}"
    try:
        cluster.start("store", "store", "--role", "all", "--master-port",
                      str(cluster.master_port), "--data-port", str(cluster.data_port),
                      "--transport", "zmq")
        cluster.start("colocated", "colocated", "--model", cluster.model_dir, "--port",
                      str(cluster.prefill_port), "--num-kv-blocks", str(NUM_BLOCKS),
                      "--worker-id", "colocated")
        cluster.start("router", "router", "--model", cluster.model_dir, "--port",
                      str(cluster.router_port), "--colocated", worker)
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def test_health_says_ready_for_every_role(roles):
    key = roles.key_path
    rc, line = health("worker", f"tcp://127.0.0.1:{roles.prefill_port}", key_path=key)
    assert rc == 0 and "ready: colocated (colocated" in line, line
    for port in (roles.master_port, roles.data_port):
        rc, line = health("store", f"tcp://127.0.0.1:{port}", key_path=key)
        assert rc == 0 and line.startswith(f"store at tcp://127.0.0.1:{port}: ready"), line
    rc, line = health("router", f"http://127.0.0.1:{roles.router_port}")
    assert rc == 0 and "HTTP 200" in line, line


def test_health_refuses_a_foreign_key_and_plaintext(roles, tmp_path):
    other = security.ClusterKey.generate().save(tmp_path / "other.key")
    address = f"tcp://127.0.0.1:{roles.prefill_port}"
    rc, line = health("worker", address, "--timeout-s", "3", key_path=other)
    assert rc == 1 and "cluster key" in line, line
    rc, line = health("worker", address, "--timeout-s", "3", "--insecure-plaintext")
    assert rc == 1 and ("cluster key" in line or "plaintext" in line), line
    # a worker port asked for the store's status: connected, but not that role's answer
    rc, line = health("store", address, "--timeout-s", "2", key_path=roles.key_path)
    assert rc == 1, line


def test_health_of_a_dead_address_fails_clearly(tmp_path):
    from helpers.cluster_util import free_port_block

    port = free_port_block(1)
    key = security.ClusterKey.generate().save(tmp_path / "cluster.key")
    rc, line = health("worker", f"tcp://127.0.0.1:{port}", "--timeout-s", "1", key_path=key)
    assert rc == 1 and "connection refused" in line and str(port) in line, line
    rc, line = health("router", f"http://127.0.0.1:{port}", "--timeout-s", "1")
    assert rc == 1 and "cannot connect" in line, line
    rc, line = health("store", "tcp://nowhere", key_path=key)
    assert rc == 2 and "tcp://HOST:PORT" in line, line
    rc, line = health("worker", f"tcp://127.0.0.1:{port}")  # no key, no --insecure-plaintext
    assert rc == 2 and security.KEY_FILE_ENV in line, line
