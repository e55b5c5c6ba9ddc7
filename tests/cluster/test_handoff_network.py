"""The KV hand-off over the network path, as between two hosts: every shared-memory path off
(PDSERVE_HANDOFF_SHM=0, UCX over TCP only), so decode reads each prompt from the prefill
worker's hand-off node over the wire. Different TP degrees on the two sides (each decode rank
takes its own heads; an MLA latent goes whole to every rank) give the offline engine's text,
nothing is copied in place, and nothing is left held."""

from __future__ import annotations

import httpx
import pytest
from helpers.cluster_util import start_cluster, wait_until

from pdserve.serve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\nclass Config:", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture
def network_path(monkeypatch):
    """What `pdserve up` and its children inherit: no shared memory anywhere."""
    monkeypatch.setenv("PDSERVE_HANDOFF_SHM", "0")
    monkeypatch.setenv("UCX_TLS", "tcp,self")


def _served_over_the_network(model_dir, log_dir, expected: list[str], *flags: str) -> None:
    cluster = start_cluster(model_dir, log_dir, "--mode", "disagg", "--num-kv-blocks", "128",
                            "--handoff-dram-gb", "0.25", *flags)
    try:
        for prompt, text in zip(PROMPTS, expected, strict=True):
            r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text

        def loads() -> dict:
            (decode,) = [w for w in cluster.status()["workers"] if w["role"] == "decode"]
            return decode.get("kv_transfer", {})

        assert wait_until(lambda: loads().get("load_count") == len(PROMPTS)), loads()
        assert loads().get("in_place_count", 0) == 0  # none out of the prefill's segment
        assert loads()["loaded_bytes"] > 0
        cluster.assert_nothing_leaked()
    finally:
        assert cluster.stop() == 0, cluster.log()


@pytest.mark.parametrize("prefill_tp,decode_tp", [("2", "1"), ("1", "2")])
def test_tp_relayout_over_the_network_path(llama_dir, tmp_path_factory, network_path,
                                           prefill_tp, decode_tp):
    with LLM(llama_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    _served_over_the_network(llama_dir, tmp_path_factory.mktemp("net-tp-logs"), expected,
                             "--prefill-tp", prefill_tp, "--decode-tp", decode_tp)


def test_mla_latent_over_the_network_path(make_model_dir, tmp_path_factory, network_path):
    model_dir = make_model_dir("deepseek_v3", seed=3)
    with LLM(model_dir, num_kv_blocks=128) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY)]
    _served_over_the_network(model_dir, tmp_path_factory.mktemp("net-mla-logs"), expected,
                             "--prefill-tp", "2", "--decode-tp", "1")
