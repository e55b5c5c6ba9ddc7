"""A decode step reads nothing larger than its batch back to the host between its inputs and
its sampled ids: the logits stay where the model computed them and the sampler samples there
(on a GPU every such read would make the host wait for the device mid-step)."""

from __future__ import annotations

import pytest
from helpers.host_reads import host_reads
from helpers.model_util import random_prompts

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve import LLM

BATCH = 6

OPTIONS = [
    dict(temperature=0),
    dict(temperature=0.8, top_p=0.9, seed=3),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0, repetition_penalty=1.2, logit_bias={7: 2.0}),
    dict(temperature=0.7, min_p=0.1, seed=1),
    dict(temperature=0, min_tokens=8),
]


@pytest.mark.parametrize(("fused", "async_scheduling"), [("1", False), ("0", False),
                                                       ("1", True)])
def test_a_decode_step_reads_nothing_larger_than_its_batch(llama_dir, monkeypatch,
                                                           fused: str,
                                                           async_scheduling: bool) -> None:
    """Also with async scheduling (pdserve/serve/engine/overlap.py): the step launched ahead takes
    its input ids from the step before it on the device."""
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", fused)
    with LLM(llama_dir, num_kv_blocks=128, block_size=16, device="cpu",
             async_scheduling=async_scheduling) as llm:
        engine = llm.engine
        for prompt, options in zip(random_prompts([9, 17, 4, 30, 12, 21], vocab_size=1000,
                                                  seed=2), OPTIONS, strict=True):
            if async_scheduling:  # a penalty reads the output history: it never runs ahead
                options = {k: v for k, v in options.items() if k != "repetition_penalty"}
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True,
                                                      **options))
        while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                              for r in engine.scheduler.running):
            engine.step()
        assert len(engine.scheduler.running) == BATCH
        for _ in range(3):  # decode-only steps
            with host_reads() as seen:
                outputs = engine.step()
            assert len(outputs) == BATCH
            assert seen and all(numel <= BATCH for _, numel in seen), seen
        if async_scheduling:
            assert engine.overlap.num_launched >= 3
        while engine.has_unfinished_requests():
            engine.step()
