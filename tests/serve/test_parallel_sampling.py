"""n > 1 and best_of: the prompt is prefilled once and its blocks are forked to the choices.

Engine level: the fork shares every full prompt block (reference counts; the integrity check
holds), gives each child its own copy of the partial block, and frees everything on finish
and abort. What must match, and why:
  * seeded: child i draws with seed + i (vLLM's rule) from the same logits a separate request
    with that seed computes (the forked KV is the same prompt's KV), so child i's tokens equal
    an n = 1 request seeded seed + i, token for token;
  * greedy: every child takes the argmax of the same logits: n identical choices, equal to
    the n = 1 greedy output;
  * prefill -> decode: the prefill engine samples the n first tokens, the decode engine loads
    the prompt once and forks; each choice equals the colocated run's choice.
Served (colocated and disaggregated, one cluster each): choices indexed 0..n-1, streaming and
not, usage over all choices, best_of, /status block counts showing the sharing, and a client
that disconnects mid-stream leaves nothing behind.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine_util import prefill_engine, run_to_completion
from transformers import AutoTokenizer

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.engine.request import RequestOutput
from pdserve.serve.engine.roles import make_role
from pdserve.serve.engine.scheduler import RequestRejectedError

BLOCK_SIZE = 8
PROMPT = list(range(5, 25))  # 20 tokens: 2 full blocks and a partial one of 4
SEEDED = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    configs = (ModelConfig(str(llama_dir)), CacheConfig(block_size=BLOCK_SIZE, num_blocks=64))
    made = {role: Engine(*configs, tokenizer=tokenizer, role=make_role(role))
            for role in ("colocated", "decode")}
    made["prefill"], made["saver"] = prefill_engine(*configs, tokenizer=tokenizer)
    yield made
    for role in ("colocated", "prefill", "decode"):
        made[role].shutdown()


def choices(outputs: list[RequestOutput]) -> dict[int, list[int]]:
    """One request's deltas -> choice index -> its tokens."""
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        for completion in out.outputs:
            tokens.setdefault(completion.index, []).extend(completion.token_ids)
    return tokens


def assert_empty(*engines: Engine) -> None:
    for engine in engines:
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_used_blocks == 0
        assert not engine.has_unfinished_requests()
        assert not engine.parallel.parents


def test_fork_shares_full_blocks_and_copies_the_partial_one(engines):
    engine = engines["colocated"]
    bm = engine.block_manager
    engine.add_request(PROMPT, SEEDED, "r")
    first = engine.step()  # the whole prompt: prefilled once, then forked
    assert [(out.request_id, out.outputs[0].index) for out in first] == [("r", i)
                                                                         for i in range(3)]
    children = [engine.scheduler.requests[f"{i}_r"] for i in range(3)]
    assert "r" not in engine.scheduler.requests
    tables = [bm.block_table(child.request_id) for child in children]
    shared = tables[0][:2]
    assert all(table[:2] == shared for table in tables)
    assert len({table[2] for table in tables}) == 3  # each its own copy of the partial block
    assert all(bm._blocks[b].ref_count == 3 for b in shared)
    assert bm.num_used_blocks == 2 + 3  # not 3 x 3
    bm.check_integrity()
    outputs = first + run_to_completion(engine)["r"]
    assert sorted(choices(outputs)) == [0, 1, 2]
    assert [out.finished for out in outputs].count(True) == 1 and outputs[-1].finished
    assert all(len(tokens) == 12 for tokens in choices(outputs).values())
    assert bm.max_num_used_blocks >= 5
    assert_empty(engine)


def test_seeded_children_equal_separate_requests_seeded_seed_plus_index(engines):
    engine = engines["colocated"]
    engine.add_request(PROMPT, SEEDED, "n3")
    got = choices(run_to_completion(engine)["n3"])
    for i in range(3):
        engine.add_request(PROMPT, SEEDED.for_child(i), f"single{i}")
    singles = run_to_completion(engine)
    assert {i: choices(singles[f"single{i}"])[0] for i in range(3)} == got
    assert len({tuple(tokens) for tokens in got.values()}) > 1  # the seeds differ
    engine.add_request(PROMPT, SEEDED, "again")
    assert choices(run_to_completion(engine)["again"]) == got  # reproducible
    assert_empty(engine)


