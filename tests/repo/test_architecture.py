"""The floors of docs/architecture.md, checked: every import in every module (lazy ones
inside functions included) points down, never up or sideways where the picture has no arrow.

    app (pdserve/app: cli, launcher, health)          the top: imports anything, imported by none
      │
      ├──► router ──► planner (simulator) ──┐         benchmarks: HTTP, except the offline
      │      └──► kvstore                   │           engine/store/kernel micro-benchmarks
      ├──► serve ──► kernels, kvstore       │
      ▼                                     ▼
    base (pdserve/: protocol, security, discovery, envs, ports, lifecycle)   imports none above
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
FOLDERS = {  # repository folder -> the package its modules import as
    "pdserve": "pdserve",
    "benchmarks": "benchmarks",  # the studies: run from the repository, not installed
}
APP = "pdserve.app"
PARTS = ("pdserve.serve", "pdserve.router", "pdserve.kvstore", "pdserve.kernels",
         "pdserve.planner", "pdserve.benchmarks", "pdserve.integrations", "benchmarks", APP)
BASE_MODULES = ("pdserve.protocol", "pdserve.security", "pdserve.discovery", "pdserve.etcd",
                "pdserve.addresses",
                "pdserve.envs", "pdserve.ports", "pdserve.lifecycle", "pdserve.structured_grammar",
                "pdserve.tokenizer")


def _but(*allowed: str) -> tuple[str, ...]:
    return tuple(part for part in PARTS if part not in allowed)


# module prefix -> the pdserve packages it must never import (the app is in every list)
FORBIDDEN = {
    **{base: PARTS for base in BASE_MODULES},
    "pdserve.kernels": _but("pdserve.kernels") + BASE_MODULES,
    "pdserve.kvstore": _but("pdserve.kvstore"),
    "pdserve.planner": _but("pdserve.planner"),
    "pdserve.router": _but("pdserve.router", "pdserve.kvstore", "pdserve.planner"),
    "pdserve.serve": _but("pdserve.serve", "pdserve.kernels", "pdserve.kvstore"),
    "pdserve.benchmarks": _but("pdserve.benchmarks"),
    "benchmarks": _but("benchmarks", "pdserve.benchmarks"),
    "pdserve.integrations": _but("pdserve.integrations", "pdserve.kvstore"),
    # the hand-off subsystem: the base and the store below it, never the engine or above
    "pdserve.handoff": ("pdserve.serve", "pdserve.router", "pdserve.planner",
                        "pdserve.benchmarks", "benchmarks", "pdserve.integrations", APP),
}
# The protocol package imports nothing of pdserve's (it is the floor's floor).
FORBIDDEN["pdserve.protocol"] = PARTS + tuple(b for b in BASE_MODULES if b != "pdserve.protocol")

# Benchmarks that measure a component in-process rather than a server over HTTP.
OFFLINE_BENCHMARKS = {
    # offline engine or model runner: tok/s, PP 1 vs 2, MTP on/off, CP 1 vs 2, step vs floor
    "benchmarks.engine_throughput": ("pdserve.serve",),
    "benchmarks.pp_bubble": ("pdserve.serve",),
    "benchmarks.mtp_decode": ("pdserve.serve",),
    "benchmarks.cp_prefill": ("pdserve.serve",),
    "benchmarks.step_roofline": ("pdserve.serve",),
    "benchmarks.weight_pages": ("pdserve.serve",),
    "benchmarks.decode_warmup": ("pdserve.serve",),
    "benchmarks.structured_cost": ("pdserve.serve",),
    # offline engine + store
    "benchmarks.fp8_kv": ("pdserve.serve", "pdserve.kvstore"),
    # the store's tiers, put/get over data nodes, the UCX data plane
    "benchmarks.store_replay": ("pdserve.kvstore",),
    "benchmarks.store_sharded": ("pdserve.kvstore",),
    "benchmarks.kv_transfer": ("pdserve.kvstore",),
    "benchmarks.kernels.bench_attention": ("pdserve.kernels",),
    # runs the router's own goodput simulator on what the router's /status published
    "benchmarks.controller_check": ("pdserve.planner.goodput_model",),
    # starts its clusters with `pdserve up`'s launcher; times an offline prefill for reference
    "benchmarks.ttft_breakdown": ("pdserve.app", "pdserve.serve"),
    # the offline planner's commands: `pdserve plan` reads traces and draws with the harness's
    # helpers, `pdserve profile` times the engine itself
    "pdserve.planner.plan": ("pdserve.benchmarks",),
    "benchmarks.plan_check": ("pdserve.planner",),
    "pdserve.planner.profile": ("pdserve.serve", "pdserve.kvstore.connector",
                                "pdserve.benchmarks.plots", "pdserve.benchmarks"),
    # benchmarks/gpu/run.sh's served stage builds its random ~1B Llama as the default model is
    "benchmarks.gpu.served": ("pdserve.serve.default_model",),
    # the GPU script's decode step: each engine's offline LLM, pdserve's and vLLM's
    "benchmarks.gpu.decode_step": ("pdserve.serve",),
    # a fleet of role processes under SIGKILLs, supervised as the launcher supervises (spawn,
    # standbys): its leak check reads the store's own counters, and the offline engine gives the
    # greedy streams' reference text
    "benchmarks.chaos_soak": ("pdserve.kvstore", "pdserve.serve", "pdserve.app.launcher"),
    # the offline studies' shared model is built with the default model's builder
    "pdserve.benchmarks.offline": ("pdserve.serve.default_model",),
    # arithmetic only: the communication model of a layout (no engine runs)
    "benchmarks.comm_table": ("pdserve.serve.executor.comm_model",
                                                  "pdserve.serve.default_model"),
}
# The protocol package depends on nothing but the standard library and msgpack.
PROTOCOL_THIRD_PARTY = {"msgpack"}


def _modules() -> list[tuple[str, Path]]:
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found.append((".".join((package, *parts)), path))
    return found


def _imports(module: str, path: Path) -> set[str]:
    """Every absolute module name `path` imports, at any depth of the file."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]  # a plain module's package is its parent
                prefix = ".".join(package[:len(package) - node.level + 1])
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def wrong_way_arrows() -> list[str]:
    problems = []
    for module, path in _modules():
        rules = [banned for owner, banned in FORBIDDEN.items() if _matches(module, owner)]
        allowed = OFFLINE_BENCHMARKS.get(module, ())
        for name in sorted(_imports(module, path)):
            for banned in (b for rule in rules for b in rule):
                if _matches(name, banned) and not any(_matches(name, a) for a in allowed):
                    problems.append(f"{module} imports {name}")
            if _matches(module, "pdserve.protocol") and "." not in name.strip(".") and \
                    name not in PROTOCOL_THIRD_PARTY and name not in _stdlib():
                problems.append(f"{module} imports third-party {name}")
    return sorted(set(problems))


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}


