"""The API extras users expect from vLLM: logit_bias / allowed_token_ids / bad_words,
prompt_logprobs (against Hugging Face's log-softmax of the prompt, chunked prefill and a
prefix-cached prompt included), completions echo (stream and not), /tokenize, /detokenize and
/version, and their errors (OpenAI bodies). Engine-level checks run offline; the HTTP ones run
on the router over stand-in workers, and end to end through `pdserve up` in colocated and
disaggregated mode (where prefill computes the prompt logprobs)."""

from __future__ import annotations

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from helpers.cluster_util import stream_chunks
from helpers.model_util import hf_logits, load_hf, random_prompts
from helpers.router_util import StandInDispatcher, router_config
from transformers import AutoTokenizer

import pdserve
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.router.app import build_app
from pdserve.serve import LLM, SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.engine import prompt_logprobs
from pdserve.serve.engine.logit_controls import banned_now
from pdserve.serve.engine.request import Request
from pdserve.serve.executor import rank as executor_rank
from pdserve.serve.executor.model_runner import ModelRunner

LOGPROB_TOLERANCE = 1e-4
"""fp32 model on both sides; the engine's paged attention sums in another order than HF's
(measured differences ~6e-6)."""
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"


def _reference(hf, prompt_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: HF's log-probabilities of each prompt token's successor."""
    return torch.log_softmax(hf_logits(hf, prompt_ids), dim=-1)[:-1]


def _assert_prompt_logprobs(entries, prompt_ids, reference, num_top: int) -> None:
    """vLLM's shape: [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...], each equal
    to HF's log-softmax (the prompt token and the top num_top)."""
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for i, entry in enumerate(entries[1:], 1):
        expected = reference[i - 1]
        token = prompt_ids[i]
        got = {int(t): v for t, v in entry.items()}
        assert abs(got[token]["logprob"] - expected[token].item()) < LOGPROB_TOLERANCE
        assert got[token]["rank"] == int((expected > expected[token]).sum()) + 1
        top_ids = expected.topk(num_top).indices.tolist()
        assert set(top_ids) <= set(got) and len(got) <= num_top + 1
        for rank, t in enumerate(top_ids, 1):
            assert abs(got[t]["logprob"] - expected[t].item()) < LOGPROB_TOLERANCE
            assert got[t]["rank"] == rank


# ---- engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(llama_dir):
    # A small token budget: a 70-token prompt runs as chunked prefill (3 chunks)
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_num_batched_tokens=32)
    yield llm
    llm.shutdown()


def test_prompt_logprobs_match_hf_chunked_and_cached(llm, llama_dir) -> None:
    hf = load_hf(llama_dir)
    (prompt,) = random_prompts([70], 1000, seed=3)
    reference = _reference(hf, prompt)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    for _ in range(2):  # the prompt's blocks are in the prefix cache now: not used
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2,
                                                    prompt_logprobs=3))[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        entries = [None if e is None else {t: {"logprob": lp.logprob, "rank": lp.rank}
                                           for t, lp in e.items()}
                   for e in out.prompt_logprobs]
        _assert_prompt_logprobs(entries, prompt, reference, 3)
    after = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0]
    assert after.num_cached_tokens > 0 and after.prompt_logprobs is None
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logit_controls_force_and_ban_tokens(llm) -> None:
    (prompt,) = random_prompts([20], 1000, seed=4)

    def greedy(**controls) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **controls)
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    base = greedy()
    assert greedy(logit_bias={17: 100}) == [17] * 4
    banned = greedy(logit_bias={base[0]: -100})
    assert banned[0] != base[0]
    assert set(greedy(allowed_token_ids=[5, 9])) <= {5, 9}
    # bad_words: a word is banned as it starts the text and after a space (vLLM's two forms)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode([t]) for t in base]
    assert texts[0].strip() and greedy(bad_words=[texts[0]])[0] != base[0]
    spaced = next(i for i, text in enumerate(texts) if text.startswith(" ") and text.strip())
    out = greedy(bad_words=[texts[spaced].strip()])
    assert out[:spaced] == base[:spaced] and out[spaced] != base[spaced]
    # an unbiased request in the same batch is untouched
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True, logit_bias={17: 100}),
                                           SamplingParams(temperature=0, max_tokens=4,
                                                          ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == [17] * 4 and outs[1].outputs[0].token_ids == base
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))


