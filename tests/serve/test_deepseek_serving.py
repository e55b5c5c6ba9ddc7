"""DeepSeek-V2/V3 (MLA + MoE) served like any other model: the offline engine's greedy tokens
equal Hugging Face's, and `pdserve up` in disaggregated mode moves the MLA latent blocks (one
plane, one "head", whole on every TP rank) through the KV store from a TP=2 expert-parallel
prefill to a TP=1 decode and returns the offline engine's text. (The engine-level TP=2 -> TP=1
hand-off of latent blocks is in test_kv_relayout.py.)"""

from __future__ import annotations

import httpx
import pytest
import torch
from helpers.cluster_util import start_cluster, wait_until
from transformers import AutoModelForCausalLM

from pdserve.serve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10)
TEXT_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:", "x"]


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek_dir(request, make_model_dir):
    return make_model_dir(request.param, seed=3)


def test_offline_greedy_matches_hf_and_reuses_the_latent_prefix(deepseek_dir):
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(5, 200, (37,), generator=gen).tolist()
    prompts = [shared, shared + [17, 23, 5], torch.randint(5, 200, (4,), generator=gen).tolist()]
    hf = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).eval()
    with LLM(deepseek_dir, block_size=16, num_kv_blocks=32) as llm:
        spec = llm.engine.spec
        assert spec.kv_kind == "mla" and spec.num_kv_heads == 1
        assert llm.engine.runner.kv_caches[0].shape == (1, 32, 16, 1, spec.head_dim)
        outs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
        assert outs[1].num_cached_tokens == 32  # two full latent blocks from the first prompt
        assert llm.engine.block_manager.num_used_blocks == 0
        llm.engine.block_manager.check_integrity()
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected[:len(out.outputs[0].token_ids)]


def test_disaggregated_server_moves_mla_blocks_through_the_store(make_model_dir,
                                                                tmp_path_factory):
    """`pdserve up`: a TP=2 prefill with expert parallelism (whole experts per rank, tokens
    moved by all-to-all) saves the latent layer by layer into the store, a TP=1 decode loads
    it; the text equals the offline TP=1 engine's (itself checked against HF)."""
    model_dir = make_model_dir("deepseek_v3", seed=3)
    with LLM(model_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(TEXT_PROMPTS, GREEDY)]
    cluster = start_cluster(model_dir, tmp_path_factory.mktemp("mla-logs"), "--mode", "disagg",
                            "--prefill-tp", "2", "--decode-tp", "1", "--num-kv-blocks", "128",
                            "--enable-expert-parallel")
    try:
        for prompt, text in zip(TEXT_PROMPTS, expected, strict=True):
            r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        # The TP=2 prefill saved every prompt layer by layer (rank 0 holds the whole latent)
        # and the decode worker loaded each; worker totals reach the router with its polls.
        def totals(role: str) -> dict:
            (worker,) = [w for w in cluster.status()["workers"] if w["role"] == role]
            return worker.get("kv_transfer", {})

        n = len(TEXT_PROMPTS)
        assert wait_until(lambda: totals("prefill").get("save_count") == n
                          and totals("decode").get("load_count") == n), cluster.status()
        assert totals("prefill")["layerwise_save_count"] == n
        assert totals("prefill")["saved_bytes"] == totals("decode")["loaded_bytes"] > 0
        # one host: every hand-off was copied straight out of the prefill worker's segment
        assert totals("decode")["in_place_count"] == n
        # ...and, the router telling it where the prefill staged each prompt as the forward
        # began, layer by layer while the prefill ran (pdserve/serve/worker/follow.py)
        assert totals("decode")["followed_count"] == n
        # a request that ends at its first token hands nothing off: the decode worker picked
        # to follow its prefill gets an abort, and its reserved blocks go back (leak check)
        r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                       json={"prompt": TEXT_PROMPTS[0] + " again", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        saved = [line for line in metrics.splitlines() if line.startswith(
            "pdserve:kv_transfer_bytes_total{") and 'direction="save"' in line]
        assert saved and float(saved[0].split()[-1]) > 0, saved
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()
