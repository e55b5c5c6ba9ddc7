"""The hand-off transports' registry (pdserve/handoff/registry.py): a name names one class,
imported only when chosen; an unknown name is a clear error; one line adds a transport."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT

from pdserve.handoff import registry
from pdserve.handoff.base import HandoffTransport
from pdserve.handoff.registry import (
    TRANSPORTS,
    HandoffChoice,
    make_transport,
    transport_class,
)


def test_every_registered_name_is_its_class_name() -> None:
    for name in TRANSPORTS:
        cls = transport_class(name)
        assert issubclass(cls, HandoffTransport) and cls.name == name


def test_an_unknown_transport_is_a_value_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown hand-off transport 'nixl'; known: "
                                         r"\['node', 'store'\]"):
        transport_class("nixl")
    with pytest.raises(ValueError, match="known: "):
        HandoffChoice("push")


def test_transports_are_imported_only_when_chosen() -> None:
    """Importing the registry (as the worker's flags do) imports no transport and no torch."""
    probe = ("import sys, pdserve.handoff.registry as r; "
             "print(sorted(m for m in sys.modules if m.startswith('pdserve.handoff.')), "
             "'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT).stdout.strip()
    assert out == "['pdserve.handoff.registry'] False"


def test_the_node_transport_and_only_it_takes_the_workers_node() -> None:
    with pytest.raises(ValueError, match="needs data node"):
        make_transport("node", None)
    store = make_transport("store", None)
    assert store.node is None and not store.offers_in_process
    with pytest.raises(ValueError, match="takes no data node"):
        make_transport("store", None, node=object())  # type: ignore[arg-type]


def test_one_line_registers_a_transport(monkeypatch) -> None:
    """A new transport is a class somewhere and its line in TRANSPORTS: the choice then
    accepts its name."""
    monkeypatch.setitem(registry.TRANSPORTS, "store2", "pdserve.handoff.store:StoreHandoff")
    assert HandoffChoice("store2").transport == "store2"
    assert type(make_transport("store2", None)).__name__ == "StoreHandoff"
