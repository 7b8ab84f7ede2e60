#!/usr/bin/env python3
"""Which kernel of 0.5.13.post1's DFLASH sampling verify does not return (GPU probe).

The matrix's DFLASH server stalls on a mixed greedy + sampled batch with its scheduler in the
verify's device-to-host copy, so a kernel launched by compute_dflash_sampling_correct_drafts_and_bonus
never finished; the renorm kernels alone finish on such rows (probe_renorm_hang.py). This runs
that function (the installed, patched sglang) on random mixed batches shaped like the matrix's
(block 16, vocabulary 32, bs 1-16, greedy rows top_k 1, sampled rows T 0.7 / top-p 0.9), with
every kernel call wrapped to synchronise and print its name, in a child process killed after
--timeout seconds. The child's last lines name the call that hung and its inputs.

  PYTHONPATH=/tmp/site python3 tests/gpu/probe_dflash_verify_013.py [--trials 300] [--timeout 60]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import sys, torch
from types import SimpleNamespace
from sglang.srt.speculative import dflash_utils as du
TOP_K_ALL = 1 << 30
trials, vocab, block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
state = {}

def wrap(name):
    fn = getattr(du, name)
    def call(*a, **k):
        print(f"call {name} trial {state['trial']} bs, greedy rows {state['inputs']}", flush=True)
        out = fn(*a, **k)
        torch.cuda.synchronize()
        return out
    setattr(du, name, call)

for name in ("top_k_renorm_prob", "top_p_renorm_prob", "tree_speculative_sampling_target_only"):
    wrap(name)
g = torch.Generator(device="cuda").manual_seed(0)
cg = torch.Generator().manual_seed(0)
for trial in range(trials):
    state["trial"] = trial
    bs = int(torch.randint(1, 17, (1,), generator=cg))
    greedy = torch.rand(bs, generator=cg) < 0.5
    logits = torch.randn((bs * block, vocab), device="cuda", generator=g).to(torch.bfloat16).float() * 4
    argmax = logits.argmax(-1).view(bs, block)
    cand = torch.randint(0, vocab, (bs, block), device="cuda", generator=g)
    take = torch.rand((bs, block), device="cuda", generator=g) < 0.6
    cand[:, 1:] = torch.where(take[:, 1:], argmax[:, :-1], cand[:, 1:])
    info = SimpleNamespace(
        temperatures=torch.where(greedy, 1.0, 0.7).float().cuda().view(-1, 1),
        top_ks=torch.where(greedy, 1, TOP_K_ALL).to(torch.int32).cuda(),
        top_ps=torch.where(greedy, 1.0, 0.9).float().cuda(),
        is_all_greedy=bool(greedy.all()),
        need_top_k_sampling=bool(greedy.any()),
        need_top_p_sampling=bool((~greedy).any()),
    )
    state["inputs"] = (bs, greedy.tolist())
    acc, bonus = du.compute_dflash_sampling_correct_drafts_and_bonus(
        candidates=cand, next_token_logits=logits, sampling_info=info,
        threshold_single=1.0, threshold_acc=1.0,
    )
    torch.cuda.synchronize()
    if trial % 50 == 0:
        print(f"trial {trial} ok bs {bs} acc {acc.tolist()[:4]}", flush=True)
print("all trials finished", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--vocab", type=int, default=32)
    ap.add_argument("--block", type=int, default=16)
    args = ap.parse_args()
    cmd = [sys.executable, "-c", CHILD, str(args.trials), str(args.vocab), str(args.block)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
        print(f"rc {p.returncode}")
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        print(f"HUNG after {args.timeout} s")
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    print("\n".join(out.splitlines()[-6:]))
    print("\n".join(err.splitlines()[-8:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
