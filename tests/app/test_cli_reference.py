"""The flags: docs/cli.md is what the parsers say, and a worker flag `pdserve up` hands to
its workers is one declaration, parsed alike by both commands."""

from __future__ import annotations

import argparse
import dataclasses

from helpers.paths import REPO_ROOT

from pdserve.app import launcher
from pdserve.app.cli import make_parser
from pdserve.app.cli_reference import REGENERATE, render
from pdserve.serve.worker import args as worker_args
from pdserve.serve.worker.server import WorkerConfig, config_from_args


def test_committed_cli_reference_is_current(monkeypatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    committed = (REPO_ROOT / "docs" / "cli.md").read_text()
    assert committed == render(), f"docs/cli.md is out of date: run `{REGENERATE}`"


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions for name in action.option_strings}


def test_up_declares_the_worker_flags_it_passes_as_the_worker_does() -> None:
    _, worker = make_parser("prefill")
    _, up = make_parser("up")
    worker_options, up_options = _options(worker), _options(up)
    shared = [name for name in up_options if name in worker_options
              and name not in ("--model", "--host", "--port", "--insecure-plaintext",
                               "-h", "--help")]
    assert {"--kv-cache-dtype", "--num-kv-blocks", "--handoff-dram-gb", "--device",
            "--speculative-config", "--enable-expert-parallel"} <= set(shared)
    for name in shared:
        same = ("help", "default", "choices", "type", "nargs")
        assert [getattr(up_options[name], k) for k in same] == \
            [getattr(worker_options[name], k) for k in same], name


def test_passed_flags_reach_the_worker_config() -> None:
    """A flag given to `pdserve up` arrives in each worker's configs, parsed by the worker's
    own parser from the command line the launcher wrote."""
    _, up = make_parser("up")
    cluster = launcher.plan(up.parse_args([
        "--device", "cpu", "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "8",
        "--kv-cache-memory-gb", "1.5", "--expert-capacity-factor", "1.25",
        "--handoff-dram-gb", "0", "--store-timeout-s", "3", "--no-prefix-caching",
        "--enforce-eager", "--kv-handoff", "store", "--no-handoff-shm",
        "--no-handoff-follow"]),
        "/m", gpus=[])
    workers = {c.role: c for c in cluster.children if c.role not in ("store", "router")}
    for role, child in workers.items():
        _, worker = make_parser(child.argv[0])
        config = config_from_args(worker.parse_args(child.argv[1:]))
        assert (config.model.dtype, config.cache.block_size, config.scheduler.max_num_seqs,
                config.cache.kv_cache_memory_bytes, config.parallel.expert_capacity_factor,
                config.cache.enable_prefix_caching) == ("float32", 32, 8, 3 << 29, 1.25, False)
        assert (config.handoff_dram_gb, config.store_timeout_s) == (0.0, 3.0), role
        assert (config.kv_handoff, config.handoff_shm, config.handoff_follow) == (
            "store", False, False), role
        assert config.model.enforce_eager, role
    # defaults are not repeated on the children's command lines
    cluster = launcher.plan(up.parse_args(["--device", "cpu"]), "/m", gpus=[])
    argv = [a for c in cluster.children for a in c.argv]
    assert not {"--dtype", "--block-size", "--handoff-dram-gb", "--seed",
                "--enforce-eager", "--kv-handoff", "--handoff-shm"} & set(argv)


def test_worker_flag_defaults_are_the_worker_configs() -> None:
    _, worker = make_parser("decode")
    config = config_from_args(worker.parse_args(["--model", "/m", "--port", "1"]))
    defaults = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    for name in ("store_timeout_s", "kv_lease_ttl_s", "handoff_dram_gb",
                 "discovery_store_wait_s", "drain_timeout_s"):
        assert getattr(config, name) == defaults[name], name
    assert worker_args.HANDOFF_DRAM_GB == defaults["handoff_dram_gb"]
