#!/usr/bin/env python3
"""Static cost model of the target sampler's Triton kernel, for comparing two versions of it
without a GPU (issue 13 item 1): how many instructions a row costs, not how long it takes.

Two parts, multiplied together:
1. The sm_90 machine code of the sampling kernel (``ddtree_triton.sample_rows_kernel``; Triton's compiler and the nvdisasm it
   ships, as tests/triton_aot.py): the instruction count of each loop body, found by the source
   line it holds (pass 1, a search sub-step, a search BLOCK step, the buffer copy, the draw).
   Also the registers per thread (occupancy).
2. A numpy replay of the kernel's search on the same rows (pivots, brackets, buffer, in float64
   as the kernel): how many times each loop body runs per row.

A version is this checkout's ddtree_utils.py and ddtree_triton.py or ``--ref REV`` (``git show``
of both; before the split the kernel was in ddtree_utils.py);
the replay follows the version's pivot rule and buffer (detected from its source). Prints, per
case, the loop counts and the estimated warp instructions per row of each version and their
ratio. It is a model: it ignores memory traffic, latency and occupancy (it prints the
registers); the GPU A/B (bench/sampling_ab.py) is the measurement.

    python3 bench/sampling_model.py --ref main            # this checkout against main
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CASES = {"no_filter": (None, None), "top_k20": (20, None), "top_p0.9": (None, 0.9),
         "top_k20_top_p0.9": (20, 0.9)}  # fmt: skip
# loop bodies, by a line of the source each one holds (the innermost loop holding it)
MARKERS = {
    "pass1": "lo_v = tl.minimum(lo_v",
    "substep": "a_n += tl.where(gt, 1",
    "step": "go = first | (tl.max(band",
    "copy": "tl.store(buf_row + at, s, mask=band)",
    "recompact": "tl.store(buf_row + at, ss, mask=band)",
    "draw": ("score = tl.where(keep, s.to(tl.float64) - tl.log(", "w_steps = tl.where(steps =="),
}


def load_version(ref: str | None, workdir: Path):
    """(module, kernel source path, source text) of ddtree_utils at ``ref`` (None: this checkout).

    Since the kernels moved to ddtree_triton.py, a version is ddtree_utils.py plus, when the
    revision has it, ddtree_triton.py; both are loaded as one temporary package so that
    ddtree_utils imports its own revision's kernels. The kernel source path is the file that
    holds the sampling kernel; the source text is both files (the replay reads features from it).
    """
    tag = "checkout" if ref is None else re.sub(r"[^A-Za-z0-9]", "_", ref)
    pkg = workdir / f"ddtree_model_{tag}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("ddtree_utils.py", "ddtree_triton.py"):
        if ref is None:
            if (ROOT / name).is_file():
                (pkg / name).write_bytes((ROOT / name).read_bytes())
            continue
        got = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{name}"],
                             check=False, capture_output=True, text=True)  # fmt: skip
        if got.returncode and name == "ddtree_utils.py":
            raise SystemExit(f"--ref {ref}: no ddtree_utils.py there ({got.stderr.strip()})")
        if not got.returncode:
            (pkg / name).write_text(got.stdout)
    sys.path.insert(0, str(workdir))
    try:
        mod = importlib.import_module(f"{pkg.name}.ddtree_utils")
    finally:
        sys.path.remove(str(workdir))
    kernels = pkg / "ddtree_triton.py"
    path = kernels if kernels.is_file() else pkg / "ddtree_utils.py"
    text = "\n".join(p.read_text() for p in (pkg / "ddtree_utils.py", kernels) if p.is_file())
    return mod, path, text


def kernel_of(mod):
    """The sampling kernel of a loaded version (ddtree_triton.sample_rows_kernel, or the
    single-file layout's _sample_rows_kernel)."""
    kernels = getattr(mod, "ddtree_triton", None)
    if kernels is not None and hasattr(kernels, "sample_rows_kernel"):
        return kernels.sample_rows_kernel
    return mod._sample_rows_kernel


def sass(mod, path: Path, vocab: int, workdir: Path) -> tuple[dict, int]:
    """Instructions per iteration of each marked loop body, and registers per thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel_of(mod)
    types = {"x_ptr": "*fp32", "temp_ptr": "*fp32", "k_ptr": "*i64", "p_ptr": "*fp32",
             "lmp_ptr": "*fp32", "greedy_ptr": "*i8", "seed_ptr": "*i64", "out_ptr": "*i64",
             "thr_ptr": "*fp32", "buf_ptr": "*fp32", "next_ptr": "*i32", "R": "i32", "V": "i32", "x_stride": "i32"}  # fmt: skip
    block, sblock = mod._sample_blocks(vocab)
    consts = {"BLOCK": block, "SBLOCK": sblock, "NP": mod._SAMPLE_PIVOTS,
              "MAX_PASSES": mod._SAMPLE_MAX_PASSES, "SEARCH": True}  # fmt: skip
    if "CAP" in fn.arg_names:
        consts["CAP"] = mod._sample_buffer_cap(vocab, sblock)
    if "NS" in fn.arg_names:
        consts["NS"] = mod._pow2(-(-vocab // block))
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": mod._SAMPLE_WARPS})  # fmt: skip
    cubin = workdir / f"{path.stem}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    text = subprocess.run([str(bindir / "nvdisasm"), "-c", "-g", str(cubin)],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip
    usage = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                           check=True, capture_output=True, text=True).stdout  # fmt: skip
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    # instructions with their source line; loops = backward branches
    labels, ins, pending, line = {}, [], [], None
    for raw in text.splitlines():
        m = re.match(r'\s*//## File "(.*)", line (\d+)', raw)
        if m:  # the kernel's own lines (inlined Triton library code names its own file)
            line = None if "/triton/" in m.group(1) else int(m.group(2))
            continue
        m = re.match(r"^\s*(\.L_x_\d+):", raw)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", raw)
        if m:
            for p in pending:
                labels[p] = len(ins)
            pending = []
            ins.append((m.group(2).strip(), line))
    loops = []
    for i, (op, _) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", op)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    src_lines = path.read_text().splitlines()
    sizes = {}
    for name, marks in MARKERS.items():
        marks = (marks,) if isinstance(marks, str) else marks
        want = {n + 1 for n, t in enumerate(src_lines) if any(k in t for k in marks)}
        holding = [(b - a + 1, a, b) for a, b in loops
                   if any(ins[k][1] in want for k in range(a, b + 1))]  # fmt: skip
        if holding:
            n, a, b = min(holding)
            # an outer loop's own instructions: its body less the loops nested in it
            inner = [(c, d) for c, d in loops if a <= c and d <= b and (c, d) != (a, b)]
            nested = sum(d - c + 1 for c, d in inner if not any(
                e <= c and d <= f and (e, f) != (c, d) for e, f in inner))
            sizes[name] = n - nested
    return sizes, regs


def replay(mod, src: str, s: np.ndarray, top_k, top_p) -> tuple[Counter, float]:
    """Loop iterations of one row ``s`` (float32, already divided by T) as the version's kernel
    runs them (pass-1 steps, search BLOCK steps, sub-steps of the row or the buffer, copy and
    re-compaction steps, draw steps, passes), and the threshold the search ends on."""
    value_pivots = "by_value" in src
    cdf = "w_steps" in src
    vocab = s.size
    block, sblock = mod._sample_blocks(vocab)
    cap = mod._sample_buffer_cap(vocab, sblock) if "_sample_buffer_cap" in src else 0
    recompact = "tl.store(buf_row + at, ss, mask=band)" in src
    npiv = mod._SAMPLE_PIVOTS
    keys = mod._ordered_keys(torch.from_numpy(s)).numpy().astype(np.int64)
    nsteps = -(-vocab // block)
    step_of = np.arange(vocab) // block
    n = Counter(pass1=nsteps)
    peak = float(s.max())
    e = np.exp(s.astype(np.float64) - peak)
    z = e.sum()
    kk = vocab if top_k is None else top_k
    pp = np.inf if top_p is None else top_p

    def key_of(v):  # the kernel's _key_of / ddtree_utils._ordered_keys of one float32
        return int(mod._ordered_keys(torch.tensor([v], dtype=torch.float32))[0])

    def value_of(k):
        return float(mod._from_ordered_keys(torch.tensor([int(k)], dtype=torch.int32))[0])

    lo, hi = key_of(float(s.min())) - 1, key_of(peak)
    c = np.arange(npiv)
    inside = 1 if (kk < vocab or pp < np.inf) else 0
    use_value, before, n_buf, passes = True, vocab, -1, 0
    while inside > 0 and passes < mod._SAMPLE_MAX_PASSES:
        piv = lo + ((hi - lo) * c) // (npiv - 1)
        v_lo, v_hi = value_of(lo), value_of(hi)
        by_value = value_pivots and use_value and v_lo > -np.inf and v_hi < np.inf
        if by_value:
            pv = (v_lo + (v_hi - v_lo) * c.astype(np.float64) / (npiv - 1)).astype(np.float32)
            piv = np.array([key_of(v) for v in pv])
        piv = np.where(c == 0, lo, np.where(c == npiv - 1, hi, piv))
        mid = (c > 0) & (c < npiv - 1)
        piv = np.where(mid, np.minimum(np.maximum(piv, lo + 1), hi - 1), piv)
        band = (keys >= lo) & (keys <= hi)
        if n_buf >= 0:
            n["buffer_substeps"] += -(-n_buf // sblock)
        else:
            go = np.ones(nsteps, bool) if passes == 0 else np.bincount(
                step_of[band], minlength=nsteps) > 0
            n["search_steps"] += nsteps
            n["substeps"] += int(go.sum()) * (block // sblock)
        n_gt = np.array([(keys > p).sum() for p in piv])
        n_eq = np.array([(keys == p).sum() for p in piv])
        m_gt = np.array([e[keys > p].sum() for p in piv])
        q = (n_gt < kk) & (m_gt / z < pp)
        q = (q & (c > 0)) | (c == npiv - 1)
        new_lo, new_hi = piv[~q].max(), piv[q].min()
        inside = int(n_gt[~q].min() - (n_gt + n_eq)[q].max())
        ge_lo, n_hi = int((n_gt + n_eq)[~q].min()), int(n_gt[q].max())
        use_value = (not by_value) or 4 * inside <= before
        before, lo, hi = inside, new_lo, new_hi
        passes += 1
        n_band = ge_lo - n_hi
        if cap and n_buf < 0 and inside > 0 and n_band <= cap:
            band = (keys >= lo) & (keys <= hi)
            with_band = int((np.bincount(step_of[band], minlength=nsteps) > 0).sum())
            n["copy_steps"] += with_band  # the others cost a search step's load and test
            n["search_steps"] += nsteps - with_band
            n_buf = n_band
        elif recompact and n_buf > sblock and inside > 0 and 4 * n_band <= n_buf:
            n["recompact_substeps"] += -(-n_buf // sblock)
            n_buf = n_band
    n["passes"] = passes
    thr = value_of(hi) if passes else value_of(lo + 1)
    kept = s >= thr
    n["draw_steps"] = int((np.bincount(step_of[kept], minlength=nsteps) > 0).sum()) + int(cdf)
    return n, thr


def cost(n: Counter, sizes: dict) -> float:
    """Warp instructions of one row, per warp (each of the kernel's warps runs them all)."""
    return (n["pass1"] * sizes.get("pass1", 0)
            + n["search_steps"] * sizes.get("step", 0)
            + (n["substeps"] + n["buffer_substeps"]) * sizes.get("substep", 0)
            + n["copy_steps"] * sizes.get("copy", 0)
            + n["recompact_substeps"] * sizes.get("recompact", 0)
            + n["draw_steps"] * sizes.get("draw", 0))  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main", help="git revision to compare this checkout with")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--buffer-div", type=int, help="replay this checkout with a buffer of V / this")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    versions = []
    with tempfile.TemporaryDirectory(prefix="sampling_model_") as tmp:
        for ref in (args.ref, None):
            mod, path, text = load_version(ref, Path(tmp))
            if ref is None and args.buffer_div:
                mod._SAMPLE_BUFFER_DIV = args.buffer_div
            sizes, regs = sass(mod, path, args.vocab, Path(tmp))
            versions.append((ref or "this checkout", mod, text, sizes, regs))
            print(f"{ref or 'this checkout'}: {regs} registers/thread, loop bodies (instructions "
                  f"per iteration per warp): {sizes}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(args.rows, args.vocab, generator=gen) / args.temp).numpy().astype(np.float32)
    print(f"{args.rows} rows of {args.vocab} N(0, 1) logits at T {args.temp}; per row, mean:")
    for case, (k, p) in CASES.items():
        line = []
        costs = []
        for label, mod, src, sizes, _ in versions:
            counts = [replay(mod, src, row, k, p)[0] for row in x]
            mean = {key: sum(cn[key] for cn in counts) / len(counts) for key in
                    ("passes", "substeps", "buffer_substeps", "copy_steps",
                     "recompact_substeps", "draw_steps")}
            costs.append(sum(cost(cn, sizes) for cn in counts) / len(counts))
            line.append(f"{label}: " + ", ".join(f"{k2} {v:g}" for k2, v in mean.items())
                        + f", {costs[-1] / 1e3:.0f}k instr")  # fmt: skip
        print(f"  {case:<18} " + " | ".join(line) + f" | ratio {costs[1] / costs[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
