"""Ring attention at the kernel level (pdserve/kernels/ring_attention.py and its ring,
pdserve/kernels/ring.py; the block attention op of pdserve/kernels/registry.py; the zig-zag split,
pdserve/kernels/zigzag.py) against plain torch SDPA over the whole sequence.

Without CUDA the Triton block attention runs in the interpreter (TRITON_INTERPRET=1 set here
before the kernel module is defined). Tolerances: both sides accumulate in fp32 and differ
only in summation order (online softmax over tiles and over ring blocks, against one
softmax): ~1e-6 here, so 2e-5 for fp32; fp16 inputs give the same fp32 partials up to the
fp16 rounding of P before the P.V product on GPU: 4e-3.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
from helpers.cluster_util import free_port_block

from pdserve.kernels import get_block_attention  # noqa: E402
from pdserve.kernels.cpu_block_attention import (  # noqa: E402
    block_attention as block_attention_cpu,
)
from pdserve.kernels.partials import merge_attention, merge_stacked  # noqa: E402
from pdserve.kernels.reference import (  # noqa: E402
    block_attention as block_attention_reference,
)
from pdserve.kernels.reference import padded_rows_attention  # noqa: E402
from pdserve.kernels.ring_attention import ring_attention, simulate_ring_attention  # noqa: E402
from pdserve.kernels.zigzag import (  # noqa: E402
    zigzag_chunk_bounds,
    zigzag_indices,
    zigzag_ranges,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}
ATTENDS = {"torch": block_attention_reference, "cpu": block_attention_cpu,
           "triton": get_block_attention("triton")}


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, v_dim: int,
         dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, v_dim, generator=gen)
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
          ) -> torch.Tensor:
    """[T, H, Dv] in fp32: SDPA over the whole sequence, the reference."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.float().transpose(0, 1) for t in (q, k.repeat_interleave(group, 1),
                                                      v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal,
                                          scale=scale).transpose(0, 1)


def _sdpa_lse(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, 1))
    scores = scores * scale
    if causal:
        n = q.shape[0]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device)
                                    .triu(1), float("-inf"))
    return torch.logsumexp(scores, -1).transpose(0, 1)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# ---- block attention -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,v_dim", [(4, 2, 16, 16), (4, 1, 24, 40),
                                                          (2, 2, 64, 32)])
def test_block_attention_matches_sdpa(dtype, causal, heads, kv_heads, head_dim, v_dim):
    """Every block attention (reference, CPU flash, Triton): 130 tokens, three 64-row query
    tiles of the kernel, the last one ragged; v wider or narrower than q/k (MLA's shapes);
    the lse too."""
    q, k, v = _qkv(130, heads, kv_heads, head_dim, v_dim, dtype)
    pos = torch.arange(130, device=DEVICE)
    positions = (pos, pos) if causal else (None, None)
    for attend in ATTENDS.values():
        out, lse = attend(q, k, v, 0.3, *positions)
        assert out.dtype == lse.dtype == torch.float32
        _close(out, _sdpa(q, k, v, 0.3, causal), dtype)
        _close(lse, _sdpa_lse(q, k, 0.3, causal), dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_block_attention_in_bf16(causal):
    """bf16 inputs (the interpreter's bf16 arithmetic is wrong: the kernel upcasts right after
    loading) against SDPA in fp32 over the same bf16 values. The products of bf16 values are
    exact in fp32, so only a GPU's rounding of the probabilities to bf16 before P @ V (2^-8
    relative) separates them: 2e-2."""
    q, k, v = _qkv(70, 2, 1, 64, 32, torch.bfloat16, seed=3)  # two query tiles, one ragged
    pos = torch.arange(70, device=DEVICE)
    positions = (pos, pos) if causal else (None, None)
    out, lse = ATTENDS["triton"](q, k, v, 0.125, *positions)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, _sdpa(q, k, v, 0.125, causal), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, _sdpa_lse(q, k, 0.125, causal), atol=2e-2, rtol=2e-2)