def test_prompt_logit_rows_follow_the_sampling_rows_at_tp1_and_tp2(llama_dir,
                                                                    monkeypatch) -> None:
    """The runner's rows: each sampling chunk's last, then each chunk's prompt rows; TP=2's
    other rank computes the same rows (its lm_head takes part), and they equal TP=1's, and
    TP=1's computed in slices of 4 rows."""
    hf = load_hf(llama_dir)
    (prompt,) = random_prompts([12], 1000, seed=5)
    step = StepInput([SeqChunk("a", prompt, 0, [3, 1], False, num_prompt_logits=11),
                      SeqChunk("b", prompt[:5], 0, [6], True, num_prompt_logits=4)])

    def run(tp: int) -> torch.Tensor:
        with ModelRunner(ModelConfig(str(llama_dir)), CacheConfig(block_size=8, num_blocks=16),
                         ParallelConfig(tensor_parallel_size=tp, device="cpu")) as runner:
            return runner.execute(step)

    one, two = run(1), run(2)
    monkeypatch.setattr(executor_rank, "LOGITS_ROWS_PER_CALL", 4)
    torch.testing.assert_close(run(1), one, atol=1e-5, rtol=0)
    reference = hf_logits(hf, prompt)
    assert one.shape[0] == 1 + 11 + 4
    torch.testing.assert_close(one[0], reference[4], atol=1e-4, rtol=0)  # b samples
    torch.testing.assert_close(one[1:12], reference[:11], atol=1e-4, rtol=0)
    torch.testing.assert_close(one[12:], reference[:4], atol=1e-4, rtol=0)
    torch.testing.assert_close(two, one, atol=1e-4, rtol=0)


def test_prompt_rows_recorded_by_position_in_slices(monkeypatch) -> None:
    """A second chunk's prompt rows fill the entries after the first's, sliced or not; its
    sampling row is left for the sampler."""
    request = Request("r", list(range(10)), SamplingParams(prompt_logprobs=2), 5)
    prompt_logprobs.start_prompt_logprobs(request)
    logits = torch.randn(1 + 5, 50)  # chunk [4, 10): its sampling row, then 5 prompt rows
    step = StepInput([SeqChunk("r", list(range(4, 10)), 4, [0], True, num_prompt_logits=5)])
    expected = prompt_logprobs.prompt_entries(logits[1:], list(range(5, 10)), 2)
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 2)
    sampling_rows = prompt_logprobs.record_prompt_logprobs([(request, 6)], step, logits, 1)
    assert torch.equal(sampling_rows, logits[:1])
    assert request.prompt_logprobs[:5] == [None] * 5 and request.prompt_logprobs[5:] == expected
    assert all(len(entry) <= 3 for entry in expected)  # the token and the top 2


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    words = [[5], [7, 8, 9]]
    assert banned_now(words, []) == [5]
    assert banned_now(words, [1, 7]) == [5]
    assert banned_now(words, [1, 7, 8]) == [5, 9]


# ---- the router over stand-in workers ----------------------------------------------------
@pytest.fixture(scope="module")
def router(llama_dir):
    config = router_config(llama_dir, api_key="k")
    dispatcher = StandInDispatcher(config)
    with TestClient(build_app(config, dispatcher),
                    headers={"Authorization": "Bearer k"}) as client:
        yield client, dispatcher


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error


def test_tokenize_round_trips_through_detokenize(router, llama_dir) -> None:
    client, _ = router
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    r = client.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(TEXT).input_ids and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] > 0
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(body["tokens"])
    assert TEXT in r.json()["prompt"]
    # chat: the template's prompt, exactly what /v1/chat/completions sends
    r = client.post("/tokenize", json={"messages": MESSAGES})
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert r.json()["token_strs"] is None
    r = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.json()["prompt"] == rendered


def test_version_and_api_key(router) -> None:
    client, _ = router
    assert client.get("/version").json() == {"version": pdserve.__version__}
    for method, path, body in (("GET", "/version", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [1]})):
        r = client.request(method, path, json=body, headers={"Authorization": "Bearer no"})
        _assert_error(r, 401)


def test_errors_are_openai_bodies(router) -> None:
    client, dispatcher = router
    num_sent = len(dispatcher.sent)
    _assert_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")
    _assert_error(client.post("/detokenize", json={"tokens": [1], "model": "nope"}), 404)
    _assert_error(client.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    _assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400)
    _assert_error(client.post("/tokenize", json={}), 400)
    _assert_error(client.post("/tokenize", json={"messages": MESSAGES,
                                                 "continue_final_message": True}), 400)
    completion = {"prompt": "hi", "max_tokens": 1}
    for extra, param in (({"logit_bias": {"1000000": 5}}, "logit_bias"),
                         ({"logit_bias": {"abc": 5}}, "logit_bias"),
                         ({"allowed_token_ids": [1, 10**7]}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs"),
                         ({"prompt_logprobs": 1, "stream": True}, None)):
        for path, body in (("/v1/completions", completion),
                           (CHAT, {"messages": MESSAGES, "max_tokens": 1})):
            _assert_error(client.post(path, json={**body, **extra}), 400, param)
    _assert_error(client.post("/v1/completions", json={**completion,
                                                       "allowed_token_ids": []}), 400)
    assert len(dispatcher.sent) == num_sent  # nothing refused reached a worker


def test_controls_reach_the_workers(router) -> None:
    client, dispatcher = router
    r = client.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 500, "6": -3},
        "allowed_token_ids": [5, 6], "bad_words": ["no"], "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    sent = dispatcher.sent[-1]
    assert sent.logit_bias == {5: 100.0, 6: -3.0}  # clamped to [-100, 100], as vLLM
    assert sent.allowed_token_ids == (5, 6) and sent.bad_words == ("no",)
    assert sent.prompt_logprobs == 2
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "echo": True,
                                             "logprobs": 1})
    assert r.json()["choices"][0]["text"] == "hix"
    assert dispatcher.sent[-1].prompt_logprobs == 1  # echo + logprobs: the prompt's too
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == "hi"  # the prompt alone
    assert dispatcher.sent[-1].max_tokens == 1
    _assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}), 400)


