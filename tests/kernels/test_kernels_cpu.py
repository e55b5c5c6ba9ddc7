"""The CPU backend's C++ paged decode kernel against the plain-torch reference (which gathers
each context, then runs SDPA): MHA with every GQA group size, MLA's absorbed form, lengths at
and around block edges, shuffled block tables, fp32/bf16/fp16, a strided query.

Tolerances: fp32 differs from the reference only in the order of its sums (observed 3e-7);
bf16/fp16 inputs are upcast, so the result differs by the output rounding of the dtype."""

from __future__ import annotations

import pytest
import torch
from helpers.kernel_cases import cpu_ops_or_none

from pdserve.kernels import cpu_attention, cpu_ops, get_attention_backend
from pdserve.kernels import reference as ref

pytestmark = pytest.mark.skipif(cpu_ops_or_none() is None,
                                reason="no C++ toolchain to build the CPU kernel")

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _tables(num_seqs: int, max_blocks: int, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks]
                        for _ in range(num_seqs)]).int()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 4), (8, 2), (8, 1)])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads):
    torch.manual_seed(0)
    block_size, num_blocks, head_dim = 16, 64, 32
    seq_lens = torch.tensor([1, 15, 16, 17, 100, 128], dtype=torch.int32)
    tables = _tables(len(seq_lens), 8, num_blocks, seed=1)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    out = cpu_attention.decode_attention(query, kv_cache, seq_lens, tables, 0.3)
    expected = ref.decode_attention(query, kv_cache, seq_lens, tables, 0.3)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("head_dim", [20, 40, 64, 80])