def test_every_import_points_the_right_way():
    assert wrong_way_arrows() == []


def test_the_checker_sees_a_wrong_way_arrow(tmp_path, monkeypatch):
    """The walk must find an arrow hidden in a function body (a lazy import)."""
    fake = tmp_path / "router"
    fake.mkdir()
    (fake / "sneaky.py").write_text(
        "def f():\n    from pdserve.serve.engine.engine import Engine\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.FOLDERS", {"router": "pdserve.router"})
    assert "pdserve.router.sneaky imports pdserve.serve.engine.engine" in wrong_way_arrows()


def test_the_checker_sees_the_top_imported_and_the_base_reaching_up(tmp_path, monkeypatch):
    """The app (cli, launcher, health) is imported by nothing; the base imports no part."""
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "uses_launcher.py").write_text("from pdserve.app import launcher\n")
    (tmp_path / "pdserve").mkdir()
    (tmp_path / "pdserve" / "envs.py").write_text("import pdserve.kvstore.client\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    monkeypatch.setattr(f"{__name__}.FOLDERS", {"serve": "pdserve.serve", "pdserve": "pdserve"})
    problems = wrong_way_arrows()
    assert "pdserve.serve.uses_launcher imports pdserve.app" in problems
    assert "pdserve.envs imports pdserve.kvstore.client" in problems


@pytest.mark.parametrize("module", ["pdserve.protocol.worker", "pdserve.protocol.store",
                                    "pdserve.protocol.tp", "pdserve.protocol.sampling"])
def test_protocol_modules_import_without_torch(module):
    """The router and the store import the protocol: it must not drag in torch."""
    import subprocess
    import sys

    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]



def test_no_test_module_imports_another():
    """Shared test helpers live in helper modules (model_util, kernel_cases, cluster_util, ...),
    never in a test module: importing one runs its module-level setup and ties its helpers to
    its tests."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
                if node.level or node.module == "tests":  # `from . import test_x`
                    modules += [alias.name for alias in node.names]
            else:
                continue
            offenders += [f"{path.name} imports {module}" for module in modules
                          if any(part.startswith("test_") for part in module.split("."))]
    assert offenders == []
