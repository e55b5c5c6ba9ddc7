"""The fused decode loop (pdserve/serve/layers/fused_decode.py,
pdserve/kernels/csrc/decode_step.cpp) against the module path it replaces, bit for bit, and against
Hugging Face at the edge where it stops applying with plain weights (pdserve/kernels/cpu_linear.py
skinny_max_rows sequences, then one more) and past that edge with AVX-512 panels (which have
none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.model_util import BlockAllocator, hf_logits, load_hf, random_prompts
from helpers.model_walks import assert_rows_match, randomise_biases

from pdserve.kernels import cpu_linear, cpu_ops
from pdserve.protocol.tp import SeqChunk, StepInput
from pdserve.serve.config import CacheConfig, ModelConfig, ParallelConfig
from pdserve.serve.executor.model_runner import ModelRunner
from pdserve.serve.layers import ops as kernel_choice
from pdserve.serve.layers.fused_decode import FusedDecode
from pdserve.serve.layers.ops import cpu_kernels
from pdserve.serve.layers.parallel import ParallelLMHead

pytestmark = pytest.mark.skipif(cpu_ops.load() is None, reason="CPU kernels not built here")

NUM_BLOCKS = 256  # 33 sequences of up to 5 blocks (the AVX-512 edge is 32)
BLOCK_SIZE = 4


def make_runner(model_dir: Path, dtype: str = "auto") -> ModelRunner:
    return ModelRunner(ModelConfig(str(model_dir), dtype=dtype),
                       CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
                       ParallelConfig(device="cpu"))


def causal_lm(runner: ModelRunner):
    return runner._rank.model


def run_walk(runner: ModelRunner, num_seqs: int, num_decodes: int, seed: int = 0,
             lengths: list[int] | None = None
             ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill num_seqs ragged prompts (of `lengths` where given) in one step, then
    num_decodes decode-only steps of all of them; returns every step's logits and the full
    token sequences used."""
    lengths = lengths or [3 + (5 * s) % 11 for s in range(num_seqs)]
    full = random_prompts([n + num_decodes for n in lengths], runner.spec.vocab_size, seed)
    alloc = BlockAllocator(NUM_BLOCKS, seed)
    tables = [alloc.table(len(seq), BLOCK_SIZE) for seq in full]
    steps = [runner.execute(StepInput([
        SeqChunk(f"r{s}", full[s][:lengths[s]], 0, tables[s], True) for s in range(num_seqs)
    ]))]
    for d in range(num_decodes):
        steps.append(runner.execute(StepInput([
            SeqChunk(f"r{s}", [full[s][lengths[s] + d]], lengths[s] + d, tables[s], True)
            for s in range(num_seqs)
        ])))
    return steps, [seq[: lengths[s] + num_decodes] for s, seq in enumerate(full)]


@pytest.fixture(params=["llama", "qwen2-bias"])
def model_dir(request, llama_dir: Path, make_model_dir, tmp_path: Path) -> Path:
    if request.param == "llama":
        return llama_dir
    import shutil

    # Qwen2: a bias on Q, K and V (random, so a bias added wrongly shows)
    out = tmp_path / "qwen2"
    shutil.copytree(make_model_dir("qwen2", seed=1, tie_word_embeddings=True), out)
    randomise_biases(out, seed=5)
    return out


class AmxSpy:
    """The CPU ops, but amx_panel_linear notes each call's row count in `calls`."""

    def __init__(self, ops, calls: list[int]) -> None:
        self._ops, self._calls = ops, calls

    def __getattr__(self, name: str):
        if name == "amx_panel_linear":
            real = self._ops.amx_panel_linear
            return lambda x, *a: self._calls.append(x.shape[0]) or real(x, *a)
        return getattr(self._ops, name)


def _max_rows() -> int:
    """The skinny product's edge for this build (12 with AVX2, 32 with AVX-512)."""
    assert cpu_kernels() is not None
    return cpu_linear.skinny_max_rows()