def test_paired_query_heads_match_reference(head_dim):
    """GQA groups of 2 take query heads two at a time (one K/V load for both): head dims
    with and without a vector tail (20: scalar dots; 40: a 32-wide pair step and an 8-wide
    one on AVX2, 16-wide steps and an 8-wide tail on AVX-512; 80: AVX-512's 64-wide and
    16-wide value steps), lengths that leave 1-7 rows after the 4- and 8-row steps."""
    torch.manual_seed(head_dim)
    kv_cache = torch.randn(2, 24, 8, 2, head_dim)
    query = torch.randn(5, 4, head_dim)
    seq_lens = torch.tensor([1, 3, 5, 33, 70], dtype=torch.int32)
    tables = _tables(5, 9, 24, seed=3)
    out = cpu_attention.decode_attention(query, kv_cache, seq_lens, tables, 0.2)
    torch.testing.assert_close(out, ref.decode_attention(query, kv_cache, seq_lens, tables, 0.2),
                               atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_context_splits_and_merges(threads, dtype):
    """A long sequence beside short ones: the kernel splits the long context into chunks of
    whole blocks (flash-decoding) and merges them by their maxima and sums; head_dim 24 and
    block size 8 leave vector tails and ragged last blocks."""
    torch.manual_seed(5)
    block_size, num_blocks, head_dim = 8, 160, 24
    seq_lens = torch.tensor([1000, 3, 77, 8], dtype=torch.int32)
    tables = _tables(len(seq_lens), 125, num_blocks, seed=6)
    kv_cache = (torch.randn(2, num_blocks, block_size, 2, head_dim) * 2).to(dtype)
    query = (torch.randn(len(seq_lens), 6, head_dim) * 2).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_attention.decode_attention(query, kv_cache, seq_lens, tables, 0.4)
    finally:
        torch.set_num_threads(before)
    expected = ref.decode_attention(query, kv_cache, seq_lens, tables, 0.4)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_strided_query_and_single_block_length():
    torch.manual_seed(1)
    kv_cache = torch.randn(2, 8, 4, 2, 16)
    wide = torch.randn(3, 4, 32)
    query = wide[..., :16]  # rows are not contiguous; the last dimension is
    seq_lens = torch.tensor([4, 1, 9], dtype=torch.int32)
    tables = _tables(3, 3, 8, seed=2)
    out = cpu_attention.decode_attention(query, kv_cache, seq_lens, tables, 1.0)
    torch.testing.assert_close(out, ref.decode_attention(query, kv_cache, seq_lens, tables, 1.0),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_matches_reference(dtype):
    torch.manual_seed(2)
    num_blocks, block_size, rank, rope = 32, 16, 64, 16
    latent = torch.randn(num_blocks, block_size, rank + rope).to(dtype)
    seq_lens = torch.tensor([1, 16, 33, 70], dtype=torch.int32)
    tables = _tables(4, 5, num_blocks, seed=3)
    q_latent = torch.randn(4, 8, rank).to(dtype)
    q_rope = torch.randn(4, 8, rope).to(dtype)
    out = cpu_attention.mla_decode_attention(q_latent, q_rope, latent, seq_lens, tables, 0.2)
    expected = ref.mla_decode_attention(q_latent, q_rope, latent, seq_lens, tables, 0.2)
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_empty_batch_and_bad_input():
    kv_cache = torch.randn(2, 4, 4, 2, 8)
    empty = torch.empty(0, 2, 8)
    no_lens = torch.empty(0, dtype=torch.int32)
    no_tables = torch.empty(0, 1, dtype=torch.int32)
    out = cpu_attention.decode_attention(empty, kv_cache, no_lens, no_tables, 1.0)
    assert out.shape == (0, 2, 8)
    one = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match="beyond its block table"):
        cpu_attention.decode_attention(one, kv_cache, torch.tensor([9], dtype=torch.int32),
                                       torch.tensor([[0, 1]], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_attention.decode_attention(one, kv_cache, torch.tensor([5], dtype=torch.int32),
                                       torch.tensor([[0, 4]], dtype=torch.int32), 1.0)


def test_cpu_backend_is_the_torch_backend_with_in_place_decode():
    cpu, plain = get_attention_backend("cpu"), get_attention_backend("torch")
    assert cpu.name == "cpu"
    assert cpu.decode_attention is cpu_attention.decode_attention
    assert cpu.mla_decode_attention is cpu_attention.mla_decode_attention
    assert cpu.write_kv_cache is cpu_attention.write_kv_cache
    assert cpu.prefill_attention is cpu_attention.prefill_attention
    assert cpu.mla_prefill_attention is plain.mla_prefill_attention


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (8, 4, 64),
                                                            (8, 2, 32), (6, 1, 80)])
@pytest.mark.parametrize("q_len,k_len", [(1, 1), (15, 15), (16, 16), (17, 17), (100, 100),
                                         (7, 40), (33, 161), (1, 300)])
def test_causal_prefill_kernel_matches_sdpa(num_heads, num_kv_heads, head_dim, q_len, k_len):
    """The prompts' causal attention (pdserve/kernels/csrc/prefill_attention.cpp, where the build
    has AVX-512) against SDPA: every GQA group, tiles of 16 rows and keys left partial, queries
    after a cached prefix (row i at position k_len - q_len + i), token-major operands seen
    head-major (strided), as the prefill path passes them."""
    if not cpu_ops.load().causal_attention_available():
        pytest.skip("this build has no AVX-512")
    g = torch.Generator().manual_seed(q_len * 1000 + k_len)
    q = torch.randn(q_len, num_heads, head_dim, generator=g).transpose(0, 1)
    k = torch.randn(k_len, num_kv_heads, head_dim, generator=g).transpose(0, 1)
    v = (torch.randn(k_len, num_kv_heads, head_dim, generator=g) * 3).transpose(0, 1)
    out = cpu_ops.load().causal_attention(q, k, v, 0.3)
    expected = ref._causal_sdpa(q, k, v, 0.3, enable_gqa=True)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32],
                               rtol=TOLERANCE[torch.float32])


