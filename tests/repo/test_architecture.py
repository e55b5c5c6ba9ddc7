"""The floors of docs/architecture.md, checked deny-by-default: every module under pdserve/ and
benchmarks/ is placed in a layer (PLACES, by module prefix), and every import it makes (lazy
ones inside functions included) goes to its own layer or to one below it (BELOW, followed
down). A module placed nowhere fails ("place it"); an import up or sideways fails unless
EXCEPTIONS lists it, and no exception may close a circle.

    app (pdserve/app: cli, launcher, health, tune, profile, plan)   the top: nothing imports it
     ├──► router ──► planner (step-latency models, goodput simulator)
     │      └──────► kvstore
     ├──► serve: llm ► worker ► engine ► executor ► models ► layers ► cpu ► config
     │                   │                  │                           │
     │                   ▼                  ▼                           ▼
     │                handoff ─────────► kvstore                     kernels
     ├──► integrations ──► kvstore
     └──► pdserve/benchmarks (the harness: HTTP load, metrics, plots)
    benchmarks/ (the studies, run from the repository): the harness and the base; no study
        imports another; EXCEPTIONS lists the offline ones with what they time
    base (pdserve/: security, discovery, etcd, envs, ports, ...) ──► protocol (stdlib + msgpack)
    kernels: nothing of pdserve
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
FOLDERS = {  # repository folder -> the package its modules import as
    "pdserve": "pdserve",
    "benchmarks": "benchmarks",  # the studies: run from the repository, not installed
}

# module prefix -> its layer. A prefix places the module of that name and every module under
# it; the longest prefix wins. EXACT places one module only (a package whose folder holds
# modules of several layers).
PLACES: dict[str, str] = {
    "pdserve.protocol": "protocol",
    "pdserve.kernels": "kernels",
    **{f"pdserve.{name}": "base" for name in (
        "security", "discovery", "etcd", "addresses", "envs", "ports", "lifecycle",
        "structured_grammar", "tokenizer")},
    "pdserve.kvstore": "kvstore",
    "pdserve.planner": "planner",
    "pdserve.handoff": "handoff",
    "pdserve.integrations": "integrations",
    "pdserve.router": "router",
    # pdserve/serve/, bottom to top (pdserve/serve/__init__.py argues the order)
    "pdserve.serve.config": "serve.config",
    "pdserve.serve.default_model": "serve.config",
    "pdserve.serve.cpu": "serve.cpu",
    "pdserve.serve.layers": "serve.layers",
    "pdserve.serve.models": "serve.models",
    "pdserve.serve.executor": "serve.executor",
    "pdserve.serve.engine": "serve.engine",
    "pdserve.serve.worker": "serve.worker",
    "pdserve.serve.llm": "serve.llm",
    "pdserve.benchmarks": "harness",
    "benchmarks": "studies",
    "pdserve.app": "app",
}
EXACT: dict[str, str] = {
    "pdserve": "base",  # the package's __init__: its version only
    "pdserve.serve": "serve.llm",  # re-exports LLM, Engine, SamplingParams (lazily)
}

# layer -> the layers directly below it that it may import; what those may import, it may too.
BELOW: dict[str, tuple[str, ...]] = {
    "protocol": (),  # the floor's floor: nothing of pdserve (and no third party but msgpack)
    "kernels": (),  # Triton and C++ ops beside their torch references: nothing of pdserve
    "base": ("protocol",),
    "kvstore": ("base",),  # blocks and bytes: never models, engines or HTTP
    "planner": ("base",),
    "handoff": ("kvstore",),  # the prefill -> decode hand-off: the base and the store only
    "integrations": ("kvstore",),
    "router": ("kvstore", "planner"),  # tokenizes, routes, streams: never model code
    "serve.config": ("base",),
    "serve.cpu": ("serve.config", "kernels"),  # core_share pins threads with a kernels op
    "serve.layers": ("serve.cpu",),
    "serve.models": ("serve.layers",),
    # the KV layout of a block key; the simulated engine times steps by a latency profile
    "serve.executor": ("serve.models", "kvstore", "planner"),
    "serve.engine": ("serve.executor",),
    "serve.worker": ("serve.engine", "handoff"),
    "serve.llm": ("serve.worker",),
    "harness": ("base",),  # measures servers over HTTP
    "studies": ("harness",),
    "app": ("router", "serve.llm", "integrations", "harness"),  # nothing imports it
}
# Layers whose modules are separate programs: a module there imports only its own unit
# (benchmarks.<study>, with the study's sub-modules), never another study.
UNITS = {"studies": 2}  # the number of leading name parts that name a unit

# Imports that go up or sideways, each said why; none may close a circle (see
# test_no_exception_closes_a_circle). module -> the module prefixes it may import besides.
EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # offline engine or model runner: tok/s, PP 1 vs 2, MTP on/off, CP 1 vs 2, step vs floor
    "benchmarks.engine_throughput": ("pdserve.serve",),
    "benchmarks.pp_bubble": ("pdserve.serve",),
    "benchmarks.mtp_decode": ("pdserve.serve",),
    "benchmarks.cp_prefill": ("pdserve.serve",),
    "benchmarks.step_roofline": ("pdserve.serve",),
    "benchmarks.weight_pages": ("pdserve.serve",),
    "benchmarks.decode_warmup": ("pdserve.serve",),
    "benchmarks.structured_cost": ("pdserve.serve",),
    # offline engine + store, through the hand-off's in-process connector
    "benchmarks.fp8_kv": ("pdserve.serve", "pdserve.kvstore", "pdserve.handoff"),
    # the store's tiers, put/get over data nodes, the UCX data plane (and a hand-off node's)
    "benchmarks.store_replay": ("pdserve.kvstore",),
    "benchmarks.store_sharded": ("pdserve.kvstore",),
    # the master at fleet scale: worker FleetClients, its server's run() under a sampler, and
    # an in-process Master for where the index's bytes go
    "benchmarks.store_scale": ("pdserve.kvstore",),
    "benchmarks.kv_transfer": ("pdserve.kvstore", "pdserve.handoff"),
    # the FP8 hand-off wire's effect on greedy tokens: two workers' gateways in one process
    "benchmarks.handoff_wire": ("pdserve.serve", "pdserve.handoff"),
    "benchmarks.kernels.bench_attention": ("pdserve.kernels",),
    # runs the router's own goodput simulator on what the router's /status published
    "benchmarks.controller_check": ("pdserve.planner.goodput_model",),
    # checks `pdserve plan`'s sizing with the planner's library (not the command)
    "benchmarks.plan_check": ("pdserve.planner",),
    # the planner's simulation against DistServe's simulator, on the same arrivals
    "benchmarks.planner_vs_distserve": ("pdserve.planner",),
    # starts its clusters with `pdserve up`'s launcher; times an offline prefill for reference
    "benchmarks.ttft_breakdown": ("pdserve.app.launcher", "pdserve.serve"),
    # benchmarks/gpu/run.sh's served stage builds its random ~1B Llama as the default model is;
    # its decode step runs each engine's offline LLM, pdserve's and vLLM's
    "benchmarks.gpu.served": ("pdserve.serve.default_model",),
    "benchmarks.gpu.decode_step": ("pdserve.serve",),
    # a fleet of role processes under SIGKILLs, supervised as the launcher supervises (spawn,
    # standbys); a data node is ready when a block put through it is in the master's index
    "benchmarks.chaos_soak.fleet": ("pdserve.kvstore", "pdserve.app.launcher"),
    # the offline engine gives the greedy answers' reference text
    "benchmarks.chaos_soak.checks": ("pdserve.serve",),
    "benchmarks.chaos_soak.soak": ("pdserve.serve.default_model",),
    # simulated fleets: their checkpoint dir starts from the default model's tokenizer, and the
    # chaos run's leak check reads the store's own counters (as chaos_soak.soak's)
    "benchmarks.sim_fleet.fleet": ("pdserve.serve.default_model",),
    "benchmarks.sim_fleet.experiments": ("pdserve.kvstore",),
    # sizes each phase's rate from the planner's goodput of every split on the simulated profile
    "benchmarks.sim_fleet.phases": ("pdserve.planner",),
    # reads the served default model's tokenizer (the generated ids of an answer, and the
    # ids its text re-tokenizes to), from where the default model is cached
    "benchmarks.chat_reuse": ("pdserve.serve.default_model",),
    # the offline studies' shared model is built with the default model's builder
    "pdserve.benchmarks.offline": ("pdserve.serve.default_model",),
    # arithmetic only: the communication model of a layout (no engine runs)
    "benchmarks.comm_table": ("pdserve.serve.executor.comm_model", "pdserve.serve.default_model"),
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


def place(name: str, *, is_module: bool = True) -> str | None:
    """The layer of module `name`, None where no entry places it. An imported name may be an
    attribute of a package EXACT places (`from pdserve.serve import LLM`): is_module=False
    gives it that package's layer."""
    if name in EXACT:
        return EXACT[name]
    prefixes = [p for p in PLACES if _matches(name, p)]
    if prefixes:
        return PLACES[max(prefixes, key=len)]
    if is_module:
        return None
    parts = name.split(".")
    while len(parts) > 1:
        parts.pop()
        if ".".join(parts) in EXACT:
            return EXACT[".".join(parts)]
    return None


