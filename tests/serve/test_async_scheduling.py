"""Async scheduling (pdserve/serve/engine/overlap.py) gives the synchronous engine's outputs.

The engine schedules and launches step N+1 before step N's tokens reach the host; on CPU the
launched step runs on the step thread. Compared with the synchronous engine over the same
requests: greedy and seeded tokens, logprobs, finish reasons and text are equal, including
requests that stop mid-batch (a stop id: the row computed after the stop is dropped), requests
the steps cannot run ahead for (penalties, n > 1, JSON schema: they wait for the step in
flight), preemption on a small pool, and an abort while a step is in flight. Every run ends
with the pool whole: every block free or cached, nothing pending.
"""

from __future__ import annotations

import json

import pytest
from helpers.model_util import random_prompts

from pdserve.protocol.sampling import SamplingParams, StructuredOutputs
from pdserve.serve import LLM

VOCAB = 1000
PROMPTS = random_prompts([9, 17, 4, 30, 12, 21, 7, 40], vocab_size=VOCAB, seed=5)
PLAIN = [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9, seed=3),
    dict(temperature=1.0, top_k=5, seed=11),
    dict(temperature=0, logit_bias={7: 2.0}, logprobs=3),
    dict(temperature=0.7, min_p=0.1, seed=1),
    dict(temperature=0, min_tokens=8, max_tokens=9),
    dict(temperature=0.9, seed=4, logprobs=2),
    dict(temperature=0, max_tokens=5),
]


def params_of(options: dict) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 14, "ignore_eos": True, **options})


def run(model_dir, prompts, params, async_scheduling: bool, preempted: list | None = None,
        **kwargs):
    """(outputs, number of steps launched ahead) of one LLM run; the pool checked whole.
    `preempted`: a list the run's preemption count is appended to."""
    with LLM(model_dir, block_size=8, device="cpu", async_scheduling=async_scheduling,
             **{"num_kv_blocks": 128, **kwargs}) as llm:
        outputs = llm.generate(prompts, params)
        engine = llm.engine
        launched = engine.overlap.num_launched if engine.overlap is not None else 0
        assert (engine.overlap is not None) == async_scheduling
        if preempted is not None:
            preempted.append(engine.scheduler.num_preemptions)
        assert_idle(engine)
    return outputs, launched


def assert_idle(engine) -> None:
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks  # free or evictable: nothing held
    assert not engine.scheduler.requests


def summary(outputs) -> list:
    rows = []
    for output in outputs:
        for choice in output.outputs:
            logprobs = None if choice.logprobs is None else [
                {t: round(lp.logprob, 4) for t, lp in entry.items()} for entry in choice.logprobs]
            rows.append((choice.index, choice.token_ids, choice.text, choice.finish_reason,
                         choice.stop_reason, logprobs))
    return rows


def test_plain_requests_run_ahead_with_the_synchronous_tokens(llama_dir) -> None:
    params = [params_of(o) for o in PLAIN]
    expected, _ = run(llama_dir, PROMPTS, params, async_scheduling=False)
    got, launched = run(llama_dir, PROMPTS, params, async_scheduling=True)
    assert summary(got) == summary(expected)
    assert launched > 10  # the steps did run ahead


def test_a_request_that_stops_mid_batch_drops_the_row_computed_after(llama_dir) -> None:
    """Each request stops on a token id it samples part-way (taken from a first run): the
    engine learns it only after the next step was launched with that request in it."""
    base = [params_of(o) for o in PLAIN]
    first, _ = run(llama_dir, PROMPTS, base, async_scheduling=False)
    params = [params_of({**o, "stop_token_ids": [out.outputs[0].token_ids[3]]})
              for o, out in zip(PLAIN, first, strict=True)]
    expected, _ = run(llama_dir, PROMPTS, params, async_scheduling=False)
    got, _ = run(llama_dir, PROMPTS, params, async_scheduling=True)
    assert summary(got) == summary(expected)
    assert sum(o.outputs[0].finish_reason == "stop" for o in got) >= 4


def test_requests_that_cannot_run_ahead_wait_for_the_step_in_flight(llama_dir) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    # shorter than the plain ones: once they are done, the rest runs ahead again
    options = PLAIN[:4] + [
        dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=8),
        dict(temperature=0.8, seed=9, n=2, max_tokens=6),
        dict(temperature=0, structured_outputs=StructuredOutputs(json=json.dumps(schema)),
             ignore_eos=False, max_tokens=7),
        dict(temperature=0.6, seed=2, presence_penalty=0.4, max_tokens=5),
    ]
    params = [params_of(o) for o in options]
    expected, _ = run(llama_dir, PROMPTS, params, async_scheduling=False)
    got, launched = run(llama_dir, PROMPTS, params, async_scheduling=True)
    assert summary(got) == summary(expected)
    assert launched > 0


