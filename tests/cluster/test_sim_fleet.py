"""A simulated fleet through `pdserve up --engine sim`: two prefill and two decode workers
serve the OpenAI API with the real router, store and hand-off; greedy tokens equal an
in-process simulated engine's, and nothing is left held afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.cluster_util import start_cluster
from helpers.engine_util import run_to_completion, token_ids

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, SimConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.executor.sim_runner import SimRunner
from pdserve.tokenizer import load_tokenizer

PROFILE = {
    "model": "test", "hardware": "test", "kv_bytes_per_token": 8192,
    "prefill": {"1": {"intercept_s": 0.010, "per_token_s": 1e-4, "per_attention_s": 1e-7}},
    "decode": {"1": {"intercept_s": 0.015, "per_context_token_s": 1e-6,
                     "per_sequence_s": 3e-4}},
}
PROMPTS = [list(range(10, 10 + n)) for n in (5, 40, 70)]


@pytest.fixture(scope="module")
def sim_fleet(llama_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("sim-fleet")
    profile = logs / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    cluster = start_cluster(llama_dir, logs, "--engine", "sim", "--sim-profile", str(profile),
                            "--sim-speedup", "5", "--num-prefill", "2", "--num-decode", "2",
                            "--num-kv-blocks", "512")
    yield cluster, str(profile)
    try:
        cluster.assert_nothing_leaked(with_store=True)
    finally:
        assert cluster.stop() == 0, cluster.log()


def _expected(llama_dir, profile: str, params: SamplingParams) -> list[str]:
    """Each prompt's text from an in-process simulated engine."""
    engine = Engine(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=512),
                    tokenizer=load_tokenizer(str(llama_dir)),
                    runner=SimRunner(ModelConfig(str(llama_dir)), CacheConfig(num_blocks=512),
                                     None, SimConfig(profile, speedup=1000)))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, str(i))
    done = run_to_completion(engine)
    assert all(len(token_ids(done[str(i)])) == 12 for i in range(len(PROMPTS)))
    return ["".join(out.outputs[0].text for out in done[str(i)]) for i in range(len(PROMPTS))]


def test_sim_fleet_serves_the_api(sim_fleet, llama_dir):
    cluster, profile = sim_fleet
    status = cluster.status()
    workers = status["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
    assert all(w["sim"]["profile"] == "test" and w["sim"]["speedup"] == "5.0" for w in workers)
    metrics = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    assert all(w["worker_id"] in metrics for w in workers)
    expected = _expected(llama_dir, profile, SamplingParams(temperature=0, max_tokens=12))
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        # the served name is the checkpoint directory's, whatever tmp_path numbered it
        (model,) = [m["id"] for m in client.get("/v1/models").json()["data"]]
        for prompt, text in zip(PROMPTS, expected, strict=True):
            body = {"model": model, "prompt": prompt, "max_tokens": 12,
                    "temperature": 0}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == text
        # streamed, and n = 2 sampled: both finish with their max_tokens
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 8, "n": 2,
                "temperature": 1.0, "seed": 7, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            events = [json.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
        assert sorted(c["index"] for c in finished) == [0, 1]
        assert all(c["finish_reason"] == "length" for c in finished)
    # each request's TTFT less its worker's phases: what the router added
    text = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    [count] = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("pdserve:first_token_router_added_seconds_count")]
    assert count == len(PROMPTS) + 1
    steps = sum(int(w["sim"]["steps"]) for w in cluster.status()["workers"])
    assert steps > 0
    assert all(w["sim"]["kv_mismatches"] == "0" for w in cluster.status()["workers"])
