"""The plain-torch attention (pdserve/kernels/reference.py) against dense attention on unpaged K/V.

The paged cases come from kernel_cases.py (shared with the Triton kernel tests); each keeps
the dense, unpaged K/V beside the paged cache, for the dense oracles written out here.
Tolerance: both sides compute in fp32 from the same fp32 inputs, so they differ only by
summation order (~1e-6); 1e-5 leaves room for that and nothing else.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers.kernel_cases import (
    MlaCase,
    MlaPrefillCase,
    PagedCase,
    make_mla_case,
    make_mla_prefill_case,
    make_paged_case,
)

from pdserve.kernels import get_attention_backend
from pdserve.kernels import reference as ref


def dense_attention(case: PagedCase, scale: float) -> torch.Tensor:
    """Attention written out with explicit scores on the unpaged K/V, in fp32."""
    outs = []
    num_heads = case.query.shape[1]
    for s, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.query[case.cu_seqlens_q[s]:case.cu_seqlens_q[s + 1]].float()
        q_len, seq_len = q.shape[0], k.shape[0]
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


def dense_mla(case: MlaCase, scale: float) -> torch.Tensor:
    """Un-absorbed view of the same math: concatenated [q_latent | q_rope] against each row."""
    outs = []
    rank = case.q_latent.shape[-1]
    for s, rows in enumerate(case.rows):
        q = torch.cat([case.q_latent[s], case.q_rope[s]], dim=-1).float()  # [H, R + P]
        probs = torch.softmax(q @ rows.float().T * scale, dim=-1)
        outs.append(probs @ rows.float()[:, :rank])
    return torch.stack(outs)


def dense_mla_prefill(case: MlaPrefillCase, scale: float) -> torch.Tensor:
    """The model's math written out: per-head K/V from each latent row, explicit causal scores."""
    outs = []
    rank = case.w_uk.shape[2]
    for s, rows in enumerate(case.rows):
        start, end = case.cu_seqlens_q[s], case.cu_seqlens_q[s + 1]
        q = torch.cat([case.q_nope[start:end], case.q_rope[start:end]], dim=-1).float()
        rows = rows.float()
        k_nope = torch.einsum("lr,hnr->lhn", rows[:, :rank], case.w_uk.float())
        k_rope = rows[:, None, rank:].expand(-1, k_nope.shape[1], -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        v = torch.einsum("lr,hvr->lhv", rows[:, :rank], case.w_uv.float())
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_len, seq_len = q.shape[0], k.shape[0]
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), v))
    return torch.cat(outs)


SHAPES = [  # (q_lens, seq_lens): fresh prefills, prefix + new tokens, decodes mixed in
    ([7, 33, 1], [7, 33, 130]),
    ([130, 1, 5], [130, 66, 40]),
]


@pytest.mark.parametrize("q_lens,seq_lens", SHAPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_prefill_matches_dense(q_lens, seq_lens, num_heads, num_kv_heads, block_size):
    case = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, 32, block_size)
    out = ref.prefill_attention(case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens,
                                case.block_tables, 0.3, case.max_query_len)
    torch.testing.assert_close(out, dense_attention(case, 0.3), atol=1e-5, rtol=1e-5)


def test_reference_decode_is_last_row_of_prefill():
    case = make_paged_case([1, 1, 1], [1, 7, 130], 8, 2, 32, 16)
    out = ref.decode_attention(case.query, case.kv_cache, case.seq_lens, case.block_tables, 0.2)
    torch.testing.assert_close(out, dense_attention(case, 0.2), atol=1e-5, rtol=1e-5)


def test_reference_batches_in_bounded_chunks(monkeypatch):
    # A budget of two 160-row contexts (K and V, 2 heads x 32) forces two chunks.
    monkeypatch.setattr(ref, "GATHER_BUDGET_ELEMENTS", 2 * 160 * 2 * 2 * 32)
    case = make_paged_case([1] * 5, [150, 3, 40, 17, 66], 8, 2, 32, 16)
    out = ref.decode_attention(case.query, case.kv_cache, case.seq_lens, case.block_tables, 0.2)
    torch.testing.assert_close(out, dense_attention(case, 0.2), atol=1e-5, rtol=1e-5)
    # [150, 3] pad to 10 blocks of 16 (2 x 160 rows fill the budget); [40, 17, 66] to 5.
    chunks = ref._sequence_chunks(case.seq_lens, 16, 2 * 2 * 32)
    assert chunks == [(slice(0, 2), 10), (slice(2, 5), 5)]
    mla = make_mla_case([150, 3, 40, 17, 66], num_heads=4, rank=32, rope_dim=8, block_size=16)
    out = ref.mla_decode_attention(mla.q_latent, mla.q_rope, mla.latent_cache, mla.seq_lens,
                                   mla.block_tables, 0.15)
    torch.testing.assert_close(out, dense_mla(mla, 0.15), atol=1e-5, rtol=1e-5)


