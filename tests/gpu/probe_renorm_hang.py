#!/usr/bin/env python3
"""Which of sgl_kernel's renorm calls never returns on the installed pin (GPU probe).

0.5.13.post1's DFLASH mixed greedy + sampled batch stalled with the scheduler waiting in the
verify's device-to-host copy (2026-12-06): a kernel of the sampling verify did not finish.
Each case below runs one renorm call in its own process, on rows shaped like that batch
(vocab 32, 16 rows a request, softmax of bf16-rounded logits at T 0.7 or 1), and is killed
after --timeout seconds (the cases run side by side). One JSON line per case: finished or hung, and the seconds taken.

  PYTHONPATH=/tmp/site python3 tests/gpu/probe_renorm_hang.py [--timeout 30] [--vocab 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CASES = {
    # name: (kernel, per-row values as a Python expression of n, columns)
    "top_p_all_p1": ("top_p", "[1.0] * n", None),
    "top_p_all_p09": ("top_p", "[0.9] * n", None),
    "top_p_half_p1_half_p09": ("top_p", "[1.0, 0.9] * (n // 2)", None),
    "top_p_one_column_p1": ("top_p", "[1.0] * n", 1),
    "top_p_one_column_p09": ("top_p", "[0.9] * n", 1),
    "top_k_all_k_vocab": ("top_k", "[V] * n", None),
    "top_k_all_k_topkall": ("top_k", "[1 << 30] * n", None),
    "top_k_half_vocab_half_topkall": ("top_k", "[V, 1 << 30] * (n // 2)", None),
    "top_k_all_k1_tied": ("top_k", "[1] * n", None),
}

CHILD = r"""
import sys, torch
from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob
kernel, values, cols, V = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
n = 8 * 16
g = torch.Generator(device="cuda").manual_seed(0)
logits = torch.randn((n, V), device="cuda", generator=g).to(torch.bfloat16).float()
if kernel == "top_k" and values == "[1] * n":
    logits[:, 3] = logits[:, 7] = logits.max(-1).values + 1.0  # a tie at the maximum
temps = torch.tensor([0.7, 1.0] * (n // 2), device="cuda")[:, None]
probs = torch.softmax(logits / temps, -1)
if cols != "None":
    probs = torch.ones((n, int(cols)), device="cuda")
vals = eval(values)
if kernel == "top_p":
    out = top_p_renorm_prob(probs, torch.tensor(vals, dtype=torch.float32, device="cuda"))
else:
    out = top_k_renorm_prob(probs, torch.tensor(vals, dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
print("rows_sum", float(out.sum(-1).min()), float(out.sum(-1).max()))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--vocab", type=int, default=32)
    args = ap.parse_args()
    def one(name: str) -> dict:
        kernel, values, cols = CASES[name]
        t0 = time.time()
        try:
            p = subprocess.run(
                [sys.executable, "-c", CHILD, kernel, values, str(cols), str(args.vocab)],
                capture_output=True, text=True, timeout=args.timeout, check=False,
            )
            rec = {"rc": p.returncode, "out": p.stdout.strip()[-200:], "err": p.stderr.strip()[-300:]}
            rec["result"] = "finished" if p.returncode == 0 else "error"
        except subprocess.TimeoutExpired:
            rec = {"result": "hung", "timeout_s": args.timeout}
        rec.update(case=name, vocab=args.vocab, seconds=round(time.time() - t0, 1))
        return rec

    with ThreadPoolExecutor(len(CASES)) as pool:  # one process each, all at once
        for rec in pool.map(one, CASES):
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