@functools.cache
def _reach(layer: str) -> frozenset[str]:
    """The layers `layer` may import: itself and everything below it."""
    return frozenset({layer}).union(*(_reach(lower) for lower in BELOW[layer]))


def _ours(name: str) -> bool:
    return any(_matches(name, package) for package in FOLDERS.values())


def _unit(module: str, layer: str) -> str:
    return ".".join(module.split(".")[:UNITS[layer]]) if layer in UNITS else layer


def unplaced_modules() -> list[str]:
    return [f"{module} is in no layer: place it (PLACES)" for module, _ in _modules()
            if place(module) is None]


def wrong_way_arrows() -> list[str]:
    problems = []
    for module, path in _modules():
        layer = place(module)
        allowed = EXCEPTIONS.get(module, ())
        for name in sorted(_imports(module, path)):
            if _matches(module, "pdserve.protocol") and "." not in name.strip(".") and \
                    name not in PROTOCOL_THIRD_PARTY and name not in _stdlib():
                problems.append(f"{module} imports third-party {name}")
            # `from pdserve.app import launcher` names the package of an excused module too
            if layer is None or not _ours(name) or \
                    any(_matches(name, a) or _matches(a, name) for a in allowed):
                continue
            target = place(name, is_module=False)
            if target is None:
                continue  # reported where it is defined, as unplaced (or it does not exist)
            if target not in _reach(layer):
                problems.append(f"{module} ({layer}) imports {name} ({target})")
            elif target == layer and layer in UNITS and name != "benchmarks" and \
                    _unit(name, layer) != _unit(module, layer):  # (the package itself: fine)
                problems.append(f"{module} imports {_unit(name, layer)}: another study")
    return sorted(set(problems))