def test_greedy_children_are_identical(engines):
    engine = engines["colocated"]
    greedy = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(PROMPT, greedy, "g3")
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       "g1")
    outputs = run_to_completion(engine)
    got = choices(outputs["g3"])
    assert got[0] == got[1] == got[2] == choices(outputs["g1"])[0]
    assert_empty(engine)


def test_abort_frees_every_child_and_the_parent(engines):
    engine = engines["colocated"]
    engine.add_request(PROMPT, SEEDED, "a")
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    final = engine.abort_request("a")
    assert final is not None and final.request_id == "a" and final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert_empty(engine)
    engine.add_request(PROMPT, SEEDED, "b")  # aborted before its prompt ran: never forks
    engine.abort_request("b")
    assert_empty(engine)
    assert engine.step() == []


def test_sequences_count_against_max_num_seqs(llama_dir):
    engine = Engine(ModelConfig(str(llama_dir)), CacheConfig(block_size=BLOCK_SIZE,
                                                             num_blocks=64),
                    scheduler_config=SchedulerConfig(max_num_seqs=4))
    try:
        with pytest.raises(RequestRejectedError, match="max_num_seqs"):
            engine.add_request(PROMPT, SamplingParams(n=5, max_tokens=4))
        engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4, ignore_eos=True), "x")
        engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=4, ignore_eos=True), "y")
        engine.step()
        assert len(engine.scheduler.running) == 3  # x's three; y waits for two seats
        assert [r.request_id for r in engine.scheduler.waiting] == ["y"]
        outputs = run_to_completion(engine)
        assert sorted(choices(outputs["y"])) == [0, 1]
        assert_empty(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=17), dict(n=3, best_of=2),
                                 dict(n=2, best_of=17)])
def test_bounds(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv-loaded", "recompute"])
def test_prefill_samples_all_first_tokens_and_decode_forks(engines, with_kv):
    colocated, prefill, decode = engines["colocated"], engines["prefill"], engines["decode"]
    saver = engines["saver"]
    colocated.add_request(PROMPT, SEEDED, "c")
    expected = choices(run_to_completion(colocated)["c"])
    prefill.add_request(PROMPT, SEEDED, "p")
    prefilled = run_to_completion(prefill)["p"]
    assert [out.outputs[0].index for out in prefilled] == [0, 1, 2]
    assert all(out.outputs[0].finish_reason == "handoff" for out in prefilled)
    handoff = prefilled[-1].kv_handoff
    assert handoff is not None and all(out.kv_handoff is None for out in prefilled[:-1])
    assert handoff.choice_first_tokens == {i: expected[i][0] for i in range(3)}
    assert len(handoff.block_keys) == 2  # the prompt's full blocks, saved once
    assert list(saver.blocks) == ["p"]
    blocks = saver.blocks.pop("p")
    given = {i: [token] for i, token in handoff.choice_first_tokens.items()}
    if with_kv:
        block_ids = decode.parallel.add_prefilled("d", PROMPT, SEEDED, given)
        decode.runner.write_kv_blocks(block_ids, [t[:, :len(block_ids)] for t in blocks])
    else:
        decode.parallel.add_continued("d", PROMPT, SEEDED, given)
    decoded = choices(run_to_completion(decode)["d"])
    assert {i: [handoff.choice_first_tokens[i]] + decoded[i] for i in range(3)} == expected
    assert_empty(colocated, prefill, decode)


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_a_migrated_parent_resumes_each_choice_after_its_own_outputs(engines, role):
    """A worker died after streaming outputs of an n = 3 seeded request: another one, given
    each unfinished choice's tokens so far (resume_choices), prefills the prompt once, forks,
    and every choice continues exactly as the undisturbed run did; an ended choice stays
    ended."""
    colocated, target = engines["colocated"], engines[role]
    params = dataclasses.replace(SEEDED, max_tokens=8)
    colocated.add_request(PROMPT, params, "whole")
    expected = choices(run_to_completion(colocated)["whole"])
    given = {0: expected[0][:3], 2: expected[2][:5]}  # choice 1 had ended: not resumed
    target.parallel.add_continued("moved", PROMPT, params, given)
    resumed = choices(run_to_completion(target)["moved"])
    assert sorted(resumed) == [0, 2]
    assert {i: given[i] + resumed[i] for i in (0, 2)} == {i: expected[i] for i in (0, 2)}
    assert_empty(colocated, target)


def test_a_parent_with_a_loaded_prefix_forks_too(engines):
    """A prefill worker that loads a prompt's prefix from the store admits the parent with
    add_request_with_prefix: it must fork all the same."""
    prefill, saver = engines["prefill"], engines["saver"]
    request = prefill.make_request(PROMPT, SEEDED, "pl")
    block_ids = prefill.add_request_with_prefix(request, 2 * BLOCK_SIZE)
    prefill.runner.write_kv_blocks(block_ids, engines["colocated"].runner.read_kv_blocks(
        block_ids))  # any KV: only the structure is checked here
    outputs = run_to_completion(prefill)["pl"]
    assert [out.outputs[0].index for out in outputs] == [0, 1, 2]
    assert sorted(outputs[-1].kv_handoff.choice_first_tokens) == [0, 1, 2]
    saver.blocks.pop("pl")
    assert_empty(prefill)


def test_choices_that_end_at_their_first_token_are_not_handed_off(engines):
    prefill = engines["prefill"]
    params = SamplingParams(n=2, temperature=0, max_tokens=1)
    prefill.add_request(PROMPT, params, "short")
    outputs = run_to_completion(prefill)["short"]
    assert [out.outputs[0].finish_reason for out in outputs] == ["length", "length"]
    assert all(out.kv_handoff is None for out in outputs) and outputs[-1].finished
    assert not engines["saver"].blocks
    assert_empty(prefill)


# ---- served: colocated and disaggregated, one cluster each ----------------------------------
SERVED_BLOCK_SIZE = 16  # the workers' default
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(20 * SERVED_BLOCK_SIZE + 4)]  # 20 full + 4


