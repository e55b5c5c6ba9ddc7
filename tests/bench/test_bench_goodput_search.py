"""--goodput-search: the bracketing search over rates, its bounds, and the CLI's report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.bench_util import ScriptedSSEServer, TokenScript, cli, served_in_thread

from pdserve.benchmarks.goodput_search import RateSearch, SearchConfig, summarize_searches


@pytest.fixture
def scripted_server() -> Iterator[ScriptedSSEServer]:
    # Every request: 20 ms to the first token, then 3 tokens 10 ms apart.
    with served_in_thread(
        ScriptedSSEServer(lambda body: TokenScript(0.02, (0.01, 0.01, 0.01)))
    ) as server:
        yield server


def run_search(config: SearchConfig, capacity: float) -> RateSearch:
    """A server whose attainment is 100% up to `capacity` req/s and 50% above."""
    search = RateSearch(config)
    while (rate := search.next_rate()) is not None:
        search.record(rate, 1.0 if rate <= capacity else 0.5)
    return search


def test_search_doubles_then_bisects_to_the_capacity() -> None:
    search = run_search(SearchConfig(min_rate=0.5, rel_tolerance=0.05, max_runs=20), 3.3)
    rates = [rate for rate, _ in search.points]
    assert rates[:4] == [0.5, 1.0, 2.0, 4.0]  # doubling until the first miss
    assert rates[4:6] == [3.0, 3.5]  # then bisection of [2, 4], then of [3, 4]
    assert search.is_converged
    assert search.goodput_rate <= 3.3 < search.failing_rate
    assert search.failing_rate - search.goodput_rate <= 0.05 * search.goodput_rate


def test_search_bounds() -> None:
    # The run budget stops it before convergence.
    short = run_search(SearchConfig(min_rate=0.5, rel_tolerance=0.001, max_runs=5), 3.3)
    assert len(short.points) == 5 and not short.is_converged
    # min_rate misses: halve until a rate passes, then bisect up again.
    low = run_search(SearchConfig(min_rate=4.0, rel_tolerance=0.05, max_runs=20), 3.3)
    assert [r for r, _ in low.points][:3] == [4.0, 2.0, 3.0]
    assert low.goodput_rate <= 3.3 < low.failing_rate and low.is_converged
    # Nothing passes: down to min_rate / 8, then no goodput.
    none = run_search(SearchConfig(min_rate=4.0), 0.0)
    assert [r for r, _ in none.points] == [4.0, 2.0, 1.0, 0.5] and none.goodput_rate is None
    assert none.is_converged and summarize_searches([none]).median_rate is None
    # max_rate passes: a lower bound, stops at max_rate.
    high = run_search(SearchConfig(min_rate=1.0, max_rate=6.0), 100.0)
    assert [r for r, _ in high.points] == [1.0, 2.0, 4.0, 6.0] and high.failing_rate is None
    with pytest.raises(ValueError):
        SearchConfig(min_rate=2.0, max_rate=1.0)
    with pytest.raises(ValueError):
        SearchConfig(target_attainment=0.0)


def test_repeats_give_median_and_spread() -> None:
    config = SearchConfig(min_rate=0.5, rel_tolerance=0.05, max_runs=20)
    summary = summarize_searches([run_search(config, c) for c in (3.0, 3.3, 2.6)])
    low, high = summary.spread
    assert low <= summary.median_rate <= high
    assert 2.4 <= low <= 2.6 and 3.0 <= high <= 3.3
    document = summary.as_dict()
    assert document["goodput_rate"] == summary.median_rate
    assert len(document["repeat_rates"]) == 3 and all(document["repeat_converged"])


def test_cli_goodput_search_compare_writes_one_plot(
    scripted_server: ScriptedSSEServer, tmp_path: Path, capsys
) -> None:
    # The scripted server answers in ~50 ms, far inside the SLO at any rate tried: every
    # repeat doubles 20 -> 40 -> 80 and stops at the max rate (a lower bound).
    rc = cli(
        "--base-url",
        scripted_server.base_url,
        "--compare-base-url",
        scripted_server.base_url,
        "--label",
        "a",
        "--compare-label",
        "b",
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "4",
        "--goodput",
        "ttft:5000",
        "--goodput-search",
        "--search-min-rate",
        "20",
        "--search-max-rate",
        "80",
        "--search-repeats",
        "2",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "g.json",
        "--disable-tqdm",
    )
    assert rc == 0
    out = capsys.readouterr().out
    document = json.loads((tmp_path / "g.json").read_text())
    for server in document["servers"]:
        search = server["goodput_search"]
        assert search["repeat_rates"] == [80.0, 80.0]
        assert server["goodput_rate"] == 80.0 and server["goodput_rate_is_lower_bound"]
        # 3 runs per repeat, each with its own seed (fresh prompts: no cache carry-over).
        assert len(server["runs"]) == 6 and len({r["seed"] for r in server["runs"]}) == 6
    assert "median of 2 searches" in out and "raise --search-max-rate" in out
    # One attainment plot holds both servers' curves.
    assert (tmp_path / "g-attainment.png").read_bytes()[:4] == b"\x89PNG"
    assert len(scripted_server.served) == 2 * 2 * 3 * 3  # servers x repeats x runs x prompts


def test_cli_goodput_search_flag_errors(capsys) -> None:
    assert cli("--model", "m", "--goodput-search") == 2
    assert "needs SLOs" in capsys.readouterr().err
    assert (
        cli("--model", "m", "--goodput-search", "--goodput", "ttft:1", "--search-min-rate", "0")
        == 2
    )
    assert "search-min-rate" in capsys.readouterr().err