@pytest.mark.parametrize("num_seqs", [1, 5, 9, "edge", "past"])
def test_fused_loop_is_bit_identical_to_the_module_path(model_dir: Path, num_seqs: int | str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    edge = _max_rows()
    num_seqs = edge if num_seqs == "edge" else edge + 1 if num_seqs == "past" else num_seqs
    calls: list[int] = []
    real_call = FusedDecode.__call__

    def counting(self, hidden, *args):
        calls.append(hidden.shape[0])
        return real_call(self, hidden, *args)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    head_calls: list[int] = []
    real_head = ParallelLMHead.forward
    monkeypatch.setattr(ParallelLMHead, "forward",
                        lambda self, hidden: head_calls.append(hidden.shape[0])
                        or real_head(self, hidden))
    with make_runner(model_dir) as fused:
        loop = causal_lm(fused).fused_decode()
        assert loop is not None
        if loop.max_rows is not None and num_seqs > loop.max_rows:
            pytest.skip("plain weights (no AVX-512 panels): the loop stops at the edge")
        fused_steps, _ = run_walk(fused, num_seqs, num_decodes=4)
    assert calls == [num_seqs] * 4  # every decode step, and no prefill, took the fused loop
    # with AVX-512 panels the loop's one region also computes the logits: the LM head module
    # ran for the prefill only
    assert head_calls == ([num_seqs] if loop.max_rows is None else [num_seqs] * 5)
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "0")
    with make_runner(model_dir) as modules:
        assert causal_lm(modules).fused_decode() is None
        module_steps, _ = run_walk(modules, num_seqs, num_decodes=4)
    assert calls == [num_seqs] * 4
    for got, want in zip(fused_steps, module_steps, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_fused_loop_splits_long_contexts_as_the_module_path_does(
        model_dir: Path, num_threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Contexts long enough that the attention splits them into pieces and merges those
    (pdserve/kernels/csrc/paged_attention.cpp), with teams of 1-3 threads: the loop's one parallel
    region splits every op as the module path's regions do, so the bits are the same."""
    lengths = [170, 61, 7]
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        with make_runner(model_dir) as fused:
            assert causal_lm(fused).fused_decode() is not None
            fused_steps, _ = run_walk(fused, 3, num_decodes=3, lengths=lengths)
        monkeypatch.setenv("PDSERVE_FUSED_DECODE", "0")
        with make_runner(model_dir) as modules:
            module_steps, _ = run_walk(modules, 3, num_decodes=3, lengths=lengths)
    finally:
        torch.set_num_threads(previous)
    for got, want in zip(fused_steps, module_steps, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("prepack", ["0", "1"])
def test_hf_logits_at_and_past_the_skinny_edge(llama_dir: Path, prepack: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain weights (PDSERVE_CPU_PREPACK=0, or no AVX-512): the loop runs up to the skinny
    product's edge and the module path past it. AVX-512 panels: the loop runs past it too."""
    monkeypatch.setenv("PDSERVE_CPU_PREPACK", prepack)
    calls: list[int] = []
    real_call = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__",
                        lambda self, hidden, *a: calls.append(hidden.shape[0])
                        or real_call(self, hidden, *a))
    hf = load_hf(llama_dir)
    with make_runner(llama_dir) as runner:
        edge = _max_rows()
        panels = causal_lm(runner).fused_decode().max_rows is None
        assert panels == (prepack == "1" and bool(cpu_kernels().panel_width()))
        for num_seqs in (edge, edge + 1):
            steps, seqs = run_walk(runner, num_seqs, num_decodes=2, seed=num_seqs)
            expected = [hf_logits(hf, seq) for seq in seqs]
            for d, logits in enumerate(steps[1:]):
                assert_rows_match(logits, [e[len(seq) - 2 + d] for e, seq in
                                           zip(expected, seqs, strict=True)])
    # past the edge the module path ran, unless the loop has panels
    assert calls == ([edge] * 2 + [edge + 1] * 2 if panels else [edge] * 2)


def test_bf16_checkpoint_in_float32_reads_bf16_panels(make_model_dir,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 checkpoint run in float32: on AVX-512 its panels keep the 2-byte weights and
    the fused loop reads them; every step is bit-identical to fp32 panels of the same
    weights, and matches Hugging Face in float32."""
    if not cpu_kernels().panel_width():
        pytest.skip("the kernels compiled without AVX-512: no panel kernel")
    model_dir = make_model_dir("llama", seed=4, dtype="bfloat16")
    with make_runner(model_dir, "float32") as half:
        assert half._rank.model.model.layers[0].mlp.down_proj.packed.dtype == torch.bfloat16
        assert causal_lm(half).fused_decode() is not None
        half_steps, seqs = run_walk(half, 3, num_decodes=3)
    monkeypatch.setattr(cpu_linear, "panel_dtype", lambda weight: weight.dtype)
    with make_runner(model_dir, "float32") as full:
        assert full._rank.model.model.layers[0].mlp.down_proj.packed.dtype == torch.float32
        full_steps, _ = run_walk(full, 3, num_decodes=3)
    for got, want in zip(half_steps, full_steps, strict=True):
        assert torch.equal(got, want)
    hf = load_hf(model_dir)  # fp32
    expected = [hf_logits(hf, seq) for seq in seqs]
    for d, logits in enumerate(half_steps[1:]):
        assert_rows_match(logits, [e[len(seq) - 3 + d] for e, seq in
                                   zip(expected, seqs, strict=True)])


def test_bf16_checkpoint_prefill_on_amx_matches_hf(make_model_dir,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill of more than amx_min_rows tokens of a bf16 checkpoint in float32 multiplies
    on AMX (where the CPU has it): its logits match Hugging Face in float32 as tightly as the
    fp32 path's do, and so do the decode steps after it (on the panels)."""
    ops = cpu_kernels()
    if not ops.panel_width() or not ops.amx_available():
        pytest.skip("no AMX on this CPU or build")
    model_dir = make_model_dir("llama", seed=4, dtype="bfloat16")
    calls: list[int] = []
    monkeypatch.setattr(cpu_linear, "library", lambda: AmxSpy(ops, calls))
    with make_runner(model_dir, "float32") as runner:
        steps, seqs = run_walk(runner, 9, num_decodes=2, seed=2)
    assert calls and min(calls) >= int(ops.amx_min_rows())  # the prefill step, not decodes
    hf = load_hf(model_dir)
    expected = [hf_logits(hf, seq) for seq in seqs]
    for d, logits in enumerate(steps[1:]):
        assert_rows_match(logits, [e[len(seq) - 2 + d] for e, seq in
                                   zip(expected, seqs, strict=True)])


@pytest.mark.parametrize("architecture", ["mixtral", "deepseek_v3"])
def test_other_families_keep_the_module_path(architecture: str, make_model_dir) -> None:
    with make_runner(make_model_dir(architecture, seed=3)) as runner:
        assert causal_lm(runner).fused_decode() is None


def test_torch_attention_backend_keeps_the_module_path(llama_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    with make_runner(llama_dir) as runner:
        assert causal_lm(runner).fused_decode() is None


def test_bad_switch_value_is_refused(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "yes")
    with pytest.raises(ValueError, match="FUSED_DECODE"), make_runner(llama_dir) as runner:
        causal_lm(runner).fused_decode()  # the CPU path reads every switch when first asked


def test_bf16_decode_of_many_sequences_takes_amx_in_the_fused_loop_too(
        make_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 checkpoint's decode step of at least amx_min_rows sequences: parallel.linear
    multiplies it on AMX, and so does the fused loop, bit for bit with the module path; with
    PDSERVE_CPU_AMX=0 the loop keeps the panels, whose bits differ."""
    ops = cpu_kernels()
    if not ops.panel_width() or not ops.amx_available():
        pytest.skip("no AMX on this CPU or build")
    num_seqs = int(ops.amx_min_rows()) + 1  # 33: NUM_BLOCKS holds them
    model_dir = make_model_dir("llama", seed=4, dtype="bfloat16")
    num_layers = 0

    def walk(fused: bool) -> list[torch.Tensor]:
        nonlocal num_layers
        monkeypatch.setenv("PDSERVE_FUSED_DECODE", "1" if fused else "0")
        with make_runner(model_dir, "float32") as runner:
            assert (causal_lm(runner).fused_decode() is not None) == fused
            num_layers = len(causal_lm(runner).model.layers)
            return run_walk(runner, num_seqs, num_decodes=2, seed=3)[0]

    fused_steps = walk(fused=True)
    calls: list[int] = []
    with monkeypatch.context() as spying:
        spying.setattr(cpu_linear, "library", lambda: AmxSpy(ops, calls))
        module_steps = walk(fused=False)
    # the 2 decode steps' 4 products a layer, and lm_head on the 33 rows sampled after the
    # prefill and after each decode step
    assert calls.count(num_seqs) == 2 * 4 * num_layers + 3
    for got, want in zip(fused_steps, module_steps, strict=True):
        assert torch.equal(got, want)
    monkeypatch.setenv("PDSERVE_CPU_AMX", "0")
    kernel_choice.reset()
    try:
        panel_steps = walk(fused=True)
    finally:
        kernel_choice.reset()
    assert not torch.equal(panel_steps[-1], fused_steps[-1])


def test_phase_clocks_fill_every_part_and_leave_the_logits_alone(llama_dir: Path) -> None:
    """step_roofline's breakdown: with phase_seconds set, each decode call adds to the
    products, the attention and the rest, and the logits are the same bits as without."""
    with make_runner(llama_dir) as runner:
        loop = runner.fused_decode()
        assert loop is not None and loop is causal_lm(runner).fused_decode()
        plain, _ = run_walk(runner, 3, num_decodes=2)
        loop.phase_seconds = torch.zeros(3, dtype=torch.float64)
        clocked, _ = run_walk(runner, 3, num_decodes=2)
        seconds, loop.phase_seconds = loop.phase_seconds, None
    assert (seconds > 0).all()  # products, attention, other: 2 decode calls each
    for got, want in zip(clocked, plain, strict=True):
        assert torch.equal(got, want)


def test_phase_clocks_refuse_a_wrong_buffer(llama_dir: Path) -> None:
    with make_runner(llama_dir) as runner:
        loop = runner.fused_decode()
        assert loop is not None
        loop.phase_seconds = torch.zeros(3)  # float32, not float64
        with pytest.raises(RuntimeError, match="phase_seconds float64"):
            run_walk(runner, 2, num_decodes=1)


def test_loop_refuses_a_row_outside_its_table_or_the_pool(llama_dir: Path) -> None:
    """The loop derives each row's slot from its length and table (position len - 1): a table
    too short for that position, or a block id past the pool, is a ValueError before any
    thread starts, never a write outside the pool."""
    from pdserve.serve.layers.attention import DecodeMetadata

    with make_runner(llama_dir) as runner:
        loop = runner.fused_decode()
        assert loop is not None
        caches = runner._rank.pool.kv_caches
        hidden = torch.zeros(1, runner.spec.hidden_size)
        before = [cache.clone() for cache in caches]
        cpu = torch.device("cpu")
        short = DecodeMetadata([SeqChunk("a", [1], 9, [3, 5], True)], BLOCK_SIZE, cpu)
        with pytest.raises(ValueError, match="outside its block table"):
            loop(hidden, caches, short)
        past = DecodeMetadata([SeqChunk("a", [1], 1, [NUM_BLOCKS], True)], BLOCK_SIZE, cpu)
        with pytest.raises(ValueError, match="outside the pool"):
            loop(hidden, caches, past)
        assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
