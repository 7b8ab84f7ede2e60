#!/usr/bin/env python3
"""Benchmark the sampling verify's target sampler (ddtree_utils.sample_from_logits) on a GPU.

For R rows of V = 151936 random float32 logits (random logits are the hard case: at T = 0.7 and
top_p = 0.9 a row keeps ~87k tokens) it prints, per parameter set, the median ms (CUDA events,
eager and replayed from a CUDA graph) and the peak memory beyond the logits
(torch.cuda.max_memory_allocated), next to torch.argmax (the greedy verify's cost):

    python bench/sampling.py --out /tmp/sampling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddtree_utils as du

SETS = {  # name: (temperature, top_k, top_p)
    "greedy_argmax": None,
    "T0.7": (0.7, 1 << 30, 1.0),
    "T0.7_topk20": (0.7, 20, 1.0),
    "T0.7_topp0.9": (0.7, 1 << 30, 0.9),
    "T0.7_topk20_topp0.9": (0.7, 20, 0.9),
}


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1024, 2048, 3072, 12288])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    results = []
    print(f"{'rows':>6} {'case':<22} {'eager ms':>9} {'graph ms':>9} {'extra MiB':>10} {'logits MiB':>10}")
    for rows in args.rows:
        x = torch.randn(rows, args.vocab, device="cuda").to(dtype)
        for name, p in SETS.items():
            if p is None:
                fn = lambda x=x: torch.argmax(x, dim=-1)
            else:
                t, k, pp = p
                temp = torch.full((rows,), t, device="cuda")
                top_k = torch.full((rows,), k, dtype=torch.int32, device="cuda")
                top_p = torch.full((rows,), pp, device="cuda")
                fn = lambda x=x, t=temp, k=top_k, pp=top_p: du.sample_from_logits(x, t, k, pp, None, backend=args.backend)
            fn()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
            eager = median_ms(fn, args.reps)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            replay = median_ms(graph.replay, args.reps)
            del graph
            mib = extra / 2**20
            logits_mib = x.numel() * x.element_size() / 2**20
            print(f"{rows:>6} {name:<22} {eager:>9.3f} {replay:>9.3f} {mib:>10.1f} {logits_mib:>10.1f}", flush=True)
            results.append({"rows": rows, "case": name, "eager_ms": eager, "graph_ms": replay,
                            "extra_bytes": extra, "logits_bytes": x.numel() * x.element_size()})  # fmt: skip
        del x
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "dtype": args.dtype,
                                              "vocab": args.vocab, "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