def test_block_attention_rows_that_see_nothing_are_the_merge_identity():
    """Queries before every key (a block wholly in their future): out 0, lse -inf; merging
    that into a partial leaves it exactly as it was."""
    q, k, v = _qkv(20, 4, 2, 16, 16)
    q_pos = torch.arange(5, device=DEVICE)
    k_pos = torch.arange(10, 30, device=DEVICE)
    for attend in ATTENDS.values():
        out, lse = attend(q[:5], k, v, 0.25, q_pos, k_pos)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isinf(lse).all() and (lse < 0).all()
        base = attend(q[:5], k[:5], v[:5], 0.25)
        merged = merge_attention(*base, out, lse)
        assert torch.equal(merged[0], base[0]) and torch.equal(merged[1], base[1])


@pytest.mark.parametrize("attend_name", ["torch", "cpu", "triton"])
def test_merge_of_key_halves_equals_attention_over_all_keys(attend_name):
    """Keys split in two disjoint parts (interleaved positions, a causal mask by position):
    merge_attention of the two partials is attention over all of them; merge_stacked of
    three parts too."""
    attend = ATTENDS[attend_name]
    q, k, v = _qkv(70, 4, 2, 16, 16, seed=1)
    pos = torch.arange(70, device=DEVICE)
    even, odd = pos[::2], pos[1::2]
    a = attend(q, k[even], v[even], 0.3, pos, even)
    b = attend(q, k[odd], v[odd], 0.3, pos, odd)
    out, lse = merge_attention(*a, *b)
    _close(out, _sdpa(q, k, v, 0.3, True), torch.float32)
    _close(lse, _sdpa_lse(q, k, 0.3, True), torch.float32)
    parts = [attend(q, k[i::3], v[i::3], 0.3, pos, pos[i::3]) for i in range(3)]
    out3, _ = merge_stacked(torch.stack([p[0] for p in parts]),
                            torch.stack([p[1] for p in parts]))
    _close(out3, _sdpa(q, k, v, 0.3, True), torch.float32)


def test_cpu_block_attention_cuts_causal_work_by_position_runs():
    """The CPU flash path on a zig-zag rank's shape: queries in two runs of positions, keys
    a shuffled cached prefix (full), the same two runs (top-left causal), a run in between
    (full for the late run, skipped for the early one) and one past both (skipped): equal to
    the masked reference."""
    q, k, v = _qkv(60, 4, 2, 16, 24, seed=4)
    q_pos = torch.cat([torch.arange(10, 20), torch.arange(40, 50)]).to(DEVICE)
    k_pos = torch.cat([torch.randperm(10), torch.arange(10, 20), torch.arange(25, 35),
                       torch.arange(40, 50), torch.arange(50, 60)]).to(DEVICE)
    for q_rows in (slice(0, 20), slice(20, 40)):
        expected = block_attention_reference(q[q_rows], k[:50], v[:50], 0.3, q_pos, k_pos[:50])
        actual = block_attention_cpu(q[q_rows], k[:50], v[:50], 0.3, q_pos, k_pos[:50])
        _close(actual[0], expected[0], torch.float32)
        _close(actual[1], expected[1], torch.float32)


def test_padded_rows_attention_matches_one_row_at_a_time():
    """A CP decode's shard attention: one row per sequence against its own padded keys
    (lengths 0, 1, 7, 20; GQA 4:2; v narrower) equals each row's block attention, and a row
    with no keys is the merge identity."""
    lengths = [0, 1, 7, 20]
    q, _, _ = _qkv(len(lengths), 4, 2, 16, 16, seed=5)
    _, k, v = _qkv(20 * len(lengths), 4, 2, 16, 12, seed=6)
    k, v = k.view(len(lengths), 20, 2, 16), v.view(len(lengths), 20, 2, 12)
    out, lse = padded_rows_attention(q, k, v, torch.tensor(lengths, device=DEVICE), 0.3)
    for s, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s])) and torch.isinf(lse[s]).all()
            continue
        row_out, row_lse = block_attention_reference(q[s:s + 1], k[s, :n], v[s, :n], 0.3)
        _close(out[s], row_out[0], torch.float32)
        _close(lse[s], row_lse[0], torch.float32)


