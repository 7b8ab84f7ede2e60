"""Compile ddtree_utils' Triton kernels ahead of time without a GPU: `python tests/triton_aot.py
[ARCH]`, ARCH 90 (H100/H200, the default) or 120 (RTX PRO 6000 Blackwell, as on ct200).

Run by tests/test_ddtree_utils_triton.py in a subprocess without TRITON_INTERPRET (the
interpreter accepts code that the compiler may reject). Uses Triton's own compiler and the
ptxas it ships; prints one line per specialisation and exits 1 if any fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddtree_triton as dt  # noqa: E402
import ddtree_utils as du  # noqa: E402


def signature(fn, types: dict) -> dict:
    """Triton's signature dict in argument order; constexpr arguments marked as such."""
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


def compile_one(fn, types: dict, consts: dict, arch: int, warps: int | dict) -> str:
    """``warps``: num_warps, or the whole options dict (num_warps and e.g. maxnreg)."""
    sig = signature(fn, types)
    names = list(sig)
    src = ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(k),): v for k, v in consts.items()},
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=warps if isinstance(warps, dict) else {"num_warps": warps}
    )
    return f"{len(kernel.asm['cubin'])} bytes of cubin, {resource_usage(kernel.asm['cubin'])}"


def resource_usage(cubin: bytes) -> str:
    """Registers, spill stack, local and shared memory per thread / block of a cubin, from the
    cuobjdump that Triton ships (what decides how many programs fit on a multiprocessor)."""
    import os
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return "resource usage unknown (no cuobjdump in this Triton)"
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        os.write(fd, cubin)
        os.close(fd)
        out = subprocess.run([str(tool), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return "resource usage unknown"
    reg, stack, shared, local = m.groups()
    return f"{reg} registers, stack {stack} B, local {local} B, shared {shared} B"


BUILD = {"lp_ptr": "*fp32", "ids_ptr": "*i64", "pj_ptr": "*i32", "pr_ptr": "*i32",
         "wsf_ptr": "*fp32", "wsi_ptr": "*i32", "wsk_ptr": "*i64", "tok_ptr": "*i64",
         "par_ptr": "*i64", "dep_ptr": "*i64", "score_ptr": "*fp32", "valid_ptr": "*i8",
         "L": "i32", "kk": "i32", "B": "i32", "P": "i32"}  # fmt: skip
COMPILE = {"tok_ptr": "*i64", "par_ptr": "*i64", "dep_ptr": "*i64", "valid_ptr": "*i8",
           "bonus_ptr": "*i64", "seq_ptr": "*i64", "ws_ptr": "*i32", "out_tok_ptr": "*i64",
           "out_pos_ptr": "*i64", "out_par_ptr": "*i64", "out_dep_ptr": "*i64",
           "out_next_ptr": "*i64", "out_sib_ptr": "*i64", "mask_ptr": "*i8", "B": "i32",
           "STEPS": "i32"}  # fmt: skip
SUMEXP = {"x_ptr": "*bf16", "shift_ptr": "*fp32", "out_ptr": "*fp32", "V": "i32",
          "x_stride": "i32", "NC": "i32"}  # fmt: skip
SAMPLE = {"x_ptr": "*fp32", "temp_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32",
          "lmp_ptr": "*fp32", "greedy_ptr": "*i8", "seed_ptr": "*i64", "out_ptr": "*i64",
          "thr_ptr": "*fp32", "buf_ptr": "*fp32", "next_ptr": "*i32", "R": "i32", "V": "i32", "x_stride": "i32"}  # fmt: skip
SAMPLE_CONSTS = {"BLOCK": du._SAMPLE_BLOCK, "SBLOCK": du._SAMPLE_SBLOCK,
                 "NP": du._SAMPLE_PIVOTS, "MAX_PASSES": du._SAMPLE_MAX_PASSES,
                 "SEARCH": True, "CAP": du._sample_buffer_cap(151936, du._SAMPLE_SBLOCK),
                 "NS": du._pow2(-(-151936 // du._SAMPLE_BLOCK))}  # fmt: skip
SAMPLE_NO_SEARCH = {**SAMPLE_CONSTS, "SEARCH": False, "CAP": 0}
SAMPLE_OPTS = du._sample_launch_options(True)  # as _sample_rows_triton launches it
TREE_ATTN_PREFIX = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "indptr_ptr": "*i32",
                    "indices_ptr": "*i64", "ws_o_ptr": "*fp32", "ws_lse_ptr": "*fp32", "N": "i32",
                    "G": "i32", "D": "i32", "S": "i32", "RB": "i32", "MINK": "i32", "q_s0": "i32",
                    "q_s1": "i32", "k_s0": "i32", "k_s1": "i32", "v_s0": "i32", "v_s1": "i32",
                    "sm_scale": "fp32"}  # fmt: skip
TREE_ATTN_TREE = {"q_ptr": "*bf16", "kt_ptr": "*bf16", "vt_ptr": "*bf16", "indptr_ptr": "*i32",
                  "mask_ptr": "*i1", "mask_indptr_ptr": "*i32", "ws_o_ptr": "*fp32",
                  "ws_lse_ptr": "*fp32", "o_ptr": "*bf16", "N": "i32", "G": "i32", "D": "i32",
                  "S": "i32", "RB": "i32", "MINK": "i32", "q_s0": "i32", "q_s1": "i32", "kt_s0": "i32",
                  "kt_s1": "i32", "vt_s0": "i32", "vt_s1": "i32", "o_s0": "i32", "o_s1": "i32",
                  "sm_scale": "fp32"}  # fmt: skip
TREE_ATTN_CONSTS = {"BLOCK_R": du._TREE_ATTN_ROWS, "BLOCK_N": du._TREE_ATTN_KEYS, "BLOCK_D": 128}
TREE_ATTN_SMALL = {**TREE_ATTN_CONSTS, "BLOCK_R": du._TREE_ATTN_ROWS_SMALL}
KV_MOVE = {"ptrs_ptr": "*i64", "row_bytes_ptr": "*i64", "tgt_ptr": "*i64", "src_ptr": "*i64",
           "K": "i32"}  # fmt: skip

CASES = [
    # (kernel, argument types, constexprs, warps): the block sizes the wrappers pick for B = 1, 15,
    # 63 and 1023 (K = 16, L = 15), and the normaliser's chunk sizes
    (dt.ddtree_build_kernel, BUILD, {"BB": 2, "LB": 2, "PB": 2, "LOGK": 1}, 4),
    (dt.ddtree_build_kernel, BUILD, {"BB": 16, "LB": 16, "PB": 64, "LOGK": 5}, 4),
    (dt.ddtree_build_kernel, BUILD, {"BB": 64, "LB": 16, "PB": 256, "LOGK": 5}, 4),
    # B = 1023 (DDTREE_MAX_BUDGET): the largest kernel by far (a 3.3-3.8 MB cubin, 70-85 s of
    # Triton's passes and ptxas on this CPU, more than the other 15 cases together), compiled for
    # sm_120 only (sm120_only): its 99 KB of shared memory per block is the stricter limit, and on
    # sm_90 tests/gpu/test_ddtree_utils_cuda.py compiles and runs budget 1023 in every GPU session
    (dt.ddtree_build_kernel, BUILD, {"BB": 1024, "LB": 16, "PB": 8192, "LOGK": 5}, 16),
    (dt.ddtree_compile_kernel, COMPILE, {"NB": 2, "DB": 2, "RB": 2}, 4),
    (dt.ddtree_compile_kernel, COMPILE, {"NB": 64, "DB": 16, "RB": 64}, 4),
    (dt.ddtree_compile_kernel, COMPILE, {"NB": 1024, "DB": 16, "RB": 8}, 16),
    (dt.sumexp_partial_kernel, SUMEXP, {"CHUNK": 128}, 8),
    (dt.sumexp_partial_kernel, SUMEXP, {"CHUNK": 8192}, 8),
    # the target sampler as sample_from_logits launches it at V >= 1024, fp32 and bf16 logits,
    # with the threshold search and compiled without it (no row with top-k / top-p)
    (dt.sample_rows_kernel, SAMPLE, SAMPLE_CONSTS, SAMPLE_OPTS),
    (dt.sample_rows_kernel, {**SAMPLE, "x_ptr": "*bf16"}, SAMPLE_CONSTS, SAMPLE_OPTS),
    (dt.sample_rows_kernel, SAMPLE, SAMPLE_NO_SEARCH, du._sample_launch_options(False)),
    # the KV path move for depth + 1 = 2 and 16 rows per request
    (dt.move_kv_rows_kernel, KV_MOVE, {"KP": 2, "TILE": du._KV_MOVE_TILE}, 4),
    (dt.move_kv_rows_kernel, KV_MOVE, {"KP": 16, "TILE": du._KV_MOVE_TILE}, 4),
    # the tree-verify attention at head dim 128, bf16 (Qwen3 shapes)
    (dt.tree_attn_prefix_kernel, TREE_ATTN_PREFIX, TREE_ATTN_CONSTS, du._TREE_ATTN_WARPS),
    (dt.tree_attn_tree_kernel, TREE_ATTN_TREE, TREE_ATTN_CONSTS, du._TREE_ATTN_WARPS),
    (dt.tree_attn_prefix_kernel, TREE_ATTN_PREFIX, TREE_ATTN_SMALL, du._TREE_ATTN_WARPS),
    (dt.tree_attn_tree_kernel, TREE_ATTN_TREE, TREE_ATTN_SMALL, du._TREE_ATTN_WARPS),
]


def sm120_only(case: tuple) -> bool:
    """The case compiled for sm_120 alone (see CASES): budget 1023's tree build."""
    fn, _, consts, _ = case
    return fn is dt.ddtree_build_kernel and consts["BB"] == 1024


def cases_for(arch: int) -> list[tuple]:
    return [c for c in CASES if arch == 120 or not sm120_only(c)]


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    failed = 0
    cases = cases_for(arch)
    for fn, types, consts, warps in cases:
        label = f"{fn.__name__} {consts}"
        t0 = time.monotonic()
        try:
            print(
                f"ok   {label}: {compile_one(fn, types, consts, arch, warps)} ({time.monotonic() - t0:.1f} s)",
                flush=True,
            )
        except Exception as exc:  # report every failing specialisation, then fail
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {exc}", flush=True)
    print(f"{len(cases) - failed} of {len(cases)} specialisations compiled for sm_{arch}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
