"""Fused MoE: every routed expert's MLP in two grouped GEMM launches, not a loop over experts.

A step's (token, expert) assignments are sorted by expert and each expert's run is padded to a
whole number of BLOCK_M rows, so every BLOCK_M block of the sorted list belongs to one expert:

    assignments  i:   0  1  2  3  4  5  6          expert_ids:  2  0  2  1  0  2  2
    sorted, padded:  [1  4  -  -][3  -  -  -][0  2  5  6]      (BLOCK_M 4, - = padding)
    block_expert:        0           1           2

One program owns a BLOCK_M x BLOCK_N tile of the output: it reads its block's expert once,
gathers the block's input rows, and walks K with W[expert] tiles:

    gate_up[i] = x[row_of[i]] @ W13[e_i]^T      [N, 2I]   (gathered: the token's hidden state)
    act[i]     = silu(gate_up[i, :I]) * gate_up[i, I:]
    out[i]     = act[i] @ W2[e_i]^T              [N, H]

The layout is built on the device from the expert ids alone (counts by index_add_, cumsum, a
scatter), so no count comes back to the host: the grid is sized by the bound
sum_e ceil(c_e / BLOCK_M) <= ceil(N / BLOCK_M) + E, and blocks past the real end see expert -1
and return. An assignment dropped past capacity carries expert id E: it lands in no block.
The caller weights and sums the N outputs into their tokens (SparseMoE._weighted_sum).
`reference_fused_experts` is the plain-torch reference: the same MLP expert by expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .paged_tile import check_launchable, dot_precision


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, row_of_ptr, sorted_ptr, block_expert_ptr,
    N, K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # past the last expert's run: nothing to do
        return
    slots = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # assignment or -1
    valid = slots >= 0
    slots = tl.where(valid, slots, 0)
    if GATHER:
        rows = tl.load(row_of_ptr + slots, mask=valid, other=0)
    else:
        rows = slots
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_valid = offs_n < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_block in range(0, tl.cdiv(K, BLOCK_K)):
        k = k_block * BLOCK_K + offs_k
        k_valid = k < K
        x = tl.load(x_rows + k[None, :] * stride_xk, mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_rows + k[None, :] * stride_wk, mask=n_valid[:, None] & k_valid[None, :],
                    other=0.0)
        if UPCAST:  # the interpreter's half-precision arithmetic is unreliable: fp32
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


@dataclass(frozen=True)
class ExpertLayout:
    """The assignments sorted by expert, each expert's run padded to BLOCK_M rows."""

    sorted_slots: torch.Tensor  # [num_blocks * BLOCK_M] int32: assignment index, -1 = padding
    block_expert: torch.Tensor  # [num_blocks] int32: the local expert of each block, -1 past
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def expert_layout(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """expert_ids [N] (local expert of each assignment, in [0, num_experts], num_experts
    meaning none: a dropped assignment, in no block) -> the padded layout, built with device
    ops only (counts by index_add_: `bincount` reads its input's max back on CUDA).

        sorted_slots: [e0 run, padded][e1 run, padded] ... [-1 ...][dropped ones, cut off]
    """
    num = expert_ids.shape[0]
    device = expert_ids.device
    ids = expert_ids.long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.index_add_(0, ids, torch.ones_like(ids))  # [E + 1], the last: dropped
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    order = ids.argsort(stable=True)
    sorted_ids = ids[order]
    rank = torch.arange(num, device=device) - starts[sorted_ids]
    destination = padded_ends[sorted_ids] - padded[sorted_ids] + rank
    num_blocks = -(-num // block_m) + num_experts  # a bound on sum_e ceil(c_e / block_m)
    # the dropped ones land past the blocks' end: num_blocks * block_m + their rank
    destination = torch.where(sorted_ids < num_experts, destination,
                              num_blocks * block_m + rank)
    sorted_slots = torch.full((num_blocks * block_m + num,), -1, dtype=torch.int32,
                              device=device)
    sorted_slots.scatter_(0, destination, order.to(torch.int32))
    sorted_slots = sorted_slots[:num_blocks * block_m]
    padded_ends = padded_ends[:num_experts]
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertLayout(sorted_slots, block_expert, block_m)


def _tiles(device: torch.device, num_rows: int, num_experts: int
           ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps). The interpreter pays per program,
    so it gets few large tiles; on GPU a decode step's few rows per expert take 16-row blocks
    (less padding) over 4 warps, a prefill's many 64-row blocks over 8 (over 4, ptxas spills
    at sm90 and sm80: tests/kernels/test_kernels_compile.py)."""
    if device.type != "cuda":
        return 32, 64, 64, 1, 4
    if num_rows <= 16 * num_experts:
        return 16, 64, 64, 3, 4
    return 64, 64, 64, 3, 8


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, layout: ExpertLayout,
                 row_of: torch.Tensor | None = None, block_k: int = 64,
                 num_stages: int = 1, num_warps: int = 4) -> torch.Tensor:
    """out[i] = x[row_of[i]] @ w[e_i]^T for every assignment i of the layout (row_of None:
    x[i]). x [M, K], w [E, N, K] -> out [num assignments, N] in x's dtype."""
    interpreted = check_launchable(x, w, layout.sorted_slots)
    if w.dim() != 3 or x.dim() != 2 or w.shape[2] != x.shape[1]:
        raise ValueError(f"x [M, K] and w [E, N, K] disagree: {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"x is {x.dtype} but w is {w.dtype}")
    num_assignments = x.shape[0] if row_of is None else row_of.shape[0]
    num_out = w.shape[1]
    out = torch.empty(num_assignments, num_out, dtype=x.dtype, device=x.device)
    if num_assignments == 0:
        return out
    block_n = 64
    grid = (layout.num_blocks, triton.cdiv(num_out, block_n))
    _grouped_gemm_kernel[grid](
        x, w, out, row_of if row_of is not None else layout.sorted_slots,
        layout.sorted_slots, layout.block_expert, num_out, x.shape[1],
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        GATHER=row_of is not None, BLOCK_M=layout.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=interpreted, PRECISION=dot_precision(x.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fused_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, row_of: torch.Tensor | None = None) -> torch.Tensor:
    """Every assignment's expert MLP, silu(x W_gate) * (x W_up) W_down.

    hidden [T, H]; expert_ids [N] local expert ids; row_of [N] the token of each assignment
    (None: assignment i is hidden[i]); w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]
    -> [N, H]."""
    num_experts, double_inter, _ = w13.shape
    if w2.shape != (num_experts, hidden.shape[1], double_inter // 2):
        raise ValueError(f"w2 must be [{num_experts}, {hidden.shape[1]}, {double_inter // 2}],"
                         f" got {tuple(w2.shape)}")
    block_m, _, block_k, num_stages, num_warps = _tiles(hidden.device, expert_ids.shape[0],
                                                        num_experts)
    layout = expert_layout(expert_ids, num_experts, block_m)
    gate_up = grouped_gemm(hidden, w13, layout, row_of, block_k, num_stages, num_warps)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(hidden.dtype)
    return grouped_gemm(act, w2, layout, None, block_k, num_stages, num_warps)


def reference_fused_experts(hidden: torch.Tensor, expert_ids: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor, row_of: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """fused_experts in plain torch, one expert at a time (fp32 products)."""
    rows = hidden if row_of is None else hidden.index_select(0, row_of)
    out = torch.zeros(rows.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        mine = (expert_ids == expert).nonzero().flatten()
        if mine.numel() == 0:
            continue
        gate, up = (rows[mine].float() @ w13[expert].float().T).chunk(2, dim=-1)
        out[mine] = (F.silu(gate) * up).to(hidden.dtype).float() @ w2[expert].float().T
    return out.to(hidden.dtype)
