"""The Triton kernels compile for real GPUs, checked on a machine without one.

The interpreter tests (test_kernels_triton.py) check values but never run Triton's compiler,
which rejects things the interpreter accepts (types of loop-carried values, early returns,
dot shapes). Triton compiles ahead of time for a named target with its bundled ptxas and no
driver, so this file compiles every kernel, with the tile sizes its wrapper uses on GPU, for
sm_90 (H100/H200) and sm_80 (A100), and asks ptxas whether registers spill.

The compiler must run without TRITON_INTERPRET, which test_kernels_triton.py sets in this
process, so the work happens in a child process running this file as a script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

# (kernel, dtype, constexprs, num_warps, num_stages, sm): the wrappers' GPU launch configs.
PREFILL = "prefill_attention._prefill_attention_kernel"
DECODE = "decode_attention._decode_attention_kernel"
COMBINE = "decode_attention.combine_splits_kernel"
MLA = "mla_decode._mla_decode_kernel"
SCATTER = "kv_cache_write._scatter_rows_kernel"
FP8_GEMM = "fp8_gemm._fp8_block_gemm_kernel"
BLOCK = "block_attention._block_attention_kernel"
MOE = "moe_gemm._grouped_gemm_kernel"
CASES = [
    (PREFILL, "bf16", dict(PAGE_SIZE=16, BLOCK_M=128, GROUP=4, BLOCK_N=64, HEAD_DIM=128,
                           BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32"), 8, 3, 90),
    (PREFILL, "fp16", dict(PAGE_SIZE=32, BLOCK_M=128, GROUP=8, BLOCK_N=64, HEAD_DIM=64,
                           BLOCK_D=64, UPCAST=False, DOT_PRECISION="tf32"), 8, 3, 90),
    (PREFILL, "bf16", dict(PAGE_SIZE=16, BLOCK_M=128, GROUP=4, BLOCK_N=64, HEAD_DIM=128,
                           BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32"), 8, 2, 80),
    (PREFILL, "fp32", dict(PAGE_SIZE=16, BLOCK_M=64, GROUP=1, BLOCK_N=32, HEAD_DIM=64,
                           BLOCK_D=64, UPCAST=False, DOT_PRECISION="ieee"), 8, 2, 90),
    # MLA's absorbed prefill: the 576-wide latent as K and V, 16 of a group's heads per
    # program (default_tiles for head_dim > 256).
    *[(PREFILL, "bf16", dict(PAGE_SIZE=64, BLOCK_M=16, GROUP=16, BLOCK_N=16, HEAD_DIM=576,
                             BLOCK_D=1024, UPCAST=False, DOT_PRECISION="tf32"), 8, 1, sm)
      for sm in (90, 80)],
    (DECODE, "fp32", dict(PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=32, HEAD_DIM=128, BLOCK_D=128,
                          IS_SPLIT=False, UPCAST=False, DOT_PRECISION="ieee"), 8, 2, 90),
    (DECODE, "bf16", dict(PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                          IS_SPLIT=True, UPCAST=False, DOT_PRECISION="tf32"), 4, 2, 90),
    (COMBINE, "bf16", dict(BLOCK_SPLITS=32, HEAD_DIM=128, BLOCK_D=128), 4, 2, 90),
    *[(MLA, "bf16", dict(PAGE_SIZE=64, BLOCK_H=block_h, BLOCK_N=block_n, RANK=512,
                         ROPE_DIM=64, BLOCK_R=512, BLOCK_P=64, IS_SPLIT=True, UPCAST=False,
                         DOT_PRECISION="tf32"), 8, 2, 90)
      for block_h, block_n in [(16, 32), (32, 32), (64, 16)]],
    (SCATTER, "bf16", dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128), 4, 2, 90),
    # the FP8 KV cache: the query bf16, the cache e4m3, upcast as each tile loads (Triton has
    # no e4m3 type before sm89: an A100 cannot hold an FP8 cache)
    (DECODE, "bf16", dict(PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                          IS_SPLIT=True, UPCAST=False, DOT_PRECISION="tf32"), 4, 2, 90,
     {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}),
    (PREFILL, "bf16", dict(PAGE_SIZE=16, BLOCK_M=128, GROUP=4, BLOCK_N=64, HEAD_DIM=128,
                           BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32"), 8, 3, 90,
     {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}),
    # ring attention's block kernel: causal by positions, fp32 partial outputs
    *[(BLOCK, "bf16", dict(CAUSAL=True, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                           V_DIM=128, BLOCK_DV=128, UPCAST=False, DOT_PRECISION="tf32"), 8, 1,
       sm, {"out_ptr": "*fp32", "lse_ptr": "*fp32", "q_pos_ptr": "*i32", "k_pos_ptr": "*i32"})
      for sm in (90, 80)],
    # the fused MoE's grouped GEMM: a decode step's 16-row blocks and a prefill's 64-row ones
    *[(MOE, "bf16", dict(GATHER=gather, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                         UPCAST=False, PRECISION="tf32"), warps, 3, sm,
       {"row_of_ptr": "*i64" if gather else "*i32", "sorted_ptr": "*i32",
        "block_expert_ptr": "*i32"})
      for block_m, warps in ((16, 4), (64, 8)) for gather in (True, False) for sm in (90, 80)],
]
# DeepSeek-V3's block-scaled FP8 GEMM (e4m3 products need sm89+: sm90 only). It compiles, but
# ptxas spills at every tile tried (255 registers; 64x128x128 over 8 warps: 712 bytes, 4
# warps: 1,248; 128x64: 260; 32x128: 588): kept apart, as a known defect, until it does not.
FP8_CASES = [
    (FP8_GEMM, "bf16", dict(SCALE_BLOCK_N=128, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128,
                            BLOCK_K=128, UPCAST=False), 8, 3, 90,
     {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32",
      "b_scale_ptr": "*fp32"}),
]
FLOAT_ARGS = ("qk_scale",)
INT64_POINTERS = ("slot_mapping_ptr",)
INT32_POINTERS = ("cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr")
FP32_POINTERS = ("partial_out_ptr", "partial_lse_ptr")


def _compile_all(cases: list[tuple] | None = None) -> list[dict]:
    """Child process: compile the cases (CASES), return ptxas' register and spill counts per
    case."""
    import importlib
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for name, dtype, constexprs, num_warps, num_stages, sm, *pointers in cases or CASES:
        overrides = pointers[0] if pointers else {}  # pointer types other than the dtype
        module_name, kernel_name = name.split(".")
        kernel = getattr(importlib.import_module(f"pdserve.kernels.{module_name}"), kernel_name)
        signature, attrs = {}, {}
        for i, arg in enumerate(inspect.signature(kernel.fn).parameters):
            if arg in constexprs:
                signature[arg] = "constexpr"
                continue
            if arg in overrides:
                signature[arg] = overrides[arg]
            elif arg.endswith("_ptr"):
                signature[arg] = ("*i64" if arg in INT64_POINTERS else "*i32"
                                  if arg in INT32_POINTERS else "*fp32"
                                  if arg in FP32_POINTERS else f"*{dtype}")
            else:
                signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
            if arg.endswith("_ptr") or arg.startswith("stride"):
                # What Triton's launcher specialises for 16-byte aligned pointers and strides
                # divisible by 16 (every cache layout with head_dim 64/128): vector loads.
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", sm, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
        results.append({"kernel": name, "sm": sm, "shared_bytes": compiled.metadata.shared,
                        **_ptxas_usage(compiled.asm["ptx"], sm)})
    return results


def _ptxas_usage(ptx: str, sm: int) -> dict:
    import triton

    # Triton 3.9 compiles sm90+ with its newer "ptxas-blackwell"; older releases have one.
    tool = getattr(triton.knobs.nvidia, "ptxas_blackwell", None) if sm >= 90 else None
    tool = tool or triton.knobs.nvidia.ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
        log = subprocess.run([tool.path, "-v", f"--gpu-name={arch}", src, "-o",
                              os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else 0}


def _compile_in_child(which: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, __file__, which], capture_output=True, text=True,
                          env=env, timeout=240)
    if done.returncode != 0 and "ptxas" in done.stderr and "No such file" in done.stderr:
        pytest.skip("this Triton install has no bundled ptxas")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_kernels_compile_for_sm90_and_sm80_without_spills():
    results = _compile_in_child("all")
    assert [(r["kernel"], r["sm"]) for r in results] == [(c[0], c[5]) for c in CASES]
    for r in results:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r  # sm90's per-block shared memory limit


@pytest.mark.slow
def test_the_fp8_gemm_compiles_for_sm90_without_spills():
    results = _compile_in_child("fp8")
    assert [r["kernel"] for r in results] == [c[0] for c in FP8_CASES]
    for r in results:
        assert r["spill_bytes"] == 0, r


if __name__ == "__main__":
    print(json.dumps(_compile_all(FP8_CASES if sys.argv[1:] == ["fp8"] else CASES)))
