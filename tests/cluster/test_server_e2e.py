"""End to end through `pdserve up`: HTTP in, the same greedy tokens out as the offline engine
and Hugging Face, in colocated and disaggregated (1 prefill + 1 decode over the KV store) mode.
"""

from __future__ import annotations

import os
import random

import httpx
import pytest
import torch
from helpers.cluster_util import complete, start_cluster, stream_chunks
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.ttft_breakdown import (
    HANDOVER_METRIC,
    PHASE_METRIC,
    parse_histograms,
)
from pdserve.serve import LLM, SamplingParams

# after each test on the shared cluster: nothing held (conftest)
pytestmark = pytest.mark.usefixtures("served_cluster_left_clean")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:", "x"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy completions from the offline engine, checked against HF transformers."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    llm = LLM(str(llama_dir), num_kv_blocks=256)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    finally:
        llm.shutdown()
    texts = {}
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        hf_ids = hf.generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        # the whole completion: an engine that returned nothing (or stopped early) fails here
        assert out.outputs[0].token_ids == hf_ids and len(hf_ids) > 0
        assert out.outputs[0].text == tokenizer.decode(hf_ids, skip_special_tokens=True)
        texts[prompt] = out.outputs[0].text
    return texts


@pytest.fixture(scope="module")
def cluster(served_cluster):
    """The shared `pdserve up` (conftest.served_cluster), colocated and disaggregated."""
    return served_cluster


