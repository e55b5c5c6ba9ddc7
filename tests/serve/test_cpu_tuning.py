"""The CPU path chosen by measurement (pdserve/serve/executor/cpu_tuning.py): the choice from
stubbed timings, the cache's key and its distrust of a bad entry, and an engine on every path giving
the same greedy tokens as Hugging Face."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.model_util import hf_greedy, random_prompts
from torch import nn

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve import LLM
from pdserve.serve.executor import cpu_path_choice as choice
from pdserve.serve.executor import cpu_tuning as tuning
from pdserve.serve.layers import ops


@pytest.fixture(autouse=True)
def default_path_after():
    yield
    ops.use_path(None)


def test_the_path_nearest_its_best_at_every_point_wins() -> None:
    seconds = {
        "fast-decode": {"decode 1x256": 1.0, "prefill 256": 10.0},  # 10 / 3: 3.3x at prefill
        "balanced": {"decode 1x256": 2.0, "prefill 256": 3.0},      # 2x at decode
        "slow": {"decode 1x256": 4.0, "prefill 256": 4.0},          # 4x at decode
    }
    assert choice.choose(seconds) == "balanced"
    assert choice.worst_ratio(seconds, "fast-decode") == pytest.approx(10 / 3)
    seconds["fast-decode"]["prefill 256"] = 2.5
    assert choice.choose(seconds) == "fast-decode"


def test_a_packed_layout_split_by_rows_wins_where_each_half_is_best() -> None:
    """The plain stream fastest at few rows, the panels at many (a huge-L3 machine): neither
    path alone is near its best everywhere, the split is."""
    points = [tuning.Point(1, 256), tuning.Point(8, 256), tuning.Point(32, 256),
              tuning.Point(0, 256)]
    candidates = tuning.candidate_paths(True, False, False)  # panels, onednn, none; no fused
    measured = {
        "prepack=panels fused=off amx=off": {"decode 1x256": 9.5, "decode 8x256": 10.0,
                                             "decode 32x256": 15.8, "prefill 256": 55.0},
        "prepack=onednn fused=off amx=off": {"decode 1x256": 5.3, "decode 8x256": 7.7,
                                             "decode 32x256": 21.8, "prefill 256": 54.1},
        "prepack=none fused=off amx=off": {"decode 1x256": 2.7, "decode 8x256": 5.0,
                                           "decode 32x256": 18.9, "prefill 256": 59.9},
    }
    decided = tuning.decide(measured, candidates, points, "measured", Path("x.json"))
    assert decided.chosen == ops.CpuPath("panels", False, False, plain_rows=8)
    assert decided.seconds[decided.chosen.label] == {
        "decode 1x256": 2.7, "decode 8x256": 5.0, "decode 32x256": 15.8, "prefill 256": 55.0}
    assert decided.num_measured == 3 and list(decided.seconds)[:3] == list(measured)
    # splits at every decode batch but the largest, of each packed layout
    assert set(decided.paths) - set(measured) == {
        f"prepack={layout} plain<={rows} fused=off amx=off"
        for layout in ("panels", "onednn") for rows in (1, 8)}


def test_paths_timed_at_other_points_are_refused() -> None:
    with pytest.raises(ValueError, match="same points"):
        choice.choose({"a": {"decode 1x256": 1.0}, "b": {"prefill 256": 1.0}})


def test_candidates_follow_the_machine_and_the_environments_switches(monkeypatch) -> None:
    labels = [p.label for p in tuning.candidate_paths(True, True, True)]
    assert "prepack=panels fused=on amx=on" in labels
    assert "prepack=none fused=off amx=off" in labels
    assert len(labels) == 8  # panels x fused x amx (4), onednn and none x fused (4)
    assert all(p.prepack != "panels" for p in tuning.candidate_paths(False, False, True))
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "0")
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", "0")
    assert [p.label for p in tuning.candidate_paths(True, True, True)] == [
        "prepack=none fused=off amx=off"]


FACTS = {"cpu_model": "Intel(R) Xeon(R) Processor", "cpu_flags": "avx2 avx512f amx_bf16",
         "cores": 2, "threads": 2, "caches": {"L2": "2048K", "L3": "491520K"},
         "torch": "2.13.0+cpu", "kernel_library": "pdserve_cpu_ops_abc",
         "products": {"(768, 512) float32": 8}, "parameters": 1000}


@pytest.mark.parametrize("name,changed", [
    ("cpu_model", "AMD EPYC 9B45"), ("cpu_flags", "avx2"), ("cores", 4), ("threads", 1),
    ("caches", {"L2": "1024K", "L3": "32768K"}), ("torch", "2.12.0+cpu"),
    ("kernel_library", "pdserve_cpu_ops_def"), ("products", {"(768, 512) bfloat16": 8}),
])
def test_the_cache_key_changes_with_each_of_its_inputs(name: str, changed) -> None:
    assert tuning.cache_key({**FACTS, name: changed}) != tuning.cache_key(FACTS)
    assert tuning.cache_key(dict(FACTS)) == tuning.cache_key(FACTS)


class Counting:
    """A stub timer: path A is fast at decode, B everywhere else; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, point: tuning.Point) -> float:
        self.calls += 1
        fused = ops.path().fused_decode
        return (1.0 if fused else 2.0) if point.num_seqs else (3.0 if fused else 1.0)