def test_causal_prefill_kernel_refuses_bad_shapes():
    module = cpu_ops.load()
    if not module.causal_attention_available():
        pytest.skip("this build has no AVX-512")
    q, k = torch.randn(4, 9, 16), torch.randn(2, 8, 16)
    with pytest.raises(RuntimeError, match="Lq <= Lk"):
        module.causal_attention(q, k, k, 1.0)  # more queries than keys
    with pytest.raises(RuntimeError, match="shapes"):
        module.causal_attention(torch.randn(3, 8, 16), k, k, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(RuntimeError, match="fp32"):
        module.causal_attention(q.double(), k, k, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_step_decode_rows_read_the_cache_in_place(dtype):
    """A prefill step's ragged batch: decode rows (one query row) beside prompts with and
    without a cached prefix. The whole matches the torch path; each decode row is the very
    bits the decode kernel gives that row on its own (a decode step's)."""
    torch.manual_seed(3)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 16, 64, 8, 4, 32
    q_lens = [1, 20, 1, 7, 1]
    seq_lens = torch.tensor([33, 20, 100, 40, 1], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = _tables(len(q_lens), 8, num_blocks, seed=4)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    out = cpu_attention.prefill_attention(query, kv_cache, cu, seq_lens, tables, 0.3,
                                          max(q_lens))
    expected = ref.prefill_attention(query, kv_cache, cu, seq_lens, tables, 0.3, max(q_lens))
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    for s in (0, 2, 4):
        row = cu[s].item()
        alone = cpu_attention.decode_attention(query[row:row + 1], kv_cache, seq_lens[s:s + 1],
                                               tables[s:s + 1], 0.3)
        assert torch.equal(out[row:row + 1], alone)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_fresh_prompts_attend_over_the_steps_own_rows(cache_dtype):
    """Given the step's key and value rows, a prompt with nothing cached before the step
    attends over them in place of its gathered blocks: the same result as reading the cache
    back, beside a prompt with a cached prefix (read back) and a decode row. An FP8 cache
    holds rounded rows, so it is read back even when the step's rows are given."""
    torch.manual_seed(8)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 16, 64, 8, 4, 32
    q_lens, lens = [20, 1, 7, 33], [20, 50, 40, 33]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = _tables(len(q_lens), 4, num_blocks, seed=9)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    key = torch.randn(sum(q_lens), num_kv_heads, head_dim)
    value = torch.randn(sum(q_lens), num_kv_heads, head_dim)
    slots = torch.cat([tables[s, (p := torch.arange(lens[s] - q, lens[s])) // block_size]
                       * block_size + p % block_size for s, q in enumerate(q_lens)]).long()
    ref.write_kv_cache(key, value, kv_cache, slots)
    query = torch.randn(sum(q_lens), num_heads, head_dim)
    args = (query, kv_cache, cu, seq_lens, tables, 0.3, max(q_lens))
    read_back = ref.prefill_attention(*args)
    for backend in (ref, cpu_attention):
        given = backend.prefill_attention(*args, key=key, value=value)
        torch.testing.assert_close(given, read_back, atol=2e-5, rtol=2e-5)
        if cache_dtype == torch.float32:  # the values are the same; only the copy is gone
            assert not torch.equal(backend.prefill_attention(*args, key=key * 2, value=value),
                                   read_back)
        else:  # a rounded cache is always read back: the step's rows are not used
            assert torch.equal(backend.prefill_attention(*args, key=key * 2, value=value),
                               given)


# ---- the fused per-layer ops, against the torch arithmetic they replace --------------------
def _ops():
    module = cpu_ops.load()
    assert module is not None
    return module


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch(with_residual):
    torch.manual_seed(3)
    x, residual, weight = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    normed, new_residual = _ops().add_rms_norm(x, residual if with_residual else None,
                                               weight, 1e-6)
    s = x + residual if with_residual else x
    expected = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(new_residual, s, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("width", [40, 43, 1408])
def test_silu_and_mul_matches_torch(width):
    """Vector body and scalar tail; gates of both signs, large ones included (exp(-g) of a
    very negative g would overflow a naive sigmoid)."""
    torch.manual_seed(width)
    x = torch.randn(7, 2 * width) * 4
    x[0, :6] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(_ops().silu_and_mul(x), torch.nn.functional.silu(gate) * up,
                               atol=1e-6, rtol=1e-6)
    wide = torch.randn(3, 2 * width + 5)[:, : 2 * width]  # rows a stride apart
    gate, up = wide.chunk(2, dim=-1)
    torch.testing.assert_close(_ops().silu_and_mul(wide), torch.nn.functional.silu(gate) * up,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rotary_dim", [32, 16])  # whole head, and a partial rotary
def test_rotary_neox_in_place_on_a_strided_view(rotary_dim):
    torch.manual_seed(4)
    fused = torch.randn(6, 3 * 2 * 32)  # like a QKV output: q is a strided view into it
    q = fused[:, :2 * 32].view(6, 2, 32)
    angles = torch.randn(6, rotary_dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    x1, x2 = q[..., :rotary_dim].chunk(2, dim=-1)
    expected = q.clone()
    expected[..., :rotary_dim] = q[..., :rotary_dim] * cos[:, None] \
        + torch.cat([-x2, x1], dim=-1) * sin[:, None]
    rest_before = fused[:, 2 * 32:].clone()
    _ops().rotary_neox_(q, cos, sin, rotary_dim)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[:, 2 * 32:], rest_before)  # nothing outside q was touched


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 8, 12, 13, 32])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (7, 37), (1, 8), (50, 200)])
def test_skinny_linear_matches_torch(rows, out_features, in_features):
    """Every tile remainder: rows past a multiple of 4 (AVX2) and 8 (AVX-512), outputs past a
    multiple of 3, inputs past a multiple of 8 and 16 (the scalar tail), with and without
    bias, on a strided x."""
    torch.manual_seed(7)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features)
    wide = torch.randn(rows, in_features + 5)
    x = wide[:, 2:2 + in_features]  # rows a stride apart, the last dimension contiguous
    torch.testing.assert_close(_ops().skinny_linear(x, weight, None), x @ weight.T,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_ops().skinny_linear(x, weight, bias), x @ weight.T + bias,
                               atol=1e-4, rtol=1e-4)


def test_skinny_linear_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        _ops().skinny_linear(torch.randn(2, 8), torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="fp32 only"):
        _ops().skinny_linear(torch.randn(2, 8).double(), torch.randn(4, 8).double(), None)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        _ops().skinny_linear(torch.randn(2, 8), torch.randn(8, 4).T, None)


def _needs_panels():
    if not _ops().panel_width():
        pytest.skip("the kernels compiled without AVX-512: no panel kernel")


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 130])  # tiles of 8, passes of 128 rows
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (112, 37), (40, 200), (7, 9),
                                                      (1, 8)])
