#!/usr/bin/env python3
"""Benchmark DDTree draft top-k, tree build and tree compile (CPU and CUDA).

For every (bs, B) it times, on the same logits ([bs, L, V], bf16 by default):

* ``bare_topk``: ``torch.topk(logits, K)``, the memory-bound floor (K = min(B, V));
* ``topk_logp``: :func:`ddtree_utils.draft_topk_logprobs` (top-k + full-vocab log-probs);
  ``topk_logp_<backend>`` / ``topk_logp_graph_<backend>``: with ``backend=`` forced, eager
  and replayed from a CUDA graph (no NaN check);
* ``naive_logp``: ``log_softmax(logits.float())`` then ``topk`` (two passes, for orientation);
* ``build`` / ``build_compile``: :func:`build_tree` (+ :func:`compile_tree` without the
  variable-length custom mask), eager;
* ``graph``: build + compile captured once in a ``torch.cuda.CUDAGraph`` and replayed (CUDA);
  ``build_<backend>`` / ``build_compile_<backend>`` / ``graph_<backend>``: the same with
  ``backend=`` forced (``--backends torch triton``), each checked against the heap;
* ``custom_mask``: :func:`tree_custom_mask` for prefix length ``--seq-len`` (eager);
* ``heap``: :func:`build_tree_reference` (per-request Python heap incl. its device-to-host copy).

Prints a table (median ms) and writes JSON with ``--out``. Example:

    python bench/tree_build.py --device cuda --out /tmp/tree_build.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import ddtree_reference as dr
import ddtree_utils as du

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Median wall time in ms of ``fn`` over ``reps`` calls (CUDA: events, synchronised)."""

    def run(fn: Callable[[], object], reps: int) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return run


