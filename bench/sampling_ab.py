#!/usr/bin/env python3
"""A/B of the target sampler's Triton kernel: the one main had until the sixth session (labelled
"main": b3a4fd6, key-linear pivots, every pass reads the row, Gumbel-max draw; frozen below) against the current ddtree_utils one
(value-linear pivots with a key-linear guard, the search buffer of the bracket's values, the
inverse-CDF draw), kernel alone, on a GPU (issue 13 item 1: top_p rows cost 1.28-1.47x a greedy
round). The current kernel also runs without its buffer and with other buffer sizes
(--buffer-divs), with other program counts (--programs-per-sm) and register caps
(--reg-programs).

For R rows of V random logits at temperature T it times each kernel with CUDA events (median of
--reps launches after a warm-up) for no filter, top_k 20, top_p 0.9, both, min_p 0.05 and min_p +
top_p, with the current kernel in several launch configurations (num_warps, SBLOCK; the no-filter
rows also compiled without the search, as sample_from_logits picks when it knows). Every
kernel's kept sets (s >= its threshold) are checked on every row against the float64 reference
rule (the dense reference target_probs_from_logits' keep mask, chunked): mismatching rows are
counted, with the smallest |mass above - top_p| among their differing tokens (a row within ~1e-11
is inside float64 summation rounding; anything larger is a wrong row).

    python3 bench/sampling_ab.py --out /tmp/sampling_ab.json          # H200: 2048 x 151936, T 0.7
    python3 bench/sampling_ab.py --smoke                              # CPU, Triton interpreter

Needs only torch and triton (and this checkout's ddtree_utils.py). Exit status 1 if the current
kernel's kept sets differ from the reference on any row outside float64 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before triton is imported: it reads this once
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddtree_reference as dr
import ddtree_utils as du
from ddtree_triton import _key_of, _load_scaled, _value_of  # main's kernel calls these

_MAIN_HELPERS = (_key_of, _load_scaled, _value_of)

TOP_K_ALL = 1 << 30
CASES = {  # name: (top_k, top_p, min_p)
    "no_filter": (TOP_K_ALL, 1.0, 0.0),
    "top_k20": (20, 1.0, 0.0),
    "top_p0.9": (TOP_K_ALL, 0.9, 0.0),
    "top_k20_top_p0.9": (20, 0.9, 0.0),
    "min_p0.05": (TOP_K_ALL, 1.0, 0.05),
    "min_p0.05_top_p0.9": (TOP_K_ALL, 0.9, 0.05),
}
FLOAT64_ROUNDING = 1e-11  # |mass - top_p| below this: float64 summation order may decide


@triton.jit
def main_sample_rows_kernel(
    x_ptr,  # [R, V] logits, any float dtype, row stride x_stride
    temp_ptr,  # [R] f32 temperature (1 for greedy rows)
    k_ptr,  # [R] i64 top_k in 1..V
    p_ptr,  # [R] f32 top_p (+inf: no limit)
    lmp_ptr,  # [R] f32 log(min_p) (-inf: no limit)
    greedy_ptr,  # [R] i8
    seed_ptr,  # [1] i64 Philox seed of this call
    out_ptr,  # [R] i64 out: the sampled token
    thr_ptr,  # [R] f32 out: the kept set is s >= thr
    V,
    x_stride,
    BLOCK: tl.constexpr,
    SBLOCK: tl.constexpr,
    NP: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    SEARCH: tl.constexpr,
):
    NEG = float("-inf")
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    temp = tl.load(temp_ptr + row)
    greedy = tl.load(greedy_ptr + row) != 0
    offs = tl.arange(0, BLOCK)
    # pass 1: max, smallest finite value, first argmax (the search sums its own float64
    # softmax denominator, so no sum of exp here: rows without top-k / top-p never need it)
    m_v = tl.full([BLOCK], NEG, tl.float32)
    lo_v = tl.full([BLOCK], float("inf"), tl.float32)
    arg_v = tl.full([BLOCK], V, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        s = _load_scaled(x_row, cols, V, temp)
        arg_v = tl.where(s > m_v, cols, arg_v)
        m_v = tl.maximum(m_v, s)
        lo_v = tl.minimum(lo_v, tl.where(s > NEG, s, float("inf")))
    peak = tl.max(m_v, axis=0)
    s_min = tl.min(lo_v, axis=0)
    arg = tl.min(tl.where(m_v == peak, arg_v, V), axis=0)
    arg = tl.where(arg >= V, 0, arg)
    sample = ~greedy & (peak > NEG)

    kk = tl.load(k_ptr + row)
    pp = tl.load(p_ptr + row)
    t_lo = tl.maximum(peak + tl.load(lmp_ptr + row), s_min)
    lo = (
        _key_of(t_lo) - 1
    )  # Q(lo) is taken as false: no candidate lies at or below lo
    hi = _key_of(peak)  # Q(max) is true: nothing lies strictly above the max
    thr_key = lo + 1  # min-p (or no limit) only
    if SEARCH:  # compiled out when the caller knows that no row has top-k / top-p
        search = sample & ((kk < V) | (pp < float("inf")))
        inside = tl.where(search, 1, 0)
        passes = 0
        c = tl.arange(0, NP)
        soffs = tl.arange(0, SBLOCK)
        peak64 = peak.to(tl.float64)
        pp64 = pp.to(tl.float64)
        n_hi = 0  # count strictly above hi (carried: hi only moves down)
        m_hi = tl.full([], 0.0, tl.float64)  # mass strictly above hi, unnormalised
        z = tl.full([], 1.0, tl.float64)  # sum of exp(s - peak), float64 (first pass)
        while (inside > 0) & (passes < MAX_PASSES):
            lo64 = lo.to(tl.int64)
            hi64 = hi.to(tl.int64)
            piv = lo64 + ((hi64 - lo64) * c) // (NP - 1)
            mid = (c > 0) & (c < NP - 1)
            piv = tl.where(mid, tl.minimum(tl.maximum(piv, lo64 + 1), hi64 - 1), piv)
            piv = piv.to(tl.int32)  # [NP] keys, lo = piv[0] <= ... <= piv[NP - 1] = hi
            piv2 = piv[:, None]
            # Tokens above hi count for every pivot (all <= hi) and are carried from the
            # last pass; tokens below lo count for none. Only BLOCK steps holding a token
            # in [lo, hi] (all of them in the first pass, which also sums z) redo their
            # columns in SBLOCK sub-steps into [NP, SBLOCK] partials, reduced once. With
            # SBLOCK == BLOCK (V <= 256) a step is its own sub-step: no band test, no
            # re-read (the interpreter's cost is mostly nested jit calls and reductions).
            first = passes == 0
            a_n = tl.full([NP, SBLOCK], 0, tl.int32)  # per column: #gt + 65536 * #eq
            a_m = tl.full([NP, SBLOCK], 0.0, tl.float64)
            a_z = tl.full([SBLOCK], 0.0, tl.float64)
            for start in range(0, V, BLOCK):
                s = _load_scaled(x_row, start + offs, V, temp)  # [BLOCK]
                key = _key_of(s)
                go = passes >= 0
                if SBLOCK < BLOCK:
                    band = (key >= lo) & (key <= hi)
                    go = first | (tl.max(band.to(tl.int32), axis=0) > 0)
                if go:
                    for sub in range(0, BLOCK, SBLOCK):
                        if SBLOCK < BLOCK:
                            ss = _load_scaled(x_row, start + sub + soffs, V, temp)
                            sk = _key_of(ss)  # [SBLOCK]
                        else:
                            ss = s
                            sk = key
                        e = tl.exp(ss.to(tl.float64) - peak64)  # 0 past V
                        a_z += e
                        kb = tl.where((sk >= lo) & (sk <= hi), sk, lo - 1)[None, :]
                        gt = kb > piv2  # lo - 1 (outside the band) counts for no pivot
                        a_n += tl.where(gt, 1, tl.where(kb == piv2, 65536, 0))
                        a_m += tl.where(gt, e[None, :], 0.0)
            if first:
                z = tl.sum(a_z, axis=0)
            n_gt = n_hi + tl.sum(a_n & 65535, axis=1)  # [NP] count strictly above each
            n_eq = tl.sum(a_n >> 16, axis=1)  # [NP] count equal to each pivot
            m_gt = m_hi + tl.sum(a_m, axis=1)  # [NP] unnormalised mass strictly above
            q = (n_gt < kk) & (m_gt / z < pp64)
            q = (q & (c > 0)) | (c == NP - 1)
            new_lo = tl.max(tl.where(q, -2147483647 - 1, piv), axis=0)
            new_hi = tl.min(tl.where(q, piv, 2147483647), axis=0)
            gt_lo = tl.min(tl.where(q, 2147483647, n_gt), axis=0)
            ge_hi = tl.max(tl.where(q, n_gt + n_eq, 0), axis=0)
            # at new_hi: n_gt and m_gt fall with the pivot, so their largest over q
            n_hi = tl.max(tl.where(q, n_gt, 0), axis=0)
            m_hi = tl.max(tl.where(q, m_gt, 0.0), axis=0)
            inside = gt_lo - ge_hi
            lo = new_lo
            hi = new_hi
            passes += 1
        thr_key = tl.where(search, hi, lo + 1)
    thr = tl.where(sample, _value_of(thr_key), peak)

    # last pass: Gumbel-max over s >= thr (chunks without a kept token draw no noise)
    best_v = tl.full([BLOCK], NEG, tl.float64)
    best_i = tl.full([BLOCK], V, tl.int32)
    if sample:
        seed = tl.load(seed_ptr) + row
        for start in range(0, V, BLOCK):
            cols = start + offs
            s = _load_scaled(x_row, cols, V, temp)
            keep = (s >= thr) & (cols < V)
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                r0, r1, _, _ = tl.randint4x(seed, cols)
                u = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)  # fmt: skip
                score = tl.where(keep, s.to(tl.float64) - tl.log(-tl.log(u)), NEG)
                better = score > best_v
                best_v = tl.where(better, score, best_v)
                best_i = tl.where(better, cols, best_i)
    top = tl.max(best_v, axis=0)
    drawn = tl.min(tl.where(best_v == top, best_i, V), axis=0)
    drawn = tl.where(drawn >= V, arg, drawn)
    tl.store(out_ptr + row, tl.where(sample, drawn, arg).to(tl.int64))
    tl.store(thr_ptr + row, thr)


def main_kernel(x, temp, kk, pp, log_mp, greedy):
    """main's launch (b3a4fd6..): BLOCK 1024, SBLOCK 128, 16 keys, 4 warps. Returns (token, thr)."""
    rows, vocab = x.shape
    seed = torch.randint(0, 1 << 62, (1,), dtype=torch.int64, device=x.device)
    token = torch.empty(rows, dtype=torch.int64, device=x.device)
    thr = torch.empty(rows, dtype=torch.float32, device=x.device)
    block, sblock = du._sample_blocks(vocab)
    main_sample_rows_kernel[(rows,)](
        x, temp, kk, pp, log_mp, greedy.to(torch.int8), seed, token, thr, vocab, x.stride(0),
        BLOCK=block, SBLOCK=sblock, NP=16, MAX_PASSES=48, SEARCH=True, num_warps=4,
    )  # fmt: skip
    return token, thr


