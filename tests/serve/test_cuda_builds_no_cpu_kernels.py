"""A CUDA process never builds pdserve's CPU kernels (pdserve/kernels/cpu_ops.py: a minute or
more on a machine that never built them): neither the test session's start (tests/conftest.py)
nor a CUDA rank's load and forward (pdserve/serve/layers/ops.py use_device). On this CPU machine
the rank's device check is stubbed to say "cuda" and the build made to fail loudly."""

from __future__ import annotations

import pytest
import torch


def test_the_session_builds_them_first_only_without_cuda(monkeypatch):
    from conftest import builds_cpu_kernels_first

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not builds_cpu_kernels_first()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")  # benchmarks/gpu/run.sh sets it
    assert not builds_cpu_kernels_first()
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "1")
    assert builds_cpu_kernels_first()


def test_a_cuda_ranks_forward_never_loads_them(monkeypatch, llama_dir):
    """Everything a CUDA worker's rank runs (load, default attention backend, op choice,
    prepacked weights, the fused decode loop, greedy steps), on CPU tensors with the rank's
    device type stubbed to "cuda"."""
    from pdserve.kernels import cpu_ops
    from pdserve.serve import LLM, SamplingParams
    from pdserve.serve.executor import rank
    from pdserve.serve.layers import ops

    def build(*args: object) -> None:
        raise AssertionError("a CUDA process loaded the CPU kernels")

    use_device = ops.use_device
    monkeypatch.setattr(cpu_ops, "load", build)
    monkeypatch.setattr(rank.ops, "use_device", lambda device_type: use_device("cuda"))
    ops.reset()
    try:
        with LLM(llama_dir, num_kv_blocks=32, device="cpu") as llm:
            outputs = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4,
                                                                  ignore_eos=True))
        assert len(outputs[0].outputs[0].token_ids) == 4
        assert ops.chosen("rms_norm") == "torch" and ops.cpu_kernels() is None
    finally:
        ops.reset()
    with pytest.raises(AssertionError, match="loaded the CPU kernels"):
        ops.cpu_kernels()  # the CPU process it is again would load them: the stub is live
    ops.reset()