def test_completions_match_reference(cluster, reference):
    for prompt in PROMPTS:
        body = complete(cluster.base_url, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert body["choices"][0]["text"] == reference[prompt]
        assert body["usage"]["completion_tokens"] > 0
        chunks = stream_chunks(cluster.base_url, "/v1/completions",
                         {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert "".join(c["choices"][0]["text"] for c in chunks) == reference[prompt]
        assert chunks[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    roles = {w["role"] for w in cluster.status()["workers"]}
    if "prefill" in roles and len(os.sched_getaffinity(0)) >= 2 and not torch.cuda.is_available():
        # on a CPU host the idle decode worker's cores ran these prefills (core lending),
        # and the tokens above are still the reference's
        assert "borrowed cores" in cluster.log_path.read_text(errors="replace")


def test_chat_stream_equals_non_stream(cluster, llama_dir):
    messages = [{"role": "user", "content": "Write a loop."}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]["message"]["content"]
    chunks = stream_chunks(cluster.base_url, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full
    # the same prompt through the offline engine's chat path
    llm = LLM(str(llama_dir), num_kv_blocks=128)
    try:
        [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    finally:
        llm.shutdown()
    assert out.outputs[0].text == full


def test_shared_prefix_reports_cached_tokens(cluster):
    prefix = "# a long shared system prompt that spans several KV blocks\n" * 4
    first = complete(cluster.base_url, prompt=prefix + "first", max_tokens=2, temperature=0)
    second = complete(cluster.base_url, prompt=prefix + "second", max_tokens=2, temperature=0)
    assert first["usage"]["prompt_tokens"] > 32
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_openai_client_works_unchanged(cluster, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    [model] = client.models.list().data
    completion = client.completions.create(model=model.id, prompt=PROMPTS[0],
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == reference[PROMPTS[0]]
    stream = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"prompt": "hi " * 3000, "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, 400),
    ("/v1/completions", {"prompt": 12}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400),
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400),  # n and best_of: at most 16
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "min_tokens": 9, "max_tokens": 2}, 400),
]


def test_bad_requests_get_openai_errors(cluster):
    for path, body, status in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{cluster.base_url}{path}", timeout=30, **kwargs)
        assert r.status_code == status, (body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["code"] == status and error["message"], r.text
    r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=30,
                   content=b"x" * (9 * 1024 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413
    # and the server still serves
    assert complete(cluster.base_url, prompt="ok", max_tokens=2)["usage"]["completion_tokens"]


def test_metrics_exposed(cluster):
    prompt = "# metrics: a prompt of a few KV blocks\n" * 5
    for _ in range(2):  # the second finds the first's blocks in the store
        complete(cluster.base_url, prompt=prompt, max_tokens=4)
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    for name in ("pdserve:time_to_first_token_seconds_bucket",
                 "pdserve:request_time_per_output_token_seconds_bucket",
                 "pdserve:e2e_request_latency_seconds_count", "pdserve:kv_cache_usage_perc",
                 "pdserve:num_requests_waiting", "pdserve:prompt_tokens_total"):
        assert name in text, name
    if any(w["role"] == "prefill" for w in cluster.status()["workers"]):
        # the shared-prefix requests found their prefix in the fleet-wide store
        hits = [line for line in text.splitlines()
                if line.startswith("pdserve:external_prefix_cache_hits_total{")]
        assert hits and float(hits[0].split()[-1]) > 0, hits
        saved = [line for line in text.splitlines() if line.startswith(
            "pdserve:kv_transfer_bytes_total{") and 'direction="save"' in line]
        assert saved and float(saved[0].split()[-1]) > 0, saved


def test_request_phases_exposed(cluster):
    """One fresh request adds one observation to each phase of its path, and only those."""
    is_disagg = any(w["role"] == "prefill" for w in cluster.status()["workers"])

    def phase_counts() -> dict[tuple[str, str], float]:
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
        return {key: count for key, (_, count) in parse_histograms(text).items()
                if key[0] in (PHASE_METRIC, HANDOVER_METRIC)}

    before = phase_counts()
    complete(cluster.base_url, prompt="# phases: a prompt no other test sends\n" * 3,
              max_tokens=3, ignore_eos=True, temperature=0)
    after = phase_counts()
    added = {key: after[key] - before.get(key, 0.0) for key in after
             if after[key] != before.get(key, 0.0)}
    expected = ["router", "queue", "prefill", "transport", "first_token_out"]
    handover = []
    if is_disagg:
        expected.append("kv_save")
        # the per-layer save hook's share of the forward, when the prefill saved layer by layer
        assert added.pop((PHASE_METRIC, "layer_save"), 1.0) == 1.0
        handover = ["second_dispatch", "kv_load", "first_decode", "decode_transport"]
    assert added == {**{(PHASE_METRIC, p): 1.0 for p in expected},
                     **{(HANDOVER_METRIC, p): 1.0 for p in handover}}


@pytest.mark.parametrize("prefill_tp,decode_tp,handoff_gb", [
    ("2", "1", "0"),    # through the fleet store (two hops)
    ("1", "2", "0.5"),  # straight from the prefill worker's hand-off node
])
def test_tp_resharding_handoff_same_tokens(llama_dir, reference, tmp_path_factory,
                                           prefill_tp, decode_tp, handoff_gb):
    """Different TP degrees on the two sides, over either hand-off path: the text equals
    HF's greedy text, and nothing (blocks, leases on the store or a worker's node) is left."""
    cluster = start_cluster(llama_dir, tmp_path_factory.mktemp("tp-logs"), "--mode", "disagg",
                            "--prefill-tp", prefill_tp, "--decode-tp", decode_tp,
                            "--num-kv-blocks", "256", "--handoff-dram-gb", handoff_gb)
    try:
        for prompt in PROMPTS:
            body = complete(cluster.base_url, prompt=prompt, max_tokens=MAX_TOKENS,
                             temperature=0)
            assert body["choices"][0]["text"] == reference[prompt]
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()


def test_async_scheduling_serves_the_reference_text(llama_dir, reference, tmp_path_factory):
    """`pdserve up --async-scheduling` (disaggregated: the decode worker runs each step ahead of
    the last one's outputs, pdserve/serve/engine/overlap.py): HF's greedy text, streamed and not, a
    stop string ending a stream mid-flight, and nothing left held."""
    cluster = start_cluster(llama_dir, tmp_path_factory.mktemp("async-logs"), "--mode",
                            "disagg", "--num-kv-blocks", "256", "--async-scheduling")
    try:
        for prompt in PROMPTS:
            body = complete(cluster.base_url, prompt=prompt, max_tokens=MAX_TOKENS,
                            temperature=0)
            assert body["choices"][0]["text"] == reference[prompt]
            chunks = stream_chunks(cluster.base_url, "/v1/completions",
                                   {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                    "temperature": 0})
            assert "".join(c["choices"][0]["text"] for c in chunks) == reference[prompt]
        text = reference[PROMPTS[0]]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        body = complete(cluster.base_url, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                        temperature=0, stop=[stop])
        assert body["choices"][0]["text"] == text[:text.index(stop)]
        assert body["choices"][0]["finish_reason"] == "stop"
        assert "async scheduling on" in cluster.log()
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()


def test_prompts_placed_on_the_decode_worker_serve_the_reference_text(llama_dir, reference,
                                                                      tmp_path_factory):
    """`--local-prefill-max-tokens` (pdserve/router/placement.py): short prompts are computed
    on the decode worker itself, long ones on the prefill worker, and a chat's next turn,
    long but mostly held by the decode worker that served the last, goes back there; every
    text is the offline engine's, and nothing is left held."""
    cluster = start_cluster(llama_dir, tmp_path_factory.mktemp("placement-logs"), "--mode",
                            "disagg", "--num-kv-blocks", "256", "--local-prefill-max-tokens",
                            "40")
    try:
        for prompt in PROMPTS:  # each under 40 tokens
            body = complete(cluster.base_url, prompt=prompt, max_tokens=MAX_TOKENS,
                            temperature=0)
            assert body["choices"][0]["text"] == reference[prompt]
        assert cluster.status()["placement"] == {"local_prefill_max_tokens": 40, "local": 3,
                                                  "remote": 0}
        rng = random.Random(5)
        first = [rng.randrange(3, 1000) for _ in range(160)]  # remote: 160 uncached tokens
        llm = LLM(str(llama_dir), num_kv_blocks=256)
        try:
            greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            [answer] = llm.generate([first], greedy)
            second = first + list(answer.outputs[0].token_ids) + [7, 8, 9]
            [expected] = llm.generate([second], greedy)
        finally:
            llm.shutdown()
        assert complete(cluster.base_url, prompt=first, max_tokens=16, temperature=0,
                        ignore_eos=True)["choices"][0]["text"] == answer.outputs[0].text
        assert cluster.status()["placement"]["remote"] == 1
        # turn 2: 179 tokens, of which the decode worker took the first 160
        assert complete(cluster.base_url, prompt=second, max_tokens=16, temperature=0,
                        ignore_eos=True)["choices"][0]["text"] == expected.outputs[0].text
        assert cluster.status()["placement"] == {"local_prefill_max_tokens": 40, "local": 4,
                                                  "remote": 1}
        metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=5).text
        assert 'placement="local"} 4.0' in metrics
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()