def test_panel_linear_matches_torch(rows, out_features, in_features):
    """Whole panels (96 = 2 x 48), a last panel of whole vectors (112 = 2 x 48 + 16, 40 = 32 +
    8: one masked), one narrow masked panel (7, 1); with and without bias, on a strided x; and
    the packing undoes exactly."""
    _needs_panels()
    from pdserve.serve.layers import parallel

    torch.manual_seed(9)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    panels = parallel.prepack(weight)
    assert panels.shape == (out_features * in_features,)
    assert torch.equal(parallel.unpack(panels, weight.shape), weight)
    x = torch.randn(rows, in_features + 5)[:, 2:2 + in_features]
    torch.testing.assert_close(_ops().panel_linear(x, panels, None), x @ weight.T,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_ops().panel_linear(x, panels, bias), x @ weight.T + bias,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 9, 130])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (40, 200), (7, 9)])
def test_half_precision_panels_give_the_same_bits(half, rows, out_features, in_features):
    """A weight every value of which is a bf16 (fp16) number packs into bf16 (fp16) panels,
    half the bytes, and the kernel widens them exactly: the products are bit-identical to
    the fp32 panels', masked panels included, and the packing undoes exactly."""
    _needs_panels()
    from pdserve.serve.layers import parallel

    torch.manual_seed(11)
    weight = torch.randn(out_features, in_features).to(half).float()
    panels = parallel.prepack(weight)
    assert panels.dtype == half and panels.shape == (out_features * in_features,)
    assert torch.equal(parallel.unpack(panels, weight.shape), weight)
    full = parallel.pack_panels(weight, int(_ops().panel_width()))
    assert full.dtype == torch.float32
    x = torch.randn(rows, in_features + 3)[:, 1:1 + in_features]
    bias = torch.randn(out_features)
    assert torch.equal(_ops().panel_linear(x, panels, bias), _ops().panel_linear(x, full, bias))