# ---- zig-zag -------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 8, 13, 64, 101])
@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_zigzag_covers_every_token_once_and_balances_causal_work(num_tokens, cp_size):
    bounds = zigzag_chunk_bounds(num_tokens, cp_size)
    assert len(bounds) == 2 * cp_size and bounds[0][0] == 0 and bounds[-1][1] == num_tokens
    assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1
    parts = [zigzag_indices(num_tokens, cp_size, r) for r in range(cp_size)]
    assert sorted(torch.cat(parts).tolist()) == list(range(num_tokens))
    for rank in range(cp_size):  # chunk r and chunk 2 CP - 1 - r
        assert zigzag_ranges(num_tokens, cp_size, rank) == [bounds[rank],
                                                            bounds[2 * cp_size - 1 - rank]]
    if num_tokens % (2 * cp_size) == 0 and num_tokens:
        # causal work of a rank = sum over its queries of the keys they see: all equal
        work = [int((p + 1).sum()) for p in parts]
        assert len(set(work)) == 1
    with pytest.raises(ValueError, match="not in a CP group"):
        zigzag_ranges(num_tokens, cp_size, cp_size)


# ---- the ring, simulated and over gloo ------------------------------------------------------


@pytest.mark.parametrize("attend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_simulated_ring_matches_full_causal_attention(attend_name, cp_size):
    """A 150-token sequence split zig-zag over cp ranks, the ring run in one process (the
    same block order and merge as the distributed one): every rank's rows equal full causal
    SDPA's rows, and each rank skips the blocks that lie wholly in its future."""
    q, k, v = _qkv(150, 4, 2, 16, 16, seed=2)
    pos = torch.arange(150, device=DEVICE)
    index = [zigzag_indices(150, cp_size, r).to(DEVICE) for r in range(cp_size)]
    calls = []

    def attend(*args):
        calls.append(args)
        return ATTENDS[attend_name](*args)

    results = simulate_ring_attention([q[i] for i in index], [k[i] for i in index],
                                      [v[i] for i in index], 0.3, [pos[i] for i in index],
                                      [pos[i] for i in index], attend)
    expected = _sdpa(q, k, v, 0.3, True)
    for rows, (out, _) in zip(index, results, strict=True):
        _close(out, expected[rows], torch.float32)
    # zig-zag: every rank's late chunk sees every block, so no whole block is skipped
    assert len(calls) == cp_size * cp_size
    contiguous = [torch.arange(r * 150 // cp_size, (r + 1) * 150 // cp_size, device=DEVICE)
                  for r in range(cp_size)]
    calls.clear()
    simulate_ring_attention([q[i] for i in contiguous], [k[i] for i in contiguous],
                            [v[i] for i in contiguous], 0.3, [pos[i] for i in contiguous],
                            [pos[i] for i in contiguous], attend)
    # contiguous chunks: rank r sees only blocks 0..r, the rest are skipped (and unbalanced)
    assert len(calls) == cp_size * (cp_size + 1) // 2


def _gloo_rank(rank: int, size: int, port: int, attend_name: str, errors) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        q, k, v = _qkv(150, 4, 2, 16, 24, seed=3)
        pos = torch.arange(150)
        rows = zigzag_indices(150, size, rank)
        attend = get_block_attention(attend_name)
        out, lse = ring_attention(q[rows], k[rows], v[rows], 0.3, pos[rows], pos[rows],
                                  attend=attend)
        errors.put((rank, float((out - _sdpa(q, k, v, 0.3, True)[rows]).abs().max()),
                    float((lse - _sdpa_lse(q, k, 0.3, True)[rows]).abs().max())))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp_size,attend_name", [(2, "torch"), (4, "cpu"), (2, "triton")])
def test_ring_attention_over_gloo_ranks_matches_full_causal_attention(cp_size, attend_name):
    """Real ranks (gloo, isend/irecv around the ring, the next block in flight while the
    current one is attended): each rank's (out, lse) equal full causal attention's rows."""
    if DEVICE == "cuda":
        pytest.skip("the gloo ranks run on CPU")
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port_block(1)
    procs = [ctx.Process(target=_gloo_rank, args=(r, cp_size, port, attend_name, errors))
             for r in range(cp_size)]
    for p in procs:
        p.start()
    results = [errors.get(timeout=120) for _ in range(cp_size)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(r for r, _, _ in results) == list(range(cp_size))
    for _, out_err, lse_err in results:
        assert out_err < TOLERANCE[torch.float32] and lse_err < TOLERANCE[torch.float32]