def _stdlib() -> frozenset[str]:
    import sys

    return frozenset(sys.stdlib_module_names) | {"__future__"}


def package_graph() -> dict[str, set[str]]:
    """The package-level import graph as the code has it (exceptions included): placed
    package (a part, or a sub-package of pdserve/serve/) -> the placed packages its modules
    import. The serve package's own modules sit apart: config at the floor, llm on top."""
    graph: dict[str, set[str]] = {}
    for module, path in _modules():
        layer = place(module)
        if layer is None:
            continue
        targets = {place(name, is_module=False) for name in _imports(module, path) if _ours(name)}
        graph.setdefault(layer, set()).update(t for t in targets if t not in (None, layer))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_graph() -> dict[str, set[str]]:
    """Layer -> the layers it may import: BELOW's arrows and the exceptions'."""
    graph = {layer: set(lower) for layer, lower in BELOW.items()}
    placed = [module for module, _ in _modules()]
    for module, prefixes in EXCEPTIONS.items():
        for prefix in prefixes:
            targets = ({place(m) for m in placed if _matches(m, prefix)}
                       | {place(prefix, is_module=False)})
            graph[place(module)] |= {t for t in targets if t is not None} - {place(module)}
    return graph


def test_every_module_is_placed():
    assert unplaced_modules() == []


def test_every_import_points_down():
    assert wrong_way_arrows() == []


def test_no_circle_between_packages():
    assert circles(package_graph()) == []


def test_the_layers_form_no_circle_and_are_all_known():
    assert set(PLACES.values()) | set(EXACT.values()) <= set(BELOW)
    assert all(set(lower) <= set(BELOW) for lower in BELOW.values())
    assert circles({layer: set(lower) for layer, lower in BELOW.items()}) == []