def test_preemption_on_a_small_pool_keeps_the_tokens(llama_dir) -> None:
    params = [params_of({**o, "max_tokens": 24}) for o in PLAIN]
    preempted: list[int] = []
    expected, _ = run(llama_dir, PROMPTS, params, async_scheduling=False, num_kv_blocks=24)
    got, launched = run(llama_dir, PROMPTS, params, async_scheduling=True, num_kv_blocks=24,
                        preempted=preempted)
    assert summary(got) == summary(expected)
    assert launched > 0 and preempted[0] > 0


def test_an_abort_while_a_step_is_in_flight_frees_everything(llama_dir) -> None:
    with LLM(llama_dir, block_size=8, num_kv_blocks=128, device="cpu",
             async_scheduling=True) as llm:
        engine = llm.engine
        for prompt in PROMPTS[:4]:
            engine.add_request(prompt, params_of({"max_tokens": 30}))
        ids = list(engine.scheduler.requests)
        for _ in range(6):
            engine.step()
        assert engine.overlap.in_flight is not None
        victim = engine.scheduler.requests[ids[1]]
        assert victim in engine.overlap.in_flight.to_sample
        final = engine.abort_request(ids[1])
        assert final is not None and final.outputs[0].finish_reason == "abort"
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.request_id != ids[1]  # nothing after its abort
                finished[output.request_id] = output.finished
        assert finished == {ids[0]: True, ids[2]: True, ids[3]: True}
        assert victim.num_pending_tokens == 0
        assert_idle(engine)


def test_async_scheduling_follows_the_setting(llama_dir, monkeypatch) -> None:
    """None (the default) is off on CPU, decided by Overlap.build like any other setting (the
    engine asks it whatever the setting: None is on for one CUDA device, below)."""
    from pdserve.serve.engine.overlap import Overlap

    asked = []
    build = Overlap.build.__func__
    monkeypatch.setattr(Overlap, "build", classmethod(
        lambda cls, engine: asked.append(engine.scheduler_config.async_scheduling)
        or build(cls, engine)))
    with LLM(llama_dir, num_kv_blocks=16, device="cpu") as llm:
        assert llm.engine.overlap is None
    assert asked == [None]


@pytest.mark.parametrize(("device", "setting", "tp", "is_on"), [
    ("cuda", None, 1, True),  # the default on one CUDA device
    ("cpu", None, 1, False),  # ... and off on CPU
    ("cpu", True, 1, True),
    ("cuda", False, 1, False),
    ("cuda", None, 2, False),  # a TP group cannot fill placeholders
    ("cuda", True, 2, False),
])
def test_the_default_is_on_for_one_cuda_device(device, setting, tp, is_on) -> None:
    """Overlap.build decides from the setting, the runner's device and its ranks (what the
    engine calls at start, whatever the setting): a stand-in engine, nothing runs."""
    from types import SimpleNamespace

    import torch

    from pdserve.serve.config import SchedulerConfig
    from pdserve.serve.engine.overlap import Overlap

    runner = SimpleNamespace(device=torch.device(device), tensor_parallel_size=tp)
    engine = SimpleNamespace(scheduler_config=SchedulerConfig(async_scheduling=setting),
                             runner=runner, speculator=None)
    overlap = Overlap.build(engine)
    assert (overlap is not None) == is_on
    if overlap is not None:
        overlap.close()


@pytest.mark.parametrize("fused", ["1", "0"])
def test_the_fused_and_module_decode_paths_both_run_ahead(llama_dir, monkeypatch,
                                                          fused: str) -> None:
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", fused)
    params = [params_of(o) for o in PLAIN[:3]]
    expected, _ = run(llama_dir, PROMPTS[:3], params, async_scheduling=False)
    got, launched = run(llama_dir, PROMPTS[:3], params, async_scheduling=True)
    assert summary(got) == summary(expected)
    assert launched > 0


def test_a_rank_group_runs_synchronously(llama_dir) -> None:
    """A TP group's ranks take their tokens from the step's message: no placeholders."""
    with LLM(llama_dir, tensor_parallel_size=2, num_kv_blocks=16, device="cpu",
             async_scheduling=True) as llm:
        assert llm.engine.overlap is None
        out = llm.generate([PROMPTS[0]], params_of({"max_tokens": 3}))
        assert len(out[0].outputs[0].token_ids) == 3


def test_decode_graphs_take_the_device_ids_of_the_step_before(llama_dir, monkeypatch) -> None:
    """Async scheduling over the decode graphs' static buffers (their eager mode on CPU,
    pdserve/serve/executor/cuda_graphs.py): the placeholders' ids reach the graph's input buffer."""
    monkeypatch.setenv("PDSERVE_CUDA_GRAPHS_ON_CPU", "1")
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "0")
    params = [params_of(o) for o in PLAIN[:5]]
    expected, _ = run(llama_dir, PROMPTS[:5], params, async_scheduling=False,
                      enforce_eager=True)
    with LLM(llama_dir, block_size=8, num_kv_blocks=128, device="cpu",
             async_scheduling=True) as llm:
        got = llm.generate(PROMPTS[:5], params)
        graphs = llm.engine.runner._rank.decode_graphs
        assert graphs is not None and graphs.num_replays > 10
        assert llm.engine.overlap.num_launched > 10
        assert_idle(llm.engine)
    assert summary(got) == summary(expected)
