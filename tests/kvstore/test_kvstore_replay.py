"""store_replay on a tiny hand-made trace: exact hit ratios, and the last line is the JSON."""

from __future__ import annotations

import json

from benchmarks import store_replay


def write_trace(path) -> None:
    rows = [
        {"input_length": 1500, "hash_ids": [0, 1, 2]},  # cold
        {"input_length": 1100, "hash_ids": [0, 1, 3]},  # 2 leading blocks cached
        {"input_length": 300, "hash_ids": [0]},  # 1 block, partial: 300 tokens hit
        {"input_length": 2000, "hash_ids": [4, 5, 6, 7]},  # cold
        {"input_length": 1536, "hash_ids": [0, 1, 2]},  # evicted with a tiny store
    ]
    path.write_text("\n".join(json.dumps({"timestamp": 0, "output_length": 1, **r})
                              for r in rows) + "\n")


def test_ideal_and_replayed_hit_ratios(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace)
    requests = store_replay.load_trace(str(trace))
    total = 1500 + 1100 + 300 + 2000 + 1536
    assert store_replay.ideal_hit_ratio(requests) == (1024 + 300 + 1536) / total
    out = tmp_path / "replay.json"
    # DRAM 2 + disk 2 blocks: request 4's cold blocks push 0, 1, 2 out before request 5
    store_replay.main(["--trace", str(trace), "--dram-blocks", "2", "--disk-blocks", "2",
                       "--disk-dir", str(tmp_path / "disk"), "--block-bytes", "32",
                       "--sweep-fractions", "0.5,1.0", "--out", str(out)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["hit_ratio"] == round((1024 + 300) / total, 4)
    assert result["ideal_hit_ratio"] == round((1024 + 300 + 1536) / total, 4)
    assert [p["capacity_blocks"] for p in result["sweep"]] == [4, 8]
    assert result["sweep"][1]["hit_ratio"] == result["ideal_hit_ratio"]  # holds everything
    assert (tmp_path / "replay.png").exists() and json.loads(out.read_text()) == result
