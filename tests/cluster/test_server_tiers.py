"""`pdserve up` with the tiers below each worker's pool (pdserve/serve/engine/kv_tiers.py), both
modes: a conversation pushed out of a small pool comes back cached (from the host tier) with the
offline engine's tokens, and `--no-prefix-caching` reports 0 cached tokens: no tier, the
store included, serves anything (checked disaggregated, where the store and both workers'
tiers could serve; a colocated worker uses no store)."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.cluster_util import complete, start_cluster

from pdserve.serve import LLM, SamplingParams

BLOCK = 16
MAX_TOKENS = 4


def turns(vocab: int) -> list[list[int]]:
    """Conversations a, b, c of 4 blocks each, then a again with a new turn: b and c push
    a's blocks out of a 10-block pool."""
    gen = torch.Generator().manual_seed(11)
    a, b, c = (torch.randint(3, vocab, (4 * BLOCK,), generator=gen).tolist() for _ in range(3))
    return [a + [1], b + [2], c + [3], a + [4, 5, 6]]


@pytest.fixture(scope="module")
def expected(llama_dir):
    with LLM(str(llama_dir), num_kv_blocks=64, enable_prefix_caching=False) as llm:
        prompts = turns(llm.engine.spec.vocab_size)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return prompts, [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_prefix_tiers_served_and_off(llama_dir, tmp_path, expected, mode):
    prompts, tokens = expected
    for caching in ((True, False) if mode == "disagg" else (True,)):
        extra = ["--mode", mode, "--num-kv-blocks", "10"]
        cluster = start_cluster(llama_dir, tmp_path, *extra,
                                *([] if caching else ["--no-prefix-caching"]))
        try:
            cached = []
            for prompt, want in zip(prompts, tokens, strict=True):
                body = complete(cluster.base_url, prompt=prompt, max_tokens=MAX_TOKENS,
                                temperature=0)
                assert body["choices"][0]["text"] == want
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(1.5)  # the workers' next status heartbeat
            tiers = {w["role"]: w.get("kv_tiers", {}) for w in cluster.status()["workers"]}
            cluster.assert_nothing_leaked(with_store=True)
        finally:
            assert cluster.stop() == 0, cluster.log()
        if caching:
            assert cached[:3] == [0, 0, 0] and cached[3] == 4 * BLOCK, cached
            # the worker that computed it (colocated, or the prefill worker) found what its
            # pool had evicted in its host tier
            first = tiers["colocated" if mode == "colocated" else "prefill"]
            assert first["host_hit_tokens"] > 0, tiers
            assert first["host_hit_tokens"] + first["device_hit_tokens"] == 4 * BLOCK, tiers
        else:
            assert cached == [0, 0, 0, 0]
            assert not any(t.get("host_hit_tokens") or t.get("store_hit_tokens")
                           for t in tiers.values()), tiers
