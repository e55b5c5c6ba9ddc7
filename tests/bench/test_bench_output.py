"""pdserve/benchmarks/output.py: results go outside the checkout and the installed package."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT

import pdserve.benchmarks
from pdserve.benchmarks.output import add_output_dir, default_dir, output_path


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


@pytest.mark.parametrize("env", [{}, {"XDG_CACHE_HOME": "cache"}])
def test_the_default_folder_is_outside_the_repository_and_the_package(env, monkeypatch,
                                                                       tmp_path):
    monkeypatch.delenv("PDSERVE_RESULTS_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    folder = default_dir("step_roofline")
    assert folder.name == "step_roofline"
    assert folder.parent.parts[-2:] == ("pdserve", "results")
    assert not _inside(folder, REPO_ROOT)
    assert not _inside(folder, Path(pdserve.benchmarks.__file__).parent)
    root = tmp_path / ("cache" if env else "home/.cache")
    assert folder == root / "pdserve" / "results" / "step_roofline"


def test_pdserve_results_dir_and_the_flags_win(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_RESULTS_DIR", str(tmp_path / "runs"))
    assert default_dir("kv_transfer") == tmp_path / "runs" / "kv_transfer"
    parser = argparse.ArgumentParser()
    add_output_dir(parser, "kv_transfer")
    parser.add_argument("--out", default=None)
    args = parser.parse_args([])
    assert output_path(args, "kv_transfer", "kv_transfer.json") == \
        tmp_path / "runs" / "kv_transfer" / "kv_transfer.json"
    args = parser.parse_args(["--output-dir", str(tmp_path / "here")])
    assert output_path(args, "kv_transfer", "kv_transfer.json") == \
        tmp_path / "here" / "kv_transfer.json"
    assert output_path(args, "kv_transfer", "kv_transfer.json", tmp_path / "a.json") == \
        tmp_path / "a.json"


def test_no_benchmark_defaults_into_the_checkout():
    """Every benchmark takes its folder from pdserve/benchmarks/output.py: no path into the
    repository (benchmarks/results, a relative file name) is left as a default."""
    for path in sorted((REPO_ROOT / "benchmarks").rglob("*.py")):
        text = path.read_text()
        assert "benchmarks/results" not in text, path
        assert 'default="." ' not in text and "default='.'" not in text, path