@pytest.fixture(scope="module", params=["colocated", "disagg"])
def cluster(request, llama_dir, tmp_path_factory):
    from helpers.cluster_util import start_cluster

    cluster = start_cluster(llama_dir, tmp_path_factory.mktemp("ps-logs"), "--mode",
                            request.param, "--num-kv-blocks", "256")
    yield cluster
    assert cluster.stop() == 0, cluster.log()


@pytest.fixture
def served(cluster):
    """The cluster's URL; after the test every worker is idle with all blocks free, and no
    store lease or pin is left."""
    yield cluster.base_url
    cluster.assert_nothing_leaked(
        with_store=any(w["role"] == "prefill" for w in cluster.status()["workers"]))


def _post(url: str, path: str, body: dict, status: int = 200) -> dict:
    import httpx

    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _stream(url: str, path: str, body: dict, max_chunks: int | None = None) -> list[dict]:
    """The stream's JSON chunks; with max_chunks, hang up after that many."""
    import json

    import httpx

    chunks: list[dict] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
                assert "error" not in chunks[-1], chunks[-1]
                if max_chunks is not None and len(chunks) == max_chunks:
                    break
    return chunks


SAMPLED = {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0.9, "seed": 42,
           "ignore_eos": True}


def test_served_n3_choices_equal_separate_seeded_requests(served):
    body = _post(served, "/v1/completions", {**SAMPLED, "n": 3})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    usage = body["usage"]
    assert usage["completion_tokens"] == 3 * 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 24
    for i, choice in enumerate(body["choices"]):
        single = _post(served, "/v1/completions", {**SAMPLED, "seed": 42 + i})
        assert single["choices"][0]["text"] == choice["text"]
        assert choice["finish_reason"] == "length"