def test_no_exception_closes_a_circle():
    """An exception is an arrow the layers do not draw; with them all, still no circle."""
    assert circles(layer_graph()) == []


def test_every_exception_names_a_placed_module():
    placed = {module for module, _ in _modules()}
    assert sorted(set(EXCEPTIONS) - placed) == []


# ---- the checker checks ------------------------------------------------------------------


def _fake_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)


def test_the_checker_sees_a_wrong_way_arrow(tmp_path, monkeypatch):
    """The walk must find an arrow hidden in a function body (a lazy import)."""
    _fake_tree(tmp_path, monkeypatch, {"pdserve/router/sneaky.py":
               "def f():\n    from pdserve.serve.engine.engine import Engine\n"})
    assert ("pdserve.router.sneaky (router) imports pdserve.serve.engine.engine (serve.engine)"
            in wrong_way_arrows())


def test_the_checker_sees_the_top_imported_and_the_base_reaching_up(tmp_path, monkeypatch):
    """The app (cli, launcher, health) is imported by nothing; the base imports no part; a
    lower serve layer imports no higher one."""
    _fake_tree(tmp_path, monkeypatch, {
        "pdserve/serve/worker/uses_launcher.py": "from pdserve.app import launcher\n",
        "pdserve/envs.py": "import pdserve.kvstore.client\n",
        "pdserve/serve/layers/up.py": "from pdserve.serve.executor.rank import Rank\n",
    })
    problems = wrong_way_arrows()
    assert "pdserve.serve.worker.uses_launcher (serve.worker) imports pdserve.app (app)" \
        in problems
    assert "pdserve.envs (base) imports pdserve.kvstore.client (kvstore)" in problems
    assert ("pdserve.serve.layers.up (serve.layers) imports pdserve.serve.executor.rank "
            "(serve.executor)") in problems


def test_an_unplaced_module_fails(tmp_path, monkeypatch):
    """Deny by default: a new folder or top-level module is placed before it is used."""
    _fake_tree(tmp_path, monkeypatch, {"pdserve/newpart/thing.py": "",
                                       "pdserve/serve/newfloor.py": "",
                                       "pdserve/serve/config.py": ""})
    assert unplaced_modules() == [
        "pdserve.newpart.thing is in no layer: place it (PLACES)",
        "pdserve.serve.newfloor is in no layer: place it (PLACES)",
    ]


def test_a_circle_between_packages_is_reported(tmp_path, monkeypatch):
    """engine -> executor is down; executor -> engine back up closes a circle."""
    _fake_tree(tmp_path, monkeypatch, {
        "pdserve/serve/engine/engine.py": "from pdserve.serve.executor.rank import Rank\n",
        "pdserve/serve/executor/rank.py": "from pdserve.serve.engine import prompt_logprobs\n",
        "pdserve/serve/engine/prompt_logprobs.py": "",
        "pdserve/serve/config.py": "",
        "pdserve/serve/llm.py": "from pdserve.serve.config import X\n",
    })
    assert circles(package_graph()) == [["serve.engine", "serve.executor"]]
    # the root package's config (the floor) and llm (the top) are apart: no circle through them
    assert package_graph()["serve.llm"] == {"serve.config"}


def test_a_study_importing_another_study_fails(tmp_path, monkeypatch):
    _fake_tree(tmp_path, monkeypatch, {
        "benchmarks/one.py": "from benchmarks.two import helper\n",
        "benchmarks/two.py": "from pdserve.benchmarks import metrics\n",
        "benchmarks/gpu/stage_a.py": "from benchmarks.gpu.stage_b import helper\n",
        "benchmarks/gpu/stage_b.py": "",
    })
    assert wrong_way_arrows() == ["benchmarks.one imports benchmarks.two: another study"]


def test_an_exception_that_closes_a_circle_is_caught(monkeypatch):
    """The layers below the engine may not be excused to import it: the engine imports them."""
    monkeypatch.setitem(EXCEPTIONS, "pdserve.serve.executor.rank", ("pdserve.serve.engine",))
    assert ["serve.engine", "serve.executor"] in circles(layer_graph())


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