def new_kernel(warps: int, sblock: int, search: bool, buffer_cap: int | None = None,
               programs: int | None = None, maxnreg: int | None | str = "default"):  # fmt: skip
    """The current kernel (du._sample_rows_triton) with this launch configuration
    (``buffer_cap`` 0: without the search's buffer; ``programs``: how many share the rows;
    ``maxnreg``: a register cap, None for none, "default" for du._SAMPLE_MAXNREG)."""

    def run(x, temp, kk, pp, log_mp, greedy):
        old = du._SAMPLE_WARPS, du._SAMPLE_WARPS_NO_SEARCH, du._SAMPLE_SBLOCK, du._SAMPLE_MAXNREG
        du._SAMPLE_WARPS = du._SAMPLE_WARPS_NO_SEARCH = warps
        du._SAMPLE_SBLOCK = sblock
        if maxnreg != "default":
            du._SAMPLE_MAXNREG = maxnreg
        try:
            return du._sample_rows_triton(
                x, temp, kk, pp, log_mp, greedy, None, search, buffer_cap, programs
            )
        finally:
            du._SAMPLE_WARPS, du._SAMPLE_WARPS_NO_SEARCH, du._SAMPLE_SBLOCK, du._SAMPLE_MAXNREG = old

    return run


def reference_kept(s: torch.Tensor, kk, pp, log_mp, chunk: int):
    """``(kept [R, V] bool, mass_above [R, V] float64 or None)`` of the float64 rule on
    ``s = x / temp``: target_probs_from_logits' keep mask, ``chunk`` rows at a time."""
    kept = torch.empty(s.shape, dtype=torch.bool, device=s.device)
    for a in range(0, s.shape[0], chunk):
        r = slice(a, a + chunk)
        keep, _ = reference_chunk(s[r], kk[r], pp[r], log_mp[r])
        kept[r] = keep
    return kept