def test_served_n3_stream_equals_non_stream(served):
    request = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
               "temperature": 1.0, "seed": 7, "n": 3, "ignore_eos": True}
    whole = _post(served, "/v1/chat/completions", request)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    chunks = _stream(served, "/v1/chat/completions",
                     {**request, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + \
                choice["delta"].get("content", "")
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 18


def test_served_best_of_returns_the_most_likely(served):
    request = {**SAMPLED, "logprobs": 0}
    four = _post(served, "/v1/completions", {**request, "n": 4})["choices"]
    best = _post(served, "/v1/completions", {**request, "n": 2, "best_of": 4})

    def cumulative(choice: dict) -> float:
        return sum(choice["logprobs"]["token_logprobs"])

    ranked = sorted(four, key=cumulative, reverse=True)[:2]
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == 4 * 8  # every generated sequence
    hidden = _post(served, "/v1/completions", {**SAMPLED, "n": 2, "best_of": 4})
    assert [c["text"] for c in hidden["choices"]] == [c["text"] for c in ranked]
    assert all(c["logprobs"] is None for c in hidden["choices"])  # not asked for


def test_served_greedy_choices_are_identical(served):
    body = _post(served, "/v1/completions", {"prompt": "import os", "max_tokens": 6,
                                              "temperature": 0, "n": 3})
    assert len({c["text"] for c in body["choices"]}) == 1


@pytest.mark.parametrize("bad", [{"n": 17}, {"n": 2, "best_of": 1}, {"best_of": 17},
                                 {"n": 1, "best_of": 2, "stream": True}])
def test_served_bounds_are_400s(served, bad):
    body = _post(served, "/v1/completions", {**SAMPLED, **bad}, status=400)
    assert body["error"]["type"] == "BadRequestError"


def test_served_status_shows_the_prompt_blocks_shared(served, cluster):
    from helpers.cluster_util import wait_until

    _post(served, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 8, "n": 3,
                                      "temperature": 1.0, "ignore_eos": True})
    num_prompt_blocks = len(LONG_PROMPT) // SERVED_BLOCK_SIZE + 1  # 20 full + a partial

    def peaks() -> list[int]:
        return [w["max_num_used_blocks"] for w in cluster.status()["workers"]]

    assert wait_until(lambda: min(peaks()) >= num_prompt_blocks, 10), peaks()
    # shared: ~P + 3 x (output blocks) (+ the parent's partial block while it forks);
    # 3 separate prompts would need 3 x 21 = 63
    assert max(peaks()) <= num_prompt_blocks + 3 + 1, peaks()


def test_served_disconnect_mid_stream_frees_everything(served):
    chunks = _stream(served, "/v1/completions",
                     {"prompt": "class Config:", "max_tokens": 200, "temperature": 1.0,
                      "n": 3, "ignore_eos": True}, max_chunks=4)
    assert len(chunks) == 4  # the `served` fixture then checks every block and lease freed


def test_llm_generate_n_and_best_of(llama_dir):
    from pdserve.serve import LLM

    common = dict(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    with LLM(str(llama_dir), num_kv_blocks=64) as llm:
        [four] = llm.generate([PROMPT], SamplingParams(n=4, logprobs=0, **common))
        [best] = llm.generate([PROMPT], SamplingParams(n=2, best_of=4, **common))
    assert [out.index for out in four.outputs] == [0, 1, 2, 3]
    ranked = sorted(four.outputs, key=lambda out: -out.cumulative_logprob)[:2]
    assert [out.token_ids for out in best.outputs] == [out.token_ids for out in ranked]
    assert [out.index for out in best.outputs] == [0, 1]
    assert all(out.logprobs is None for out in best.outputs)


def test_each_child_has_its_own_grammar(engines):
    """Structured outputs: every child gets its own matcher (pdserve/serve/engine/structured.py
    rebuilds it by replaying the child's outputs), so every choice matches the grammar."""
    from pdserve.protocol.sampling import StructuredOutputs

    engine = engines["colocated"]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16,
                            structured_outputs=StructuredOutputs(choice=("yes", "no", "maybe")))
    engine.add_request(PROMPT, params, "s")
    outputs = run_to_completion(engine)["s"]
    texts: dict[int, str] = {}
    for out in outputs:
        texts[out.outputs[0].index] = texts.get(out.outputs[0].index, "") + out.outputs[0].text
    assert sorted(texts) == [0, 1, 2, 3]
    assert all(text in ("yes", "no", "maybe") for text in texts.values()), texts
    assert_empty(engine)


def test_children_without_a_block_at_the_fork_wait_and_still_match(engines, llama_dir):
    """A pool of 4 blocks: the prompt takes 3; at the fork only one child gets its copy of
    the partial block, the others wait (preempted, with their first token) and recompute
    later from the cached prompt blocks; seeded, every child still equals its separate run."""
    small = Engine(ModelConfig(str(llama_dir)), CacheConfig(block_size=BLOCK_SIZE,
                                                            num_blocks=4))
    try:
        small.add_request(PROMPT, SEEDED, "tight")
        first = small.step()
        assert [out.outputs[0].index for out in first] == [0, 1, 2]
        assert len(small.scheduler.running) == 1 and len(small.scheduler.waiting) == 2
        small.block_manager.check_integrity()
        got = choices(first + run_to_completion(small)["tight"])
        assert_empty(small)
    finally:
        small.shutdown()
    reference = engines["colocated"]
    for i in range(3):
        reference.add_request(PROMPT, SEEDED.for_child(i), f"ref{i}")
    singles = run_to_completion(reference)
    assert got == {i: choices(singles[f"ref{i}"])[0] for i in range(3)}
    assert_empty(reference)


def test_wire_fields_default_for_old_peers_and_are_checked():
    import msgpack

    from pdserve.protocol.worker import WORKER_PROTOCOL, GenerateRequest, KVHandoff, Output

    old = msgpack.packb({"type": "output", "request_id": "r", "token_ids": [1], "text": "x",
                         "handoff": {"block_keys": [], "first_token_id": 1}})
    decoded = WORKER_PROTOCOL.decode(old)  # a peer that predates n > 1
    assert decoded.index == 0 and decoded.handoff.choice_first_tokens == {}
    handoff = KVHandoff([], 5, choice_first_tokens={0: 5, 2: 9})
    request = GenerateRequest("r", [1, 2], SamplingParams(n=3, max_tokens=4), handoff=handoff)
    assert request.choice_indices == [0, 2]
    assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(request)) == request
    assert GenerateRequest("r", [1], SamplingParams(n=2, best_of=3, max_tokens=4)
                           ).choice_indices == [0, 1, 2]
    with pytest.raises(ValueError, match="resumes by choice"):
        GenerateRequest("r", [1], SamplingParams(n=2, max_tokens=4), resume_output_ids=[3])
    resumed = GenerateRequest("r", [1], SamplingParams(n=3, max_tokens=4),
                              resume_choices={0: [3], 2: [4, 5]})
    assert resumed.choice_indices == [0, 2]
    assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(resumed)) == resumed
    for bad in ({3: [1]}, {0: []}, {0: [1, 2, 3, 4]}):  # past n, no outputs, no room left
        with pytest.raises(ValueError, match="resume_choices"):
            GenerateRequest("r", [1], SamplingParams(n=3, max_tokens=4), resume_choices=bad)
    with pytest.raises(ValueError, match="migration's alone"):
        GenerateRequest("r", [1], SamplingParams(n=3, max_tokens=4), handoff=handoff,
                        resume_choices={0: [3]})
    with pytest.raises(ValueError):
        Output("r", [], "", index=16)


