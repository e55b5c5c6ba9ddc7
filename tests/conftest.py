"""Shared fixtures: tiny seeded Hugging Face checkpoints built on the fly (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.serve.default_model import build_random_model, build_tokenizer

# Engines in tests serve with the default CPU path instead of timing every path on their first
# start (pdserve/serve/executor/cpu_tuning.py: seconds per model shape); every path's tokens
# are checked against the plain-torch path by the kernel tests, and the tuning tests turn it
# back on.
os.environ.setdefault("PDSERVE_CPU_TUNING", "0")


def builds_cpu_kernels_first() -> bool:
    """Whether the session builds the CPU kernels before its first test: not where they are
    switched off (PDSERVE_CPU_KERNELS=0, as benchmarks/gpu/run.sh sets) nor where CUDA is
    available, whose GPU tests never run them (a CPU test that needs them builds them then)."""
    import torch

    from pdserve import envs

    return envs.cpu_kernels() and not torch.cuda.is_available()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU kernels (pdserve/kernels/csrc) once, up front: a first build takes a minute or
    two, and a worker process started by an end-to-end test must not spend its ready timeout
    on it. Where they cannot be built every test runs the plain-torch paths."""
    if builds_cpu_kernels_first():
        from pdserve.kernels import cpu_ops

        cpu_ops.load()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def make_model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """Factory: make_model_dir("llama", seed=0, **config_overrides) -> checkpoint directory.

    Cached per session by its arguments, so tests that share a model build it once.
    """
    cache: dict[tuple, Path] = {}

    def make(architecture: str = "llama", seed: int = 0, dtype: str = "float32",
             **overrides: object) -> Path:
        key = (architecture, seed, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{architecture}-model")
            cache[key] = build_random_model(
                out, architecture, seed=seed, dtype=dtype, tokenizer_dir=tokenizer_dir,
                **overrides,
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(make_model_dir) -> Path:
    """Tiny Llama with GQA (4 query heads, 2 KV heads, head_dim 16), untied embeddings."""
    return make_model_dir("llama")


@pytest.fixture(scope="session")
def qwen2_dir(make_model_dir) -> Path:
    """Tiny Qwen2 (qkv bias), GQA, tied embeddings."""
    return make_model_dir("qwen2", seed=1, tie_word_embeddings=True)


@pytest.fixture(scope="session", params=["colocated", "disagg"])
def served_cluster(request, llama_dir, tmp_path_factory):
    """`pdserve up` on the tiny Llama, colocated and disaggregated, shared by the end-to-end
    API tests (each start costs 10-15 s on 2 cores): 4096 KV blocks, auto tool choice with
    the hermes parser. Each test module checks after each test that nothing is left held; at
    the end every block, lease and pin must be free."""
    from helpers.cluster_util import start_cluster

    cluster = start_cluster(llama_dir, tmp_path_factory.mktemp(f"{request.param}-logs"),
                            "--mode", request.param, "--num-kv-blocks", "4096",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield cluster
    try:
        cluster.assert_nothing_leaked(with_store=request.param == "disagg")
    finally:
        assert cluster.stop() == 0, cluster.log()


@pytest.fixture
def served_cluster_left_clean(request):
    """For the modules on the shared `served_cluster` (pytestmark usefixtures): after each test
    that used it, workers idle and no store lease or pin left."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    cluster.assert_nothing_leaked(
        with_store=any(w["role"] == "prefill" for w in cluster.status()["workers"]))


@pytest.fixture(scope="session")
def handoff_expected(llama_dir) -> list[int]:
    """The tokens of tests/helpers/handoff_util.py's PROMPT from one engine, no hand-off."""
    from helpers.handoff_util import colocated_tokens

    return colocated_tokens(llama_dir)


@pytest.fixture
def shm_handoffs(llama_dir):
    """(prefill RequestGateway, decode RequestGateway, the prefill's HandoffNode with an 8 MiB
    shared memory segment): two workers' hand-off components on one host
    (tests/helpers/handoff_util.py)."""
    from helpers.handoff_util import handoff_pair

    with handoff_pair(llama_dir, 8 << 20) as handoffs:
        assert handoffs[2].shm_segment is not None
        yield handoffs