def reference_chunk(s, kk, pp, log_mp):
    desc = torch.sort(s, dim=-1, descending=True).values
    prob = torch.softmax(desc.double(), dim=-1)
    n_gt = torch.searchsorted(-desc.contiguous(), -s.contiguous(), right=False)
    mass_before = torch.cat([torch.zeros_like(prob[..., :1]), prob.cumsum(dim=-1)], dim=-1)
    m_gt = mass_before.gather(-1, n_gt)  # [r, V] float64 mass strictly above each token
    peak = desc[..., :1]
    keep = (n_gt < kk.view(-1, 1)) & (m_gt < pp.double().view(-1, 1)) & (s >= peak + log_mp.view(-1, 1))
    return keep, m_gt


def mismatches(s, thr, ref, kk, pp, log_mp, chunk):
    """Rows whose kept set differs: [(row, kept, ref kept, min |mass above - top_p|)]."""
    kept = s >= thr.view(-1, 1)
    bad = (kept != ref).any(dim=1).nonzero().view(-1).tolist()
    out = []
    for r in bad:
        _, m_gt = reference_chunk(s[r : r + 1], kk[r : r + 1], pp[r : r + 1], log_mp[r : r + 1])
        diff = kept[r] != ref[r]
        margin = (m_gt[0][diff] - float(pp[r])).abs().min().item()
        out.append((r, int(kept[r].sum()), int(ref[r].sum()), margin))
    return out