def test_panel_dtype_is_the_narrowest_that_holds_the_weight_exactly():
    from pdserve.kernels.cpu_linear import panel_dtype

    torch.manual_seed(12)
    weight = torch.randn(16, 8)
    assert panel_dtype(weight) == torch.float32
    assert panel_dtype(weight.bfloat16().float()) == torch.bfloat16
    fp16_only = weight.half().float()
    assert not torch.equal(fp16_only.bfloat16().float(), fp16_only)
    assert panel_dtype(fp16_only) == torch.float16
    assert panel_dtype(torch.full((4, 4), 2.0 ** 20)) == torch.bfloat16  # past fp16's range
    assert panel_dtype(torch.full((4, 4), 1e6 + 1)) == torch.float32


def _needs_amx():
    _needs_panels()
    if not _ops().amx_available():
        pytest.skip("no AMX on this CPU or build")


@pytest.mark.parametrize("rows", [1, 16, 70, 300])  # tiles of 16, chunks of 128
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (112, 37), (40, 200), (7, 9)])
def test_amx_product_of_bf16_panels_is_as_exact_as_fp32(rows, out_features, in_features):
    """x in three bf16 pieces against bf16 panels on AMX: within fp32's own error of the
    float64 product (no worse than the fp32 panels'), every panel width and K tail, bias."""
    _needs_amx()
    from pdserve.serve.layers import parallel

    torch.manual_seed(13)
    weight = torch.randn(out_features, in_features).bfloat16().float()
    panels = parallel.prepack(weight)
    assert panels.dtype == torch.bfloat16
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features + 4)[:, 3:3 + in_features]
    exact = x.double() @ weight.double().T + bias.double()
    amx = _ops().amx_panel_linear(x, panels, bias).double()
    fp32 = _ops().panel_linear(x, panels, bias).double()
    scale = exact.abs().max()
    assert (amx - exact).abs().max() <= max(2 * (fp32 - exact).abs().max(), 2e-6 * scale)


def test_amx_rows_do_not_depend_on_their_batch():
    _needs_amx()
    from pdserve.serve.layers import parallel

    torch.manual_seed(14)
    panels = parallel.prepack(torch.randn(200, 96).bfloat16().float())
    x = torch.randn(300, 96)
    alone = _ops().amx_panel_linear(x[131:132], panels, None)
    assert torch.equal(_ops().amx_panel_linear(x[100:170], panels, None)[31:32], alone)
    assert torch.equal(_ops().amx_panel_linear(x, panels, None)[131:132], alone)


