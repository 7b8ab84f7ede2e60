#!/usr/bin/env python3
"""Time the tree-verify attention per layer on this GPU, inside a CUDA graph as the serving round
runs it, for several launch settings, beside SGLang's own Triton extend kernel (what upstream
DFLASH's verify runs) on the same prefix.

Why: at batch 1 the lifted-pair profile (BENCHMARKS.md, fourteenth session) measured the two
tree-attention kernels at 27 us a layer against 14 us for DFLASH's extend kernel: 0.5 ms of b63's
round on 36 layers. The settings tried are the rows per program (``_TREE_ATTN_ROWS``, and ``_TREE_ATTN_ROWS_SMALL`` where the programs are few), the warps
per program (``_TREE_ATTN_WARPS``) and the fewest prefix keys per split
(``_TREE_ATTN_MIN_SPLIT_KEYS``).

Per case (batch, tree width N, prefix length) and setting: one graph of ``--layers`` calls
(different K/V caches per layer, as a model's layers), replayed ``--reps`` times; the time per
call, and the largest error against ``ddtree_reference.tree_verify_attention_reference`` (float32)
next to the extend kernel's. ``--apply FILE`` writes the fastest setting at batch 1 (summed over
the batch-1 cases) into a ddtree_utils.py (an overlay's copy on the GPU machine) and prints it.

    PYTHONPATH=/tmp/site python3 bench/tree_attn_bench.py [--apply /tmp/site/sglang/srt/speculative/ddtree_utils.py]
Needs CUDA and SGLang 0.5.16's ``sglang.kernels.ops.attention.extend_attention`` (for the
baseline; without it only the tree attention is timed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SETTINGS = ("_TREE_ATTN_ROWS", "_TREE_ATTN_ROWS_SMALL", "_TREE_ATTN_WARPS", "_TREE_ATTN_MIN_SPLIT_KEYS")


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """'1x64x200,4x64x500' -> [(bs, n, prefix), ...]."""
    out = []
    for part in text.split(","):
        try:
            bs, n, plen = (int(x) for x in part.strip().split("x"))
        except ValueError:
            raise SystemExit(f"--cases: {part!r}: give BSxNxPREFIX, e.g. 1x64x200") from None
        if bs < 1 or n < 1 or plen < 0:
            raise SystemExit(f"--cases: {part!r}: batch and width >= 1, prefix >= 0")
        out.append((bs, n, plen))
    return out


def apply_setting(path: Path, setting: dict) -> str:
    """Rewrite the module-level constants named in ``setting`` in a ddtree_utils.py; returns the
    new text. A constant that is not found is an error (the file is left as it was)."""
    text = path.read_text()
    for name, value in setting.items():
        pattern = re.compile(rf"^{re.escape(name)} = .*$", re.MULTILINE)
        if len(pattern.findall(text)) != 1:
            raise SystemExit(f"--apply: {path}: no single line '{name} = ...'")
        text = pattern.sub(f"{name} = {int(value)}", text)
    path.write_text(text)
    return text


def best_at_batch_one(results: list[dict]) -> dict | None:
    """The setting with the least summed time over the batch-1 cases (tree attention only)."""
    sums: dict[str, float] = {}
    for r in results:
        if r["bs"] == 1 and r["kernel"] == "tree":
            sums[r["setting_key"]] = sums.get(r["setting_key"], 0.0) + r["us"]
    if not sums:
        return None
    key = min(sums, key=sums.get)
    return json.loads(key)


def shipped_setting() -> list[tuple[str, int]]:
    import ddtree_utils as du

    return [(k, getattr(du, k)) for k in SETTINGS]


def _graph_us(call, layers: int, reps: int) -> float:
    """Time per layer of ``call()`` (``layers`` launches) replayed as one CUDA graph."""
    import torch

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / layers


def measure_case(bs: int, n: int, plen: int, grid: list[dict], n_layers: int, reps: int,
                 extend_attention_fwd) -> tuple[list[dict], str]:
    """One (batch, width, prefix) case: the extend kernel (when given) and every setting of the
    grid, each timed per layer and checked against the float32 reference on layer 0."""
    import torch

    import ddtree_reference as dr
    import ddtree_utils as du

    hq, hkv, dim = 32, 8, 128  # Qwen3-8B's attention heads
    scale = dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(bs * 1000 + n + plen)
    slots = bs * plen + 64
    layers = [tuple(torch.randn(slots, hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
                    for _ in range(2)) for _ in range(n_layers)]
    indptr = torch.arange(bs + 1, dtype=torch.int32, device="cuda") * plen
    indices = torch.randperm(slots - 1, device="cuda", generator=gen)[: bs * plen] + 1
    q, kt, vt = (torch.randn(bs * n, h, dim, device="cuda", generator=gen).to(torch.bfloat16)
                 for h in (hq, hkv, hkv))
    tree = torch.rand(bs, n, n, device="cuda", generator=gen) < 0.3
    tree = (tree.tril() | torch.eye(n, dtype=torch.bool, device="cuda")).cpu()
    mask = du.tree_custom_mask(tree, [plen] * bs).cuda()
    mask_indptr = torch.arange(bs + 1, device="cuda") * (n * (plen + n))
    kb0, vb0 = layers[0]
    want = dr.tree_verify_attention_reference(
        q, kb0, vb0, indptr, indices, kt, vt, mask, mask_indptr, n, scale).float()
    rows: list[dict] = []
    line = f"bs {bs:3d} N {n:4d} prefix {plen:5d}:"
    if extend_attention_fwd is not None:
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device="cuda") * n
        ext = torch.empty_like(q)

        def extend(kb, vb):
            extend_attention_fwd(q, kt, vt, ext, kb, vb, qo_indptr, indptr, indices, mask, True,
                                 mask_indptr, n, 1.0, 1.0, scale)

        try:
            us = _graph_us(lambda: [extend(kb, vb) for kb, vb in layers], n_layers, reps)
            extend(kb0, vb0)
            err = (ext.float() - want).abs().max().item()
            rows.append({"bs": bs, "n": n, "prefix": plen, "kernel": "extend", "us": us, "err": err,
                         "setting_key": "extend"})
            line += f" extend {us:6.1f} us ({err:.4f})"
        except Exception as exc:  # noqa: BLE001  the baseline failing must not lose the rest
            line += f" extend {type(exc).__name__}: {exc}"
    shipped = shipped_setting()
    out = torch.empty_like(q)

    def tree(kb, vb):
        du.tree_verify_attention(q, kb, vb, indptr, indices, kt, vt, mask, mask_indptr, n, scale,
                                 out=out, min_split_keys=du._TREE_ATTN_MIN_SPLIT_KEYS)

    try:
        for setting in grid:
            for k, v in setting.items():
                setattr(du, k, v)
            tag = "r{}s{}w{}k{}".format(*(setting[k] for k in SETTINGS))
            try:
                us = _graph_us(lambda: [tree(kb, vb) for kb, vb in layers], n_layers, reps)
                tree(kb0, vb0)
                err = (out.float() - want).abs().max().item()
            except Exception as exc:  # noqa: BLE001  one setting failing must not lose the rest
                line += f" {tag} {type(exc).__name__}"
                continue
            rows.append({"bs": bs, "n": n, "prefix": plen, "kernel": "tree", "us": us, "err": err,
                         "setting_key": json.dumps(setting, sort_keys=True), **setting})
            line += f" {tag} {us:5.1f}"
    finally:
        for k, v in shipped:
            setattr(du, k, v)
    return rows, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x64x128,1x64x600,1x64x3000,4x64x300,16x64x500")
    ap.add_argument("--rows", default="64")
    ap.add_argument("--rows-small", default="32,64", help="rows when the programs are fewer than half the SMs")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--min-split-keys", default="1,128")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--apply", type=Path, default=None)
    a = ap.parse_args()
    cases = parse_cases(a.cases)
    grid = [dict(zip(SETTINGS, v)) for v in itertools.product(
        [int(x) for x in a.rows.split(",")], [int(x) for x in a.rows_small.split(",")],
        [int(x) for x in a.warps.split(",")],
        [int(x) for x in a.min_split_keys.split(",")])]

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tree_attn_bench needs CUDA")
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except ImportError:
        extend_attention_fwd = None
    results = []
    print(f"{torch.cuda.get_device_name()}; shipped setting {dict(shipped_setting())}", flush=True)
    for bs, n, plen in cases:
        rows, line = measure_case(bs, n, plen, grid, a.layers, a.reps, extend_attention_fwd)
        results += rows
        print(line, flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    best = best_at_batch_one(results)
    print(f"fastest at batch 1 (summed over its cases): {best}", flush=True)
    bad = [r for r in results if r["kernel"] == "tree" and r["err"] > 0.05]
    if bad:
        print(f"ERROR: {len(bad)} measurements off the float32 reference by more than 0.05: {bad[:3]}")
        return 1
    if a.apply and best:
        apply_setting(a.apply, best)
        print(f"applied {best} to {a.apply}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
