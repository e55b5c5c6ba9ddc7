"""docs/bench.md's `pdserve bench` examples run, at reduced size, and each states what to expect.

Every `pdserve bench` command in the docs/bench.md block marked `bench-examples` is parsed with the
real flag parser and run against the scripted SSE server with fewer prompts and faster
rates (the numbers a user should expect come from the embedded model; the scripted server
only proves the command line works end to end). The trace example must also not overload
the embedded model: its offered rate is checked against the goodput measured for it.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.bench_util import ScriptedSSEServer, TokenScript, cli, served_in_thread
from helpers.paths import REPO_ROOT, TEST_DATA

from pdserve.benchmarks import bench_serve
from pdserve.benchmarks.datasets import TokenCodec

ROOT = REPO_ROOT
EXAMPLES_DOC = ROOT / "docs" / "bench.md"
TOKENIZER_DIR = TEST_DATA / "vllm_workload_tokenizer"
# The embedded model's goodput at 128 in / 32 out, ttft:1000 tpot:75, server and client on
# one core: a fine manual sweep found 4 req/s (`pdserve bench --goodput-search` against a manual
# sweep, 3 Dec 2026); a trace example must offer fewer prompt tokens per second.
EMBEDDED_GOODPUT_REQ_S = 4.0
EMBEDDED_INPUT_LEN = 128


@pytest.fixture
def scripted_server() -> Iterator[ScriptedSSEServer]:
    # Every request: 20 ms to the first token, then 3 tokens 10 ms apart.
    with served_in_thread(
        ScriptedSSEServer(lambda body: TokenScript(0.02, (0.01, 0.01, 0.01)))
    ) as server:
        yield server


def readme_examples() -> list[tuple[list[str], str]]:
    """(argv after `pdserve bench`, the `# expect:` line under it) for every example."""
    text = EXAMPLES_DOC.read_text()
    start = text.index("<!-- bench-examples")
    block = text[
        text.index("```bash", start) + 7 : text.index("```", text.index("```bash", start) + 7)
    ]
    joined = re.sub(r"\\\n\s*", " ", block).splitlines()
    examples = []
    for i, line in enumerate(joined):
        if not line.startswith("pdserve bench "):
            continue
        expect = next((later for later in joined[i + 1 :] if later.startswith("# expect:")), "")
        examples.append((shlex.split(line)[2:], expect))
    return examples


EXAMPLES = readme_examples()


def reduced(argv: list[str], base_url: str, tmp_path: Path) -> list[str]:
    """The example at test size: our server, our tokenizer, 4 prompts, 10x the rates."""
    scale = {"--request-rate": 10.0, "--search-min-rate": 10.0}
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        if flag in ("--base-url", "--compare-base-url"):
            value = base_url
        elif flag == "--tokenizer":
            value = str(TOKENIZER_DIR)
        elif flag == "--num-prompts":
            value = "4"
        elif flag == "--result-dir":
            value = str(tmp_path)
        elif flag in scale:
            value = f"{float(value) * scale[flag]:g}"
        elif flag == "--dataset-path" and not Path(ROOT, value).exists():
            value = str(_tiny_trace(tmp_path))
        elif flag == "--dataset-path":
            value = str(ROOT / value)
        out += [flag] if value is None else [flag, value]
        i += 1 if value is None else 2
    if "--goodput-search" in out:
        out += ["--search-max-rate", "80", "--search-repeats", "2"]
    return out


def _tiny_trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 100 * i,
                    "input_length": 600,
                    "output_length": 200,
                    "hash_ids": [0, i + 1],
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    return path


def test_readme_has_examples_with_expectations() -> None:
    assert len(EXAMPLES) >= 3
    for argv, expect in EXAMPLES:
        assert expect, f"no '# expect:' line under: pdserve bench {' '.join(argv)}"
    flags = {flag for argv, _ in EXAMPLES for flag in argv}
    assert {"--goodput-search", "--dataset-name"} <= flags


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs_at_reduced_size(
    index: int,
    scripted_server: ScriptedSSEServer,
    tmp_path: Path,
    capsys,
) -> None:
    argv, _ = EXAMPLES[index]
    assert cli(*reduced(argv, scripted_server.base_url, tmp_path), "--disable-tqdm") == 0
    out = capsys.readouterr().out
    assert "Failed requests:" in out or "goodput rate" in out
    assert list(tmp_path.glob("*.json")), "the example saves its result"


def test_trace_example_fits_the_embedded_model() -> None:
    trace_examples = [argv for argv, _ in EXAMPLES if "mooncake" in argv]
    assert trace_examples
    argv = trace_examples[0]
    parser = __import__("argparse").ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args(argv)
    if not Path(ROOT, args.dataset_path).exists():
        pytest.skip(f"{args.dataset_path} is not in this checkout")
    args.dataset_path = str(ROOT / args.dataset_path)
    requests = bench_serve.build_workload(args, TokenCodec.load(str(TOKENIZER_DIR))).requests
    span_s = requests[-1].arrival_offset_s - requests[0].arrival_offset_s
    offered_req_s = (len(requests) - 1) / span_s
    mean_input = sum(r.prompt_len for r in requests) / len(requests)
    # Offered prompt tokens per second below what the model sustained at its goodput.
    assert offered_req_s * mean_input <= EMBEDDED_GOODPUT_REQ_S * EMBEDDED_INPUT_LEN
    assert math.isfinite(offered_req_s)
