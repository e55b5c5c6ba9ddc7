"""Triton attention kernels against their plain-torch references (pdserve/kernels/reference.py).

Without CUDA the kernels run in Triton's interpreter on CPU tensors. TRITON_INTERPRET=1 is
set here, at import and only when there is no GPU, before the kernel modules are defined
(get_attention_backend("triton") would otherwise redefine them; the other test files use the
torch backend and never read the flag). Shapes are small and tiles 64 wide, so the whole
file stays within a minute or two on 2 cores.

Tolerances, per dtype, for the kernel against the reference (both accumulate in fp32):
- fp32: the kernel sums K/V tiles with an online softmax, the reference in one softmax;
  only summation order differs, ~1e-6 here, so 2e-5.
- fp16: identical fp16 inputs; the output is rounded to fp16 (half an ulp, 2^-11 relative,
  <= 1.5e-3 for |out| < 3), and on GPU P is rounded to fp16 before the P.V product: 4e-3.
- bf16: 8-bit mantissa; rounding the output (the interpreter's fp32->bf16 cast truncates: a
  full ulp, 2^-7 relative) and, on GPU, P: 3e-2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.kernel_cases import (  # noqa: E402
    make_mla_case,
    make_mla_prefill_case,
    make_paged_case,
)

from pdserve.kernels import get_attention_backend  # noqa: E402
from pdserve.kernels import reference as ref  # noqa: E402
from pdserve.kernels.decode_attention import choose_num_splits  # noqa: E402
from pdserve.kernels.prefill_attention import PrefillTiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
triton_backend = get_attention_backend("triton")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


GQA = [(2, 2), (8, 2), (8, 1)]  # (query heads, KV heads): ratios 1, 4, 8
PREFILL_SHAPES = [  # (q_lens, seq_lens)
    ([7, 33, 1], [7, 33, 130]),  # fresh prefills beside a decode row
    ([130, 1, 5, 33], [130, 66, 40, 33]),  # prefix + new tokens; q_len 130 spans 3 tiles
]


@pytest.mark.parametrize("q_lens,seq_lens", PREFILL_SHAPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_matches_reference(q_lens, seq_lens, num_heads, num_kv_heads, block_size):
    case = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, 32, block_size).to(DEVICE)
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            0.2, case.max_query_len)
    assert_close(triton_backend.prefill_attention(*args), ref.prefill_attention(*args))


@pytest.mark.parametrize("dtype,head_dim", [(torch.float16, 64), (torch.bfloat16, 128),
                                            (torch.float16, 80)])  # 80 pads to 128
def test_prefill_half_precision_and_padded_head_dim(dtype, head_dim):
    case = make_paged_case([33, 1, 7], [97, 130, 7], 4, 2, head_dim, 16, dtype).to(DEVICE)
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            head_dim ** -0.5, case.max_query_len)
    assert_close(triton_backend.prefill_attention(*args), ref.prefill_attention(*args))


def test_prefill_small_tiles_and_empty_sequence():
    # 16-row tiles: many tiles per sequence, binary search over a sequence with no queries.
    case = make_paged_case([40, 0, 17], [40, 9, 70], 4, 1, 16, 16).to(DEVICE)
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            0.25, case.max_query_len)
    out = triton_backend.prefill_attention(*args, tiles=PrefillTiles(16, 32, 4, 1))
    assert_close(out, ref.prefill_attention(*args))


def test_strided_query_and_int64_metadata():
    # The engine's query is a view into a fused QKV projection: rows are not adjacent.
    case = make_paged_case([7, 1, 33], [7, 40, 33], 4, 2, 32, 16).to(DEVICE)
    fused = torch.randn(case.query.shape[0], 4 * 32 + 2 * 2 * 32, device=DEVICE)
    fused[:, :128] = case.query.reshape(-1, 128)
    query = fused[:, :128].view(-1, 4, 32)
    assert not query.is_contiguous()
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            0.2, case.max_query_len)
    out = triton_backend.prefill_attention(
        query, case.kv_cache, case.cu_seqlens_q.long(), case.seq_lens.long(),
        case.block_tables.long(), 0.2, case.max_query_len)
    assert_close(out, ref.prefill_attention(*args))
    rows = case.cu_seqlens_q[1:].long() - 1  # each sequence's last token, as a decode
    out = triton_backend.decode_attention(query[rows], case.kv_cache, case.seq_lens.long(),
                                          case.block_tables.long(), 0.2)
    assert_close(out, ref.decode_attention(case.query[rows], case.kv_cache, case.seq_lens,
                                           case.block_tables, 0.2))


def test_group_of_three_query_heads_pads_to_four():
    # 6 query heads over 2 KV heads: the padding row of each group is computed, never stored.
    case = make_paged_case([9, 1, 40], [9, 50, 70], 6, 2, 32, 16).to(DEVICE)
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            0.2, case.max_query_len)
    assert_close(triton_backend.prefill_attention(*args), ref.prefill_attention(*args))
    decode = make_paged_case([1] * 2, [50, 70], 6, 2, 32, 16).to(DEVICE)
    args = (decode.query, decode.kv_cache, decode.seq_lens, decode.block_tables, 0.2)
    assert_close(triton_backend.decode_attention(*args, num_splits=2),
                 ref.decode_attention(*args))


def test_prefill_splits_a_group_wider_than_the_tile_mla_style():
    """MLA's absorbed prefill: 40 query heads share one latent row used as both K and V (one
    plane, expanded with stride 0), 48 wide (pads to 64). With 16-row tiles the group of 40
    (padded to 64) splits over 4 programs per KV head, one token each."""
    case = make_paged_case([33, 1, 7], [70, 40, 7], 40, 1, 48, 16).to(DEVICE)
    shared = case.kv_cache[:1].expand(2, -1, -1, -1, -1)
    assert shared.stride(0) == 0
    args = (case.query, shared, case.cu_seqlens_q, case.seq_lens, case.block_tables, 0.15,
            case.max_query_len)
    out = triton_backend.prefill_attention(*args, tiles=PrefillTiles(16, 16, 4, 1))
    assert_close(out, ref.prefill_attention(*args))


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(num_heads, num_kv_heads, block_size, num_splits):
    seq_lens = [1, 7, 33, 130]
    case = make_paged_case([1] * 4, seq_lens, num_heads, num_kv_heads, 32, block_size)
    case = case.to(DEVICE)
    args = (case.query, case.kv_cache, case.seq_lens, case.block_tables, 0.2)
    out = triton_backend.decode_attention(*args, num_splits=num_splits)
    assert_close(out, ref.decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision_default_splits(dtype):
    case = make_paged_case([1] * 3, [300, 1, 64], 8, 2, 64, 16, dtype).to(DEVICE)
    args = (case.query, case.kv_cache, case.seq_lens, case.block_tables, 0.125)
    assert_close(triton_backend.decode_attention(*args), ref.decode_attention(*args))


def test_choose_num_splits_fills_gpu_but_not_short_contexts():
    assert choose_num_splits(num_seqs=256, num_programs_per_seq=8, max_context_len=32768) == 1
    assert choose_num_splits(num_seqs=1, num_programs_per_seq=8, max_context_len=100) == 1
    assert choose_num_splits(num_seqs=2, num_programs_per_seq=8, max_context_len=32768) == 32
    assert choose_num_splits(num_seqs=4, num_programs_per_seq=8, max_context_len=2000) == 8


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_matches_reference(block_size, num_splits):
    # 20 heads: two head blocks of 16, the second mostly padding.
    case = make_mla_case([1, 7, 33, 130], 20, 64, 16, block_size).to(DEVICE)
    args = (case.q_latent, case.q_rope, case.latent_cache, case.seq_lens, case.block_tables,
            0.1)
    out = triton_backend.mla_decode_attention(*args, num_splits=num_splits)
    assert_close(out, ref.mla_decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_prefill_absorbed_matches_expanded_reference(dtype):
    # Ragged: a prefix + new tokens, a decode row, a fresh prompt; 5 heads, R 48 -> 64 padded.
    case = make_mla_prefill_case([40, 1, 7], [70, 40, 7], 5, (16, 8, 48, 16), 16, dtype)
    case = case.to(DEVICE)
    assert_close(triton_backend.mla_prefill_attention(*case.args(0.15)),
                 ref.mla_prefill_attention(*case.args(0.15)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mla_decode_half_precision_padded_dims(dtype):
    case = make_mla_case([130, 5], 4, 48, 8, 16, dtype).to(DEVICE)  # R 48 -> 64, P 8 -> 16
    args = (case.q_latent, case.q_rope, case.latent_cache, case.seq_lens, case.block_tables,
            0.1)
    assert_close(triton_backend.mla_decode_attention(*args), ref.mla_decode_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_from_fused_qkv_views(dtype):
    num_tokens, num_kv_heads, head_dim = 9, 3, 24
    qkv = torch.randn(num_tokens, 4 * num_kv_heads * head_dim + 8, device=DEVICE).to(dtype)
    width = num_kv_heads * head_dim
    key = qkv[:, :width].view(num_tokens, num_kv_heads, head_dim)  # strided rows
    value = qkv[:, width:2 * width].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(6 * 16, device=DEVICE)[:num_tokens]
    expected = torch.randn(2, 6, 16, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    actual = expected.clone()
    ref.write_kv_cache(key, value, expected, slots)
    triton_backend.write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


def test_a_negative_slot_writes_nothing():
    """Padding rows (slot -1, a decode graph's bucket past its step's sequences) are masked
    out on the device: the cache keeps its bytes there, K, V and latent alike."""
    key, value = torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 2, 16, device=DEVICE)
    slots = torch.tensor([-1, 9, -1, 63], device=DEVICE)
    expected = torch.randn(2, 4, 16, 2, 16, device=DEVICE)
    actual = expected.clone()
    expected[0, 0, 9], expected[1, 0, 9] = key[1], value[1]
    expected[0, 3, 15], expected[1, 3, 15] = key[3], value[3]
    triton_backend.write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)
    latent_cache = torch.randn(4, 16, 72, device=DEVICE)
    before = latent_cache.clone()
    triton_backend.write_latent_cache(torch.randn(2, 72, device=DEVICE), latent_cache,
                                      torch.tensor([-1, -1], device=DEVICE))
    assert torch.equal(latent_cache, before)


def test_write_latent_cache_matches_reference():
    latent = torch.randn(7, 72, device=DEVICE)  # R + P = 64 + 8: padded to 128 lanes
    slots = torch.tensor([0, 1, 31, 32, 47, 63, 5], device=DEVICE)
    expected = torch.zeros(4, 16, 72, device=DEVICE)
    actual = expected.clone()
    ref.write_latent_cache(latent, expected, slots)
    triton_backend.write_latent_cache(latent, actual, slots)
    assert torch.equal(actual, expected)


LATE_INTERPRETER_SCRIPT = """
import torch, triton  # compiled-mode Triton first, as torch._dynamo / transformers do
from pdserve.kernels import prefill_attention  # kernels defined compiled: unusable on CPU
from pdserve.kernels import get_attention_backend, reference as ref
backend = get_attention_backend("triton")  # must redefine both
torch.manual_seed(0)
kv_cache = torch.randn(2, 4, 16, 2, 16)
args = (torch.randn(5, 4, 16), kv_cache, torch.tensor([0, 5], dtype=torch.int32),
        torch.tensor([37], dtype=torch.int32), torch.tensor([[2, 0, 3]], dtype=torch.int32),
        0.25, 5)
