"""A decode step reads nothing larger than its batch back to the host between its inputs and
its sampled ids: the logits stay where the model computed them and the sampler samples there
(on a GPU every such read would make the host wait for the device mid-step)."""

from __future__ import annotations

import pytest
import torch
from helpers.host_reads import host_reads
from helpers.model_util import random_prompts

from pdserve.protocol.sampling import SamplingParams
from pdserve.serve import LLM
from pdserve.serve.layers.attention import AttentionMetadata
from pdserve.serve.models.moe import SparseMoE

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


# ---- the step as a GPU runs it, every tensor the model holds tagged as on the device --------

DEVICE_OPTIONS = [
    dict(temperature=0),
    dict(temperature=1.0),  # a default request: sampled, unseeded
    dict(temperature=0.8, top_p=0.9, seed=3),  # top-p without top-k: the threshold search
    dict(temperature=1.0, top_k=5, top_p=0.8, seed=5),
    dict(temperature=0, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
         logit_bias={7: 2.0}, bad_words=("x",)),
    dict(temperature=0.7, min_p=0.1, seed=1, logprobs=2, min_tokens=3),
]


@pytest.fixture
def gpu_like_ops(monkeypatch: pytest.MonkeyPatch):
    """The ops a CUDA worker runs, on CPU: plain torch (no compiled CPU kernels or packed
    weights, whose C++ outputs the recorder cannot follow) and the Triton attention kernels
    (in the interpreter)."""
    from pdserve.serve.layers import ops

    for name, value in (("PDSERVE_CPU_KERNELS", "0"), ("PDSERVE_CPU_PREPACK", "0"),
                        ("PDSERVE_FUSED_DECODE", "0"), ("PDSERVE_ATTENTION_BACKEND", "triton")):
        monkeypatch.setenv(name, value)
    ops.reset()
    yield monkeypatch
    monkeypatch.undo()
    ops.reset()


def held_tensors(llm: LLM) -> list[torch.Tensor]:
    """Every tensor the worker holds: parameters, buffers, what modules derived from them
    after loading (stacked experts, rotary tables), the KV pool and the graphs' buffers."""
    rank = llm.engine.runner._rank
    holders = [*rank.model.modules(), *(m.load for m in rank.model.modules()
                                        if isinstance(m, SparseMoE))]
    if rank.decode_graphs is not None:
        holders.append(rank.decode_graphs)
    tensors = [*rank.model.parameters(), *rank.model.buffers(), *rank.pool.kv_caches]
    for holder in holders:
        for value in vars(holder).values():
            values = value.values() if isinstance(value, dict) else [value]
            tensors += [t for t in values if isinstance(t, torch.Tensor)]
            tensors += [t for m in values if isinstance(m, AttentionMetadata)
                        for t in vars(m).values() if isinstance(t, torch.Tensor)]
    return tensors


@pytest.mark.parametrize("path", ["modules", "graph_buffers", "moe_grouped_gemm"])
def test_a_decode_step_reads_back_only_its_samples(make_model_dir, gpu_like_ops,
                                                   path: str) -> None:
    """With every tensor the worker holds tagged as on the device, a decode step of greedy,
    default, seeded, top-p, top-k, penalised, biased, min-p and logprobs requests reads one
    thing back, the sampler's packed ids and logprobs, and sends its inputs down without
    waiting (attention metadata and sampling parameters from pinned memory on CUDA): no
    blocking upload, no list or mask indexing, no bincount or nonzero, no number read.
    modules: the module path; graph_buffers: the CUDA graphs' static buffers
    (PDSERVE_CUDA_GRAPHS_ON_CPU); moe_grouped_gemm: a Mixtral on the fused MoE kernel."""
    architecture = "mixtral" if path == "moe_grouped_gemm" else "llama"
    if path == "graph_buffers":
        gpu_like_ops.setenv("PDSERVE_CUDA_GRAPHS_ON_CPU", "1")
    with LLM(make_model_dir(architecture), num_kv_blocks=16, block_size=16, max_num_seqs=8,
             max_model_len=64, device="cpu") as llm:
        engine = llm.engine
        rank = engine.runner._rank
        assert (rank.decode_graphs is not None) == (path == "graph_buffers")
        for layer in rank.model.modules():
            if isinstance(layer, SparseMoE):
                layer.use_fused_kernel = True  # CUDA's default
        for prompt, options in zip(random_prompts([3, 5, 2, 6, 4, 3], vocab_size=1000,
                                                  seed=2), DEVICE_OPTIONS, strict=True):
            engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True,
                                                      **options))
        while engine.scheduler.waiting or any(r.num_output_tokens == 0
                                              for r in engine.scheduler.running):
            engine.step()
        for _ in range(2):  # the decode steps (the Triton interpreter is slow: only these)
            with host_reads(*held_tensors(llm)) as seen:
                outputs = engine.step()
            assert len(outputs) == BATCH
            assert [what for what, _ in seen] == ["copy_to_host"], seen
            assert seen[0][1] == BATCH + 3 + 2 * 2  # the ids; one row's logprob, rank, top 2
            # inputs, tables and parameters, never a vocabulary-sized tensor
            assert seen.uploads and all(numel < 1000 for _, numel in seen.uploads)
        assert not engine.has_unfinished_requests()