def test_reference_mla_matches_dense():
    case = make_mla_case([1, 7, 33, 130], num_heads=4, rank=32, rope_dim=8, block_size=16)
    out = ref.mla_decode_attention(case.q_latent, case.q_rope, case.latent_cache, case.seq_lens,
                                   case.block_tables, 0.15)
    torch.testing.assert_close(out, dense_mla(case, 0.15), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,seq_lens", SHAPES)
def test_reference_mla_prefill_matches_dense(q_lens, seq_lens):
    """Expanded per sequence, absorbed for the single-row (decode) sequences."""
    case = make_mla_prefill_case(q_lens, seq_lens, 4, (16, 8, 32, 8), 16)
    out = ref.mla_prefill_attention(*case.args(0.15))
    assert out.shape == (sum(q_lens), 4, 8)
    torch.testing.assert_close(out, dense_mla_prefill(case, 0.15), atol=1e-5, rtol=1e-5)


def test_write_kv_cache_places_rows_by_slot():
    kv_cache = torch.zeros(2, 4, 16, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ref.write_kv_cache(key, value, kv_cache, torch.tensor([0, 17, 63]))
    torch.testing.assert_close(kv_cache[0, 1, 1], key[1])
    torch.testing.assert_close(kv_cache[1, 3, 15], value[2])
    assert int((kv_cache != 0).sum()) == 2 * 3 * 2 * 8


def test_a_negative_slot_writes_nothing():
    """A padding row (a decode graph's bucket past its step's sequences) has slot -1: it goes
    nowhere, not into the pool's last row where the index would wrap; a step of padding only
    (the graphs' warm-up) writes nothing at all."""
    kv_cache = torch.zeros(2, 4, 16, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ref.write_kv_cache(key, value, kv_cache, torch.tensor([-1, 17, -1]))
    torch.testing.assert_close(kv_cache[0, 1, 1], key[1])
    torch.testing.assert_close(kv_cache[1, 1, 1], value[1])
    assert int((kv_cache != 0).sum()) == 2 * 2 * 8
    ref.write_kv_cache(key[:2], value[:2], kv_cache, torch.tensor([-1, -1]))
    assert int((kv_cache != 0).sum()) == 2 * 2 * 8
    latent_cache = torch.zeros(4, 16, 24)
    latent = torch.randn(2, 24)
    ref.write_latent_cache(latent, latent_cache, torch.tensor([-1, 33]))
    torch.testing.assert_close(latent_cache[2, 1], latent[1])
    assert int((latent_cache != 0).sum()) == 24


def test_reference_keeps_query_dtype_bf16():
    case = make_paged_case([5], [9], 4, 2, 16, 16, dtype=torch.bfloat16)
    out = ref.prefill_attention(case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens,
                                case.block_tables, 0.25, 5)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits: output rounding alone is up to 2^-8 relative.
    torch.testing.assert_close(out.float(), dense_attention(case, 0.25), atol=1e-2, rtol=1e-2)


def test_backend_registry():
    backend = get_attention_backend("torch")
    assert backend.name == "torch" and backend.prefill_attention is ref.prefill_attention
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cuda")


def test_torch_backend_never_imports_triton():
    code = ("import sys; from pdserve.kernels import get_attention_backend; "
            "get_attention_backend('torch'); assert 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_shapes_raise():
    case = make_paged_case([3], [3], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="query heads"):
        ref.prefill_attention(case.query[:, :3], case.kv_cache, case.cu_seqlens_q,
                              case.seq_lens, case.block_tables, 1.0, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_bench_attention_without_gpu_says_so_and_exits_0(tmp_path, capsys):
    from benchmarks.kernels.bench_attention import main

    assert main(["--output", str(tmp_path / "out.json")]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


# ---- the registry (pdserve/kernels/registry.py)
# ---------------------------------------------------


def test_every_op_has_a_plain_torch_reference_in_reference_py():
    from pdserve.kernels import reference, registry

    for op in registry.IMPLEMENTATIONS:
        assert "torch" in registry.implementations(op), op
        assert registry.implementation(op, "torch") is getattr(reference, op)


def test_choose_takes_the_first_candidate_the_op_has_and_the_machine_runs():
    from pdserve.kernels import registry

    assert registry.choose("mla_prefill_attention", ("cpu", "torch")) == "torch"  # no cpu one
    assert registry.choose("rms_norm", ("nonexistent", "torch")) == "torch"
    with pytest.raises(ValueError, match="no implementation"):
        registry.choose("rms_norm", ("triton",))
    with pytest.raises(ValueError, match="unknown kernel op"):
        registry.choose("no_such_op", ("torch",))
    with pytest.raises(ValueError, match="has no 'triton'"):
        registry.implementation("rms_norm", "triton")


def test_the_engine_names_its_candidates_from_the_environment(monkeypatch):
    from pdserve.serve.layers import ops

    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    ops.reset()
    try:
        assert ops.candidates("rms_norm") == ("torch",)
        assert ops.candidates("linear") == ("onednn", "torch")
        assert ops.chosen("silu_and_mul") == "torch"
    finally:
        monkeypatch.delenv("PDSERVE_CPU_KERNELS")
        ops.reset()


def test_small_ops_match_their_references_whichever_implementation_runs():
    from helpers.kernel_cases import cpu_ops_or_none

    from pdserve.kernels import cpu_layer_ops
    from pdserve.kernels import reference as ref

    if cpu_ops_or_none() is None:
        pytest.skip("no C++ toolchain to build the CPU kernels")
    torch.manual_seed(3)
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    for got, want in zip(cpu_layer_ops.rms_norm(x, residual, weight, 1e-6),
                         ref.rms_norm(x, residual, weight, 1e-6), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(5, 128)
    torch.testing.assert_close(cpu_layer_ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    angles = torch.randn(5, 1, 32)
    cos_sin = (angles.cos(), angles.sin())
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    want = ref.rotary(q.clone(), k.clone(), cos_sin, 32, False)
    for got, expected in zip(cpu_layer_ops.rotary(q.clone(), k.clone(), cos_sin, 32, False),
                             want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # bf16 is not the kernel's: the reference runs, bit for bit
    xb = x.bfloat16()
    assert torch.equal(cpu_layer_ops.silu_and_mul(torch.cat([xb, xb], -1)),
                       ref.silu_and_mul(torch.cat([xb, xb], -1)))