def capture(fn: Callable[[], object]) -> Callable[[], None]:
    """Capture ``fn`` in a CUDA graph and return its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench_case(args, device, logits, budget, time_it) -> dict:
    bs, depth, vocab = logits.shape
    k = min(budget, vocab)
    reps, heap_reps = args.reps, args.heap_reps
    row: dict = {
        "device": device.type,
        "bs": bs,
        "B": budget,
        "L": depth,
        "V": vocab,
        "K": k,
    }
    row["bare_topk"] = time_it(lambda: torch.topk(logits, k, dim=-1), reps)
    row["topk_logp"] = time_it(lambda: du.draft_topk_logprobs(logits, k), reps)
    row["topk_logp_nocheck"] = time_it(
        lambda: du.draft_topk_logprobs(logits, k, validate=False), reps
    )
    if args.fused:
        row["topk_logp_fused"] = time_it(
            lambda: du.draft_topk_logprobs(logits, k, validate=False, fused=True), reps
        )
    if device.type == "cuda":
        for name, fused in [("topk_logp_graph", False)] + [
            ("fused_graph", True)
        ] * args.fused:
            replay = capture(
                lambda f=fused: du.draft_topk_logprobs(
                    logits, k, validate=False, fused=f
                )
            )
            row[name] = time_it(replay, reps)
    for backend in args.backends:
        row[f"topk_logp_{backend}"] = time_it(
            lambda b=backend: du.draft_topk_logprobs(
                logits, k, validate=False, backend=b
            ),
            reps,
        )
        if device.type == "cuda":
            replay = capture(
                lambda b=backend: du.draft_topk_logprobs(
                    logits, k, validate=False, backend=b
                )
            )
            row[f"topk_logp_graph_{backend}"] = time_it(replay, reps)
    for chunk in args.chunks:
        row[f"topk_logp_c{chunk}"] = time_it(
            lambda c=chunk: du.draft_topk_logprobs(
                logits, k, chunk_size=c, validate=False
            ),
            reps,
        )
    if not args.skip_naive:
        row["naive_logp"] = time_it(
            lambda: torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1), reps
        )
    row["logp_over_bare"] = row["topk_logp"] / row["bare_topk"]
    if "tree" not in args.parts:
        return row
    lp, ids = du.draft_topk_logprobs(logits, k)
    bonus = torch.zeros(bs, dtype=torch.int64, device=device)
    seq_lens = torch.full((bs,), args.seq_len, dtype=torch.int64, device=device)

    def build(backend="auto"):
        return du.build_tree(lp, ids, budget, backend=backend)

    def build_compile(backend="auto"):
        return du.compile_tree(
            build(backend),
            bonus,
            seq_lens,
            build_custom_mask=False,
            max_depth=depth,
            backend=backend,
        )

    # the benchmarked builders must agree with the reference on these real inputs
    ref = dr.build_tree_reference(lp, ids, budget)
    row["build"] = time_it(build, reps)
    row["build_compile"] = time_it(build_compile, reps)
    for backend in args.backends:
        build_b = functools.partial(build, backend)
        build_compile_b = functools.partial(build_compile, backend)
        row[f"build_{backend}"] = time_it(build_b, reps)
        row[f"build_compile_{backend}"] = time_it(build_compile_b, reps)
        if device.type == "cuda":
            row[f"graph_build_{backend}"] = time_it(capture(build_b), reps)
            row[f"graph_{backend}"] = time_it(capture(build_compile_b), reps)
        row[f"exact_{backend}"] = all(torch.equal(a, b) for a, b in zip(ref, build_b()))
    compiled = build_compile()
    lens_cpu = [args.seq_len] * bs
    row["custom_mask"] = time_it(
        lambda: du.tree_custom_mask(compiled.tree_mask, lens_cpu), reps
    )
    if device.type == "cuda" and args.selects:
        default = du._BEAM_SELECT
        for method in args.selects:
            du._BEAM_SELECT = method
            row[f"graph_{method}"] = time_it(capture(build_compile), reps)
            row[f"graph_build_{method}"] = time_it(capture(build), reps)
        du._BEAM_SELECT = default
    if device.type == "cuda":
        row["graph"] = time_it(capture(build_compile), reps)
    row["heap"] = time_it(lambda: dr.build_tree_reference(lp, ids, budget), heap_reps)
    fast = row.get("graph", row["build_compile"])
    row["heap_over_fast"] = row["heap"] / fast
    row["exact"] = all(torch.equal(a, b) for a, b in zip(ref, build())) and all(
        row[f"exact_{b}"] for b in args.backends
    )
    return row


COLUMNS = [
    "device", "bs", "B", "bare_topk", "topk_logp", "topk_logp_nocheck", "naive_logp", "build",
    "build_compile", "graph", "custom_mask", "heap", "heap_over_fast", "logp_over_bare", "exact",
]  # fmt: skip


def print_table(rows: list[dict], header: bool = True) -> None:
    extra = sorted({c for r in rows for c in r if c not in COLUMNS})
    cols = [c for c in COLUMNS + extra if any(c in r for r in rows)]
    if header:
        print(" | ".join(f"{c:>13}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:>13.3f}" if isinstance(v, float) else f"{v!s:>13}")
        print(" | ".join(cells), flush=True)


MD_COLUMNS = [
    ("bs", "bs"), ("B", "B"), ("bare_topk", "bare topk"), ("topk_logp", "topk+logp"),
    ("logp_over_bare", "ratio"), ("topk_logp_graph", "topk+logp graph"),
    ("topk_logp_fused", "fused"), ("fused_graph", "fused graph"), ("naive_logp", "log_softmax+topk"), ("build", "build"),
    ("build_compile", "build+compile"), ("graph", "graph replay"), ("custom_mask", "custom mask"),
    ("heap", "heap ref"), ("heap_over_fast", "heap / fast"), ("exact", "exact"),
]  # fmt: skip


def render_markdown(path: Path) -> str:
    """A BENCHMARKS.md table (milliseconds, medians) from a JSON file written by --out."""
    data = json.loads(path.read_text())
    rows = data["rows"]
    cols = [(k, t) for k, t in MD_COLUMNS if any(k in r for r in rows)]
    lines = ["| " + " | ".join(t for _, t in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 512])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--heap-reps", type=int, default=5)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument(
        "--fused", action="store_true", help="also time fused=True (torch.compile)"
    )
    p.add_argument(
        "--selects", nargs="*", default=[], help="beam-selection kernels to time"
    )
    p.add_argument(
        "--backends",
        nargs="*",
        default=[],
        help="build_tree/compile_tree backends to time side by side (torch, triton)",
    )
    p.add_argument(
        "--chunks", type=int, nargs="*", default=[], help="extra chunk sizes to time"
    )
    p.add_argument(
        "--parts",
        nargs="+",
        default=["topk", "tree"],
        choices=["topk", "tree"],
        help="tree: also time the tree build and compile (topk is always timed)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--render", type=Path, help="print a markdown table from a JSON file and exit"
    )
    args = p.parse_args(argv)
    if args.render:
        print(render_markdown(args.render))
        return 0
    device = torch.device(args.device)
    time_it = timer(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    for bs in args.bs:
        # draft-like logits: a few strong tokens per position over a Gaussian background
        logits = (
            torch.randn(bs, args.depth, args.vocab, generator=gen, device=device) * 2
        )
        logits = logits.to(DTYPES[args.dtype])
        for budget in args.budgets:
            rows.append(bench_case(args, device, logits, budget, time_it))
            print_table(rows[-1:], header=len(rows) == 1)
        del logits
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "reps": args.reps,
        "heap_reps": args.heap_reps,
        "seq_len": args.seq_len,
        "command": " ".join(sys.argv),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(json.dumps(info), file=sys.stderr)
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