def test_linear_sends_many_rows_of_bf16_panels_to_amx(monkeypatch):
    """parallel.linear: bf16 panels and at least amx_min_rows rows take AMX; fewer rows, fp32
    panels, or PDSERVE_CPU_AMX=0 keep panel_linear."""
    _needs_amx()
    from pdserve.kernels import cpu_linear
    from pdserve.serve.layers import ops as kernel_choice
    from pdserve.serve.layers import parallel

    ops = _ops()
    calls = []

    class Spy:
        def __getattr__(self, name):
            if name in ("panel_linear", "amx_panel_linear"):
                calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(cpu_linear, "library", lambda: Spy())
    torch.manual_seed(15)
    weight = torch.randn(40, 24).bfloat16().float()
    half, full = parallel.prepack(weight), cpu_linear.pack_panels(weight, int(ops.panel_width()))
    many = int(ops.amx_min_rows())
    for rows, packed in ((many, half), (many - 1, half), (many, full)):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(parallel.linear(x, weight, None, packed), x @ weight.T,
                                   atol=1e-4, rtol=1e-4)
    assert calls == ["amx_panel_linear", "panel_linear", "panel_linear"]
    monkeypatch.setenv("PDSERVE_CPU_AMX", "0")
    kernel_choice.reset()
    try:
        parallel.linear(torch.randn(many, 24), weight, None, half)
        assert calls[-1] == "panel_linear"
    finally:
        kernel_choice.reset()


def test_panel_linear_rows_do_not_depend_on_their_batch():
    """Each output is one FMA chain over k, whatever the tile a row lands in: a row's result is
    bit-identical alone, in a batch of 13, and in a prefill-sized batch of 300."""
    _needs_panels()
    from pdserve.serve.layers import parallel

    torch.manual_seed(10)
    weight = torch.randn(200, 96)
    panels = parallel.prepack(weight)
    x = torch.randn(300, 96)
    alone = _ops().panel_linear(x[7:8], panels, None)
    assert torch.equal(_ops().panel_linear(x[:13], panels, None)[7:8], alone)
    assert torch.equal(_ops().panel_linear(x, panels, None)[7:8], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 9, 32])