POINTS = [tuning.Point(1, 16), tuning.Point(0, 16)]


def run_tune(timer: Counting) -> tuning.Tuning:
    return tuning.tune(nn.Linear(2, 2), timer, POINTS, has_panels=False, has_amx=False,
                       has_fused=True)


def test_a_choice_is_measured_once_then_read_back(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    first = Counting()
    measured = run_tune(first)
    # every candidate at every point, then the re-check: the chosen one at every point and
    # the fastest other one at each
    assert measured.source == "measured" and first.calls == 6 * len(POINTS)
    assert measured.chosen == ops.path()
    second = Counting()
    cached = run_tune(second)
    assert cached.source == "cached" and second.calls == 0
    assert cached.chosen == measured.chosen and cached.seconds == measured.seconds
    assert "(cached " in cached.summary() and cached.chosen.label in cached.summary()


@pytest.mark.parametrize("spoil", [
    lambda entry: "{not json",
    lambda entry: json.dumps({**entry, "facts": {**entry["facts"], "cores": 99}}),
    lambda entry: json.dumps({**entry, "version": 0}),
    lambda entry: json.dumps({**entry, "chosen": "prepack=bogus"}),
    lambda entry: json.dumps({**entry, "seconds": {"x": {"y": "z"}}}),
    lambda entry: json.dumps({k: v for k, v in entry.items() if k != "seconds"}),
])
def test_a_corrupt_or_stale_entry_is_measured_again(tmp_path, monkeypatch, spoil) -> None:
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    run_tune(Counting())
    (entry_file,) = tmp_path.glob("*.json")
    entry_file.write_text(spoil(json.loads(entry_file.read_text())))
    again = Counting()
    assert run_tune(again).source == "measured" and again.calls > 0


def test_an_entry_whose_times_disagree_with_its_choice_is_not_trusted(tmp_path,
                                                                      monkeypatch) -> None:
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    chosen = run_tune(Counting()).chosen.label
    (entry_file,) = tmp_path.glob("*.json")
    entry = json.loads(entry_file.read_text())
    other = next(label for label in entry["seconds"] if label != chosen)
    entry_file.write_text(json.dumps({**entry, "chosen": other}))
    assert run_tune(Counting()).source == "measured"


def test_an_engine_tunes_itself_and_every_path_gives_hf_tokens(llama_dir, tmp_path,
                                                               monkeypatch) -> None:
    """In the foreground, as `pdserve tune` does (a worker's start has a child do it:
    tests/serve/test_cpu_preparation.py)."""
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    # on a shared host the re-check may disagree and keep it out of the cache (its own tests
    # are above): here every path's tokens are the point
    monkeypatch.setattr(tuning, "RECHECK_TOLERANCE", float("inf"))
    prompts = random_prompts([5, 19], vocab_size=1000, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy(llama_dir, prompts, 6)
    with LLM(llama_dir, num_kv_blocks=64, block_size=16, device="cpu",
             enable_prefix_caching=False) as llm:  # every path prefills too
        runner = llm.engine.runner
        chosen = runner.tune_cpu_path()
        assert runner.cpu_tuning is chosen and llm.cpu_path["path"] == chosen.chosen.label
        assert chosen is not None and chosen.source == "measured"
        assert chosen.chosen == ops.path()
        measured = list(chosen.seconds)[:chosen.num_measured]
        assert measured == [p.label for p in tuning.candidate_paths(*_abilities(measured))]
        model = runner._rank.model
        for label, path in chosen.paths.items():  # the splits too
            tuning.apply(model, path)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in outputs] == expected, label
    assert len(list(tmp_path.glob("*.json"))) == 1


def _abilities(labels: list[str]) -> tuple[bool, bool, bool]:
    return (any("panels" in label for label in labels), any("amx=on" in label for label in labels),
            any("fused=on" in label for label in labels))


def test_torch_threads_are_part_of_what_was_measured() -> None:
    facts = tuning.machine_facts()
    assert facts["threads"] == torch.get_num_threads() and facts["cores"] >= 1
    assert facts["kernel_library"].startswith("pdserve_cpu_ops_")


class Contended(Counting):
    """Times the way a core shared with another process does: the first pass (the candidates)
    slow, everything after it at the real speed."""

    def __init__(self, slow_calls: int) -> None:
        super().__init__()
        self.slow_calls = slow_calls

    def __call__(self, point: tuning.Point) -> float:
        seconds = super().__call__(point)
        return seconds * 40 if self.calls <= self.slow_calls else seconds


def test_a_measurement_the_re_check_disagrees_with_is_taken_again(tmp_path,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    monkeypatch.setattr(tuning, "RECHECK_FLOOR_S", 0.0)
    timer = Contended(slow_calls=4 * len(POINTS))  # the first pass ran beside a neighbour
    measured = run_tune(timer)
    # a first pass, its re-check, a second pass and its re-check
    assert timer.calls == 2 * 6 * len(POINTS)
    entry = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert max(max(times.values()) for times in entry["seconds"].values()) < 10  # the 40x gone
    assert measured.source == "measured"


def test_a_measurement_that_never_agrees_is_served_but_not_cached(tmp_path, monkeypatch,
                                                                  caplog) -> None:
    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    monkeypatch.setattr(tuning, "RECHECK_FLOOR_S", 0.0)

    class Erratic(Counting):
        """Every re-check (the 2 x len(POINTS) calls after each pass of 4 x len(POINTS))
        five times the pass's times."""

        def __call__(self, point: tuning.Point) -> float:
            seconds = super().__call__(point)
            return seconds * 5 if (self.calls - 1) % (6 * len(POINTS)) >= 4 * len(POINTS) \
                else seconds

    run_tune(Erratic())
    assert list(tmp_path.glob("*.json")) == []
    assert "without caching it" in caplog.text


def test_workers_of_one_host_measure_one_at_a_time(tmp_path, monkeypatch) -> None:
    """A second process waits for the first's measurement, then reads what it cached."""
    import subprocess
    import sys

    monkeypatch.setattr(tuning, "cache_directory", lambda: tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.readline()",
         str(tmp_path / "measure.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with tuning.measuring_alone(tmp_path / "measure.lock", timeout_s=0.5) as held:
            assert not held  # the other holds it: past the timeout this one goes on
        holder.stdin.close()
        holder.wait(10)
        with tuning.measuring_alone(tmp_path / "measure.lock", timeout_s=5) as held:
            assert held
    finally:
        holder.kill()
        holder.wait(10)


def test_tune_prepares_the_shapes_pdserve_up_places_its_workers_in(llama_dir) -> None:
    """`pdserve tune` times each one-rank worker's own cores and threads as `pdserve up`
    places them (a borrower's lent cores left out: it narrows itself to its own first)."""
    import os

    from pdserve.app.tune import up_shapes

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    default = up_shapes(str(llama_dir))
    assert sorted(names for names in default.values()) == [["decode-0"], ["prefill-0"]]
    assert all(len(cores) == threads for cores, threads in default)  # a core, a thread each
    assert all(len(cores) < len(os.sched_getaffinity(0)) for cores, _ in default)
    colocated = up_shapes(str(llama_dir), ["--mode", "colocated"])
    assert list(colocated.values()) == [["colocated-0"]]
