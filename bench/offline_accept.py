"""Offline acceptance of a trained small pair, per DDTREE budget and drafter temperature (CPU or GPU).

Walks the target's greedy continuation of held-out prompts with the drafter's blocks, as the
training run's eval.json does (bench/train_tiny_pair.py ``draft_topk`` / ``acceptance_from_topk``),
for any budgets, and with the drafter's distribution taken at softmax temperatures ``--taus``
before the tree is built (tau < 1 sharpens it, so deeper paths outrank siblings; the verify stays
exact for any tree, so this only moves acceptance). Prints one row per temperature: DFLASH's
chain and each budget's measured (and predicted) tokens per round.

    python3 bench/offline_accept.py --pair .gpu/px/pair-lift-c --prompts 16 --budgets 15,31,63,127,255 --taus 1,0.8,0.5

Memory: one chunk of draft logits is prompts x anchor-chunk x (block - 1) x vocab float32 values
(16 x 4 x 15 x 151936 x 4 B = 146 MB for the lifted pairs' vocabulary).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import train_tiny_pair as ttp  # noqa: E402


def parse_list(text: str, kind, name: str) -> list:
    try:
        vals = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected a comma-separated list, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SystemExit(f"{name}: give positive values, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a trained pair (bench/train_tiny_pair.py's output)")
    ap.add_argument("--prompts", type=int, default=16, help="the first N of the pair's held-out prompts.jsonl")
    ap.add_argument("--gen-len", type=int, default=192, help="greedy tokens generated after each prompt")
    ap.add_argument("--budgets", default="15,63,255")
    ap.add_argument("--taus", default="1.0", help="drafter softmax temperatures for the tree's scores")
    ap.add_argument("--anchor-chunk", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    budgets = parse_list(a.budgets, int, "--budgets")
    taus = parse_list(a.taus, float, "--taus")
    if a.prompts < 1 or a.gen_len < 1 or a.anchor_chunk < 1:
        raise SystemExit("--prompts, --gen-len and --anchor-chunk must be >= 1")
    try:
        target, drafter = ttp.load_pair(a.pair)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--pair {a.pair}: not a trained pair (target/ and draft/ config.json and weights): {exc}") from None
    lines = (a.pair / "prompts.jsonl").read_text().splitlines()[: a.prompts]
    prompts = [json.loads(x)["input_ids"] for x in lines if x.strip()]
    if not prompts:
        raise SystemExit(f"--pair {a.pair}: prompts.jsonl holds no prompts")
    p_len = min(len(p) for p in prompts)  # the eval's shape: every prompt cut to the shortest
    ctx = ttp.Ctx(a.device, 0)
    target.to(ctx.device)
    drafter.to(ctx.device)
    t0 = time.time()
    z0 = torch.tensor([p[:p_len] for p in prompts], device=ctx.device)
    with torch.no_grad():
        cont = ttp.generate_batched(target, ctx, z0, a.gen_len, 0.0, len(prompts))
    z = torch.cat([z0, cont], 1)
    tk, truth = ttp.draft_topk(ctx, target, drafter, z, p_len, a.anchor_chunk, tuple(taus))
    out = {"pair": str(a.pair), "prompts": len(prompts), "prompt_len": p_len, "gen_len": a.gen_len, "by_tau": {}}
    print(f"{len(prompts)} prompts of {p_len} tokens + {a.gen_len} greedy, {time.time() - t0:.0f} s; "
          "tokens per round measured (predicted):", file=sys.stderr)
    print("| tau | DFLASH | " + " | ".join(f"b{b}" for b in budgets) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for tau in taus:
        lp, tid = tk[tau]
        res = ttp.acceptance_from_topk(lp.cpu(), tid.cpu(), truth.cpu(), budgets)
        out["by_tau"][str(tau)] = res
        cells = [f"{res['dflash']['measured_accept']:.3f} ({res['dflash']['predicted_accept']:.2f})"]
        cells += [f"{res[f'ddtree_b{b}']['measured_accept']:.3f} ({res[f'ddtree_b{b}']['predicted_accept']:.2f})"
                  for b in budgets]
        print(f"| {tau:g} | " + " | ".join(cells) + " |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
