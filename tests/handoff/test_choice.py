"""A worker's hand-off is chosen by its flags (--kv-handoff, --handoff-shm, --handoff-follow,
--handoff-dram-gb) in one place; the old environment switches only set the flags' defaults,
with a deprecation warning."""

from __future__ import annotations

import argparse
import warnings
from types import SimpleNamespace

import pytest

from pdserve.handoff.registry import HandoffChoice, choose_handoff
from pdserve.serve.worker.args import add_handoff_arguments


def _flags(**changes) -> SimpleNamespace:
    flags = dict(role="prefill", store_address=None, store_master_address=None,
                 handoff_dram_gb=1.0, kv_handoff="auto", handoff_shm=True, handoff_follow=True,
                 handoff_wire="raw")
    return SimpleNamespace(**{**flags, **changes})


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_handoff_arguments(parser)
    return parser.parse_args(list(argv))


def test_auto_is_todays_choice() -> None:
    assert choose_handoff(_flags()) == HandoffChoice("node")
    assert choose_handoff(_flags(handoff_dram_gb=0, store_address="tcp://s:1")) == \
        HandoffChoice("store")
    assert choose_handoff(_flags(role="colocated", store_address="tcp://s:1")) is None
    assert choose_handoff(_flags(handoff_dram_gb=0)) is None  # nowhere: decode recomputes


def test_the_flags_choose_the_transport_and_its_same_host_paths() -> None:
    choice = choose_handoff(_flags(kv_handoff="store", store_address="tcp://s:1",
                                   handoff_shm=False, handoff_follow=False))
    assert choice == HandoffChoice("store", shm=False, follow=False)
    with pytest.raises(ValueError, match="needs a node"):
        choose_handoff(_flags(kv_handoff="node", handoff_dram_gb=0, store_address="tcp://s:1"))
    with pytest.raises(ValueError, match="--store"):
        choose_handoff(_flags(kv_handoff="store"))


def test_the_flag_defaults_are_on_without_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("PDSERVE_HANDOFF_SHM", raising=False)
    monkeypatch.delenv("PDSERVE_HANDOFF_FOLLOW", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning when the alias is unset
        args = _parse()
    assert (args.kv_handoff, args.handoff_shm, args.handoff_follow) == ("auto", True, True)


@pytest.mark.parametrize(("variable", "dest", "flag"), [
    ("PDSERVE_HANDOFF_SHM", "handoff_shm", "--handoff-shm"),
    ("PDSERVE_HANDOFF_FOLLOW", "handoff_follow", "--handoff-follow"),
])
def test_the_deprecated_variable_sets_the_default_and_the_flag_wins(
        monkeypatch, variable: str, dest: str, flag: str) -> None:
    monkeypatch.setenv(variable, "0")
    with pytest.warns(FutureWarning, match=f"{variable} is deprecated: use the worker flag "
                                           f"{flag}"):
        assert getattr(_parse(), dest) is False
    with pytest.warns(FutureWarning):
        assert getattr(_parse(flag), dest) is True  # the flag wins


def test_the_worker_config_reads_the_alias_as_its_default(monkeypatch) -> None:
    from pdserve.serve.config import ModelConfig
    from pdserve.serve.worker.server import WorkerConfig

    monkeypatch.setenv("PDSERVE_HANDOFF_FOLLOW", "0")
    with pytest.warns(FutureWarning):
        config = WorkerConfig("decode", ModelConfig("/m"), 1)
    assert (config.handoff_shm, config.handoff_follow) == (True, False)
    assert WorkerConfig("decode", ModelConfig("/m"), 1, handoff_follow=True).handoff_follow
    with pytest.raises(ValueError, match="unknown hand-off transport"):
        WorkerConfig("decode", ModelConfig("/m"), 1, kv_handoff="nixl")