# ---- the router's side of migration, over scripted workers (no cluster) ---------------------
def _scripted_router(llama_dir, monkeypatch, scripts: dict[str, list[list]]):
    """A TestClient of the real router app (1 prefill, 2 decode workers) whose workers answer
    each request with the next script of their role: Outputs, or an exception (it died)."""
    import asyncio
    import dataclasses
    import time

    from fastapi.testclient import TestClient

    from pdserve.protocol.worker import WorkerStatus
    from pdserve.router.app import build_app
    from pdserve.router.config import RouterConfig
    from pdserve.router.worker_client import Received, WorkerClient

    class ScriptedWorker(WorkerClient):
        def start(self) -> None:
            self.status = WorkerStatus(f"{self.role}-{self.address[-1]}", self.role, "m", 256,
                                       True, 0, 0, 64, 64, 16, max_num_seqs=8)
            self.last_seen_s = time.monotonic() + 3600

        async def generate(self, request):
            queue: asyncio.Queue = asyncio.Queue()
            self._queues[request.request_id] = queue
            self._reservations.pop(request.request_id, None)
            self.sent = [*getattr(self, "sent", []), request]
            for item in scripts[self.role].pop(0):
                queue.put_nowait(item if isinstance(item, BaseException) else Received(
                    dataclasses.replace(item, request_id=request.request_id),
                    time.monotonic()))
            return queue

        async def abort(self, request_id: str) -> None:
            self.finish(request_id)
            self.aborted = [*getattr(self, "aborted", []), request_id]

    monkeypatch.setattr("pdserve.router.dispatch.WorkerClient", ScriptedWorker)
    app = build_app(RouterConfig(model=str(llama_dir), prefill_addrs=("tcp://127.0.0.1:1",),
                                 decode_addrs=("tcp://127.0.0.1:2", "tcp://127.0.0.1:3")))
    return TestClient(app), app.state.serving.dispatcher