def timed(fn, reps: int, cuda: bool) -> float:
    if cuda:
        fn()  # warm-up: compilation
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temp", type=float, default=0.7)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=256, help="reference rows per chunk")
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--configs", nargs="+", default=["4x128", "8x128"],
                    help="current kernel's WARPSxSBLOCK launch configurations")  # fmt: skip
    ap.add_argument("--buffer-divs", type=int, nargs="*", default=[8],
                    help="also run the current kernel with a buffer of V / each of these")
    ap.add_argument("--programs-per-sm", type=int, nargs="*", default=[0, 2],
                    help="also run it with these programs per multiprocessor (0: one per row)")
    ap.add_argument("--reg-programs", nargs="*", default=["0x3"],
                    help="CUDA, 4 warps: also run with REGxPERSM (a register cap, 0 for none, "
                    "and programs per multiprocessor); 0x3 is the uncapped kernel before the cap")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, 4 x 2048, 1 rep")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.vocab, args.reps, args.configs = 4, 2048, 1, args.configs[:2]
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    x = torch.randn(args.rows, args.vocab, device=device, generator=gen).to(dtype)
    results, wrong = [], 0
    print(f"{args.rows} rows x V {args.vocab}, T {args.temp}, {args.dtype}, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}")  # fmt: skip
    print(f"{'case':<20} {'kernel':<34} {'ms':>9} {'vs main':>8} {'rows off':>8}  worst margin")
    for name in args.cases:
        k, p, mp = CASES[name]
        params = du._sampling_rows(args.rows, args.vocab, device, args.temp, k, p, mp)
        temp, kk, pp, log_mp, _ = params
        s = x.float() / temp.view(-1, 1) + 0.0
        ref = reference_kept(s, kk, pp, log_mp, args.chunk)
        if args.smoke:  # the chunked rule is the dense reference's keep mask
            dense = dr.target_probs_from_logits(x, args.temp, k, p, mp) > 0
            assert torch.equal(ref, dense), name
        no_filter = not du._may_filter(k, p, args.vocab)
        variants = [("main 4w", main_kernel)]
        for cfg in args.configs:
            w, sb = (int(v) for v in cfg.split("x"))
            variants.append((f"new {w}w SBLOCK {sb}", new_kernel(w, sb, True)))
            variants.append((f"new {w}w SBLOCK {sb} no buffer", new_kernel(w, sb, True, 0)))
            for div in args.buffer_divs:  # other buffer sizes than the default V / _SAMPLE_BUFFER_DIV
                cap = sb * -(-(-(-args.vocab // div)) // sb)
                variants.append((f"new {w}w SBLOCK {sb} buffer V/{div}", new_kernel(w, sb, True, cap)))
            for per_sm in args.programs_per_sm:  # 0: a program (and a buffer) per row
                n = per_sm * torch.cuda.get_device_properties(device).multi_processor_count if per_sm and cuda else args.rows
                label = f"new {w}w SBLOCK {sb} " + (f"{per_sm}/SM" if per_sm else "1/row")
                variants.append((label, new_kernel(w, sb, True, None, n)))
            for rp in args.reg_programs if cuda and w == 4 else []:  # register cap x programs per SM
                reg, per_sm = (int(v) for v in rp.split("x"))
                n = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
                label = f"new {w}w SBLOCK {sb} " + (f"maxnreg {reg}" if reg else "no reg cap") + f" {per_sm}/SM"
                variants.append((label, new_kernel(w, sb, True, None, n, reg or None)))
        if no_filter:  # what sample_from_logits launches when the host knows
            for w in sorted({int(c.split("x")[0]) for c in args.configs}):
                variants.append((f"new {w}w no search", new_kernel(w, du._SAMPLE_SBLOCK, False)))
        base_ms = None
        for label, fn in variants:
            ms = timed(lambda fn=fn, params=params: fn(x, *params), args.reps, cuda)
            _, thr = fn(x, *params)
            off = mismatches(s, thr, ref, kk, pp, log_mp, args.chunk)
            real = [o for o in off if o[3] > FLOAT64_ROUNDING]
            if label.startswith("new"):
                wrong += len(real)
            base_ms = ms if base_ms is None else base_ms
            worst = f"{min(o[3] for o in off):.3g}" if off else "-"
            print(f"{name:<20} {label:<34} {ms:>9.3f} {ms / base_ms:>8.3f} {len(off):>8}  {worst}", flush=True)
            results.append({"case": name, "kernel": label, "ms": ms, "vs_main": ms / base_ms,
                            "rows_off": len(off), "rows_off_beyond_float64_rounding": len(real),
                            "off": off[:20]})  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": args.rows,
            "vocab": args.vocab, "temp": args.temp, "dtype": args.dtype, "reps": args.reps,
            "results": results}, indent=2))  # fmt: skip
    print("kept sets: current kernel " + ("equal to the float64 reference on every row" if not wrong
          else f"WRONG on {wrong} rows (beyond float64 rounding)"))  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