torch.testing.assert_close(prefill_attention.prefill_attention(*args),
                           ref.prefill_attention(*args), atol=2e-5, rtol=2e-5)
torch.testing.assert_close(backend.prefill_attention(*args), ref.prefill_attention(*args),
                           atol=2e-5, rtol=2e-5)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter set-up")
def test_triton_backend_works_after_triton_was_imported_compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", LATE_INTERPRETER_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_triton_backend_checks_arguments():
    assert triton_backend.name == "triton"
    case = make_paged_case([3], [3], 4, 2, 16, 16).to(DEVICE)
    with pytest.raises(ValueError, match="but query is torch.float16"):
        triton_backend.decode_attention(case.query[:1].half(), case.kv_cache, case.seq_lens,
                                        case.block_tables, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        triton_backend.prefill_attention(case.query.transpose(1, 2).contiguous().transpose(1, 2),
                                         case.kv_cache, case.cu_seqlens_q, case.seq_lens,
                                         case.block_tables, 1.0, 3)


# ---- real shapes, compiled kernels: only with a GPU -------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_prefill_llama_shapes(block_size):
    # A fresh 1k prompt, 2k new tokens over a 1k cached prefix, and a decode row at 4k.
    case = make_paged_case([1024, 2000, 1], [1024, 3000, 4096], 32, 8, 128, block_size,
                           torch.bfloat16).to("cuda")
    args = (case.query, case.kv_cache, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            128 ** -0.5, case.max_query_len)
    assert_close(triton_backend.prefill_attention(*args), ref.prefill_attention(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_heads", [16, 128])  # DeepSeek-V3 at TP 8, and all heads
def test_gpu_prefill_mla_latent_shapes(num_heads):
    # The absorbed MLA prefill the engine runs: one 576-wide latent row as K and V.
    case = make_paged_case([512, 1000, 1], [512, 1500, 2048], num_heads, 1, 576, 64,
                           torch.bfloat16).to("cuda")
    shared = case.kv_cache[:1].expand(2, -1, -1, -1, -1)
    args = (case.query, shared, case.cu_seqlens_q, case.seq_lens, case.block_tables,
            (128 + 64) ** -0.5, case.max_query_len)
    assert_close(triton_backend.prefill_attention(*args), ref.prefill_attention(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_long_context(dtype):
    case = make_paged_case([1] * 3, [32768, 5, 1000], 32, 8, 128, 16, dtype).to("cuda")
    args = (case.query, case.kv_cache, case.seq_lens, case.block_tables, 128 ** -0.5)
    assert_close(triton_backend.decode_attention(*args), ref.decode_attention(*args))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_heads", [16, 128])  # DeepSeek-V3 at TP 8, and all heads
def test_gpu_mla_decode_deepseek_shapes(num_heads):
    case = make_mla_case([8192, 3, 700], num_heads, 512, 64, 64, torch.bfloat16).to("cuda")
    args = (case.q_latent, case.q_rope, case.latent_cache, case.seq_lens, case.block_tables,
            (128 + 64) ** -0.5)
    assert_close(triton_backend.mla_decode_attention(*args), ref.mla_decode_attention(*args))