def _prefill_handoff_script() -> list:
    from pdserve.protocol.worker import KVHandoff, Output

    handoff = KVHandoff([bytes(32)], 5, choice_first_tokens={0: 5, 1: 6})
    return [Output("", [5], "a", "handoff", num_prompt_tokens=4, index=0),
            Output("", [6], "b", "handoff", num_prompt_tokens=4, handoff=handoff, index=1)]


@pytest.mark.parametrize("after_outputs", [False, True], ids=["before", "after"])
def test_router_moves_a_parent_before_and_after_its_outputs(llama_dir, monkeypatch,
                                                            after_outputs):
    from pdserve.protocol.worker import Output
    from pdserve.router.worker_client import WorkerDied

    died = [Output("", [7], "c", index=1)] if after_outputs else []
    finish = [Output("", [8], "d", "length", index=0), Output("", [9], "e", "length", index=1)]
    scripts = {"prefill": [_prefill_handoff_script()],
               "decode": [[*died, WorkerDied("decode died")], finish]}
    client, dispatcher = _scripted_router(llama_dir, monkeypatch, scripts)
    with client:
        r = client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 3})
    assert r.status_code == 200, r.text
    moved = [w for w in dispatcher.decode if getattr(w, "sent", None)]
    assert len(moved) == 2
    if after_outputs:  # choice 1 had streamed [6, 7]: each choice resumes after its own
        assert [c["text"] for c in r.json()["choices"]] == ["ad", "bce"]
        [again] = [w.sent[0] for w in moved if w.sent[0].resume_choices]
        assert again.handoff is None and again.resume_choices == {0: [5], 1: [6, 7]}
    else:
        assert [c["text"] for c in r.json()["choices"]] == ["ad", "be"]
        assert r.json()["usage"]["completion_tokens"] == 4
        assert moved[1].sent[0].handoff.choice_first_tokens == {0: 5, 1: 6}
    assert all(w.num_inflight == 0 for w in dispatcher.workers)  # nothing held anywhere


def test_router_continues_only_the_choices_prefill_handed_off(llama_dir, monkeypatch):
    from pdserve.protocol.worker import KVHandoff, Output

    handoff = KVHandoff([bytes(32)], 6, choice_first_tokens={1: 6})
    scripts = {"prefill": [[Output("", [5], "a", "stop", num_prompt_tokens=4, index=0),
                            Output("", [6], "b", "handoff", num_prompt_tokens=4,
                                   handoff=handoff, index=1)]],
               "decode": [[Output("", [8], "d", "length", index=1)]]}
    client, dispatcher = _scripted_router(llama_dir, monkeypatch, scripts)
    with client:
        r = client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [(c["index"], c["text"], c["finish_reason"]) for c in r.json()["choices"]] == \
        [(0, "a", "stop"), (1, "bd", "length")]
    [decode_request] = [w for w in dispatcher.decode if getattr(w, "sent", None)][0].sent
    assert decode_request.choice_indices == [1]


def test_prompt_logprobs_go_out_once(engines):
    engine = engines["colocated"]
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=2, prompt_logprobs=1), "pl")
    outputs = run_to_completion(engine)["pl"]
    carrying = [out for out in outputs if out.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0].outputs[0].index == 0
    assert len(carrying[0].prompt_logprobs) == len(PROMPT)
    assert all(entry is not None for entry in carrying[0].prompt_logprobs[1:])
    assert_empty(engine)