# ---- end to end --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(served_cluster):
    """The shared `pdserve up` (conftest.served_cluster), colocated and disaggregated."""
    return served_cluster


def _post(cluster, path: str, body: dict) -> dict:
    r = httpx.post(f"{cluster.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_served_prompt_logprobs_match_hf(cluster, llama_dir) -> None:
    hf = load_hf(llama_dir)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompt = TEXT * 3  # several blocks: the second request finds them cached
    prompt_ids = _post(cluster, "/tokenize", {"prompt": prompt})["tokens"]
    reference = _reference(hf, prompt_ids)
    _post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 1})  # caches them
    body = _post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                              "temperature": 0, "prompt_logprobs": 2})
    _assert_prompt_logprobs(body["choices"][0]["prompt_logprobs"], prompt_ids, reference, 2)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed it all
    entry = body["choices"][0]["prompt_logprobs"][1][str(prompt_ids[1])]
    assert entry["decoded_token"] == tokenizer.decode([prompt_ids[1]])
    # chat: on the body, over the template's prompt
    chat_ids = _post(cluster, "/tokenize", {"messages": MESSAGES})["tokens"]
    body = _post(cluster, CHAT, {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0})
    _assert_prompt_logprobs(body["prompt_logprobs"], chat_ids, _reference(hf, chat_ids), 0)


def test_served_echo_stream_and_not(cluster, llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    request = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    body = _post(cluster, "/v1/completions", request)
    plain = _post(cluster, "/v1/completions", {**request, "echo": False})
    choice, prompt_ids = body["choices"][0], tokenizer(TEXT).input_ids
    assert choice["text"] == TEXT + plain["choices"][0]["text"]
    assert body["usage"] == {**plain["usage"], "prompt_tokens_details":
                             body["usage"]["prompt_tokens_details"]}
    logprobs = choice["logprobs"]
    num_prompt = len(prompt_ids)
    assert len(logprobs["tokens"]) == num_prompt + len(plain["choices"][0]["logprobs"]["tokens"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    assert logprobs["tokens"][num_prompt:] == plain["choices"][0]["logprobs"]["tokens"]
    # a token-id prompt echoes its decoded text
    body = _post(cluster, "/v1/completions", {**request, "prompt": prompt_ids, "logprobs": None})
    assert body["choices"][0]["text"] == tokenizer.decode(prompt_ids) + \
        plain["choices"][0]["text"] and body["choices"][0]["logprobs"] is None
    # max_tokens=0: the prompt alone, with its logprobs
    body = _post(cluster, "/v1/completions", {**request, "max_tokens": 0})
    assert body["choices"][0]["text"] == TEXT
    assert body["choices"][0]["logprobs"]["token_logprobs"][1:] == \
        logprobs["token_logprobs"][1:num_prompt]
    # streamed: the prompt opens the first chunk; the whole text is the same
    chunks = stream_chunks(cluster.base_url, "/v1/completions", request)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0].startswith(TEXT) and "".join(texts) == choice["text"]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) > num_prompt


def test_served_logit_bias_and_tokenize(cluster) -> None:
    ids = _post(cluster, "/tokenize", {"prompt": TEXT})["tokens"]
    body = _post(cluster, "/v1/completions", {"prompt": ids, "max_tokens": 3,
                                              "temperature": 0, "ignore_eos": True,
                                              "logit_bias": {"42": 100}})
    assert body["usage"]["prompt_tokens"] == len(ids)
    completion_ids = _post(cluster, "/tokenize", {"prompt": body["choices"][0]["text"],
                                                  "add_special_tokens": False})["tokens"]
    assert completion_ids == [42] * 3 or body["choices"][0]["text"] == \
        _post(cluster, "/detokenize", {"tokens": [42] * 3})["prompt"]