def test_panel_linear_splits_a_decode_steps_columns_between_threads_exactly(dtype, rows):
    """A decode step's product splits its columns between the threads 16 at a time, so a panel
    may be shared (33 vectors at N = 520: the threads split panel 5, and the last panel ends
    in a masked vector): every output is the same bits on one thread as on two, and equals
    torch's product."""
    _needs_panels()
    from pdserve.serve.layers import parallel

    torch.manual_seed(12)
    weight = torch.randn(520, 512).to(dtype).float()
    panels = parallel.prepack(weight)
    assert panels.dtype == dtype
    x = torch.randn(rows, 512)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _ops().panel_linear(x, panels, None)
        torch.set_num_threads(1)
        one = _ops().panel_linear(x, panels, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(two, x @ weight.T, atol=1e-4, rtol=1e-4)


def test_panel_linear_refuses_what_it_cannot_read():
    _needs_panels()
    with pytest.raises(RuntimeError, match="do not hold rows of K = 9"):
        _ops().panel_linear(torch.randn(2, 9), torch.randn(32), None)
    with pytest.raises(RuntimeError, match="fp32"):
        _ops().panel_linear(torch.randn(2, 8).double(), torch.randn(32), None)
    with pytest.raises(RuntimeError, match="bias \\[N\\]"):
        _ops().panel_linear(torch.randn(2, 8), torch.randn(32), torch.randn(5))
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16 panels"):
        _ops().panel_linear(torch.randn(2, 8), torch.ones(32, dtype=torch.int16), None)


def test_linear_takes_the_panels_for_every_row_count_or_else_skinny_then_onednn(monkeypatch):
    """parallel.linear: with AVX-512 the packed copy is pdserve's panels and every row count
    reads them; elsewhere a decode step's few rows read the plain weight through the skinny
    kernel and more rows oneDNN's packed copy. All equal torch."""
    from pdserve.kernels import cpu_linear
    from pdserve.serve.layers import parallel

    torch.manual_seed(8)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = parallel.prepack(weight)
    ops = _ops()
    calls = []

    class Spy:
        def __getattr__(self, name):
            if name not in ("skinny_max_rows", "panel_width"):  # lookups, not products
                calls.append(name)
            return getattr(ops, name)

    monkeypatch.setattr(cpu_linear, "library", lambda: Spy())
    few, many = torch.randn(cpu_linear.skinny_max_rows(), 24), torch.randn(64, 24)
    torch.testing.assert_close(parallel.linear(few, weight, bias, packed), few @ weight.T + bias,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(parallel.linear(many, weight, bias, packed),
                               many @ weight.T + bias, atol=1e-4, rtol=1e-4)
    if ops.panel_width():
        assert not packed.is_mkldnn and calls == ["panel_linear", "panel_linear"]
    else:
        assert packed.is_mkldnn and calls == ["skinny_linear"]  # oneDNN took the 64 rows
    batched = torch.randn(2, 3, 24)  # a 3-D x keeps its leading dimensions
    torch.testing.assert_close(parallel.linear(batched, weight, None, packed), batched @ weight.T,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype):
    torch.manual_seed(5)
    cache_a = torch.zeros(2, 6, 4, 2, 8, dtype=dtype)
    cache_b = cache_a.clone()
    qkv = torch.randn(5, 3, 2, 8).to(dtype)  # key and value as strided views
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, 5, 23, 7, 12])
    cpu_attention.write_kv_cache(key, value, cache_a, slots)
    ref.write_kv_cache(key, value, cache_b, slots)
    assert torch.equal(cache_a, cache_b)
    with pytest.raises(ValueError, match="slot out of range"):
        cpu_attention.write_kv_cache(key, value, cache_a, torch.tensor([0, 1, 2, 3, 24]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # both of its copy loops
def test_write_kv_cache_skips_negative_slots(dtype):
    """Padding rows (slot -1, a decode graph's bucket) write nothing, as in the reference."""
    torch.manual_seed(6)
    cache_a = torch.zeros(2, 6, 4, 2, 8, dtype=dtype)
    cache_b = cache_a.clone()
    key, value = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    slots = torch.tensor([-1, 5, -1, 23, -1])
    cpu_attention.write_kv_cache(key, value, cache_a, slots)
    ref.write_kv_cache(key, value, cache_b, slots)
    assert torch.equal(cache_a, cache_b)
    assert int((cache_a != 0).sum()) == 2 * 2 * 2 * 8  # two rows of K and of V


# ---- the whole engine: compiled CPU paths against the plain-torch engine -------------------
def _greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from pdserve.serve import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(model_dir, block_size=8, num_kv_blocks=160, max_num_seqs=32) as llm:
        outputs = llm.generate(prompts, params)
        llm.engine.block_manager.check_integrity()
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mixtral", "deepseek_v3"])
def test_compiled_cpu_paths_give_the_plain_torch_tokens(architecture, make_model_dir,
                                                        monkeypatch):
    """Greedy tokens with every CPU kernel on (prepacked weights, fused norm/rotary/SiLU, KV
    writes, in-place decode attention) equal the plain-torch engine's, at batch sizes 1, 16
    and 17 and prompt lengths on both sides of a block edge."""
    from pdserve.serve.layers import ops as kernel_choice

    model_dir = make_model_dir(architecture, seed=3)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 200, (n,), generator=gen).tolist()
               for n in (1, 7, 8, 9, 15, 16, 17, 30, 3, 4, 5, 6, 10, 11, 12, 13, 14)]
    try:
        for name in ("PDSERVE_CPU_KERNELS", "PDSERVE_CPU_PREPACK"):
            monkeypatch.setenv(name, "0")
        monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
        kernel_choice.reset()
        expected = {n: _greedy(model_dir, prompts[:n]) for n in (1, 16, 17)}
        for name in ("PDSERVE_CPU_KERNELS", "PDSERVE_CPU_PREPACK", "PDSERVE_ATTENTION_BACKEND"):
            monkeypatch.delenv(name)
        kernel_choice.reset()
        for n, tokens in expected.items():
            assert _greedy(model_dir, prompts[:n]) == tokens, n
            assert all(len(t) == 6 for t in tokens)
    finally:
        kernel_choice.reset()
