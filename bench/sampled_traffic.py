#!/usr/bin/env python3
"""Sampled traffic against DDTREE at a real model's shape: is it served, what does a round cost, how much memory.

  python3 bench/sampled_traffic.py --out OUT [--pin 0.5.13.post1] [--budgets 15,63,255] [--bs 32,48]

Issue 13, item 1. The Qwen3-8B-shaped dummy-weight pair of bench/round_cost.py (vocabulary 151936).
One DDTREE server per budget (started in parallel, KV capped with --max-total-tokens), each then
measured alone: for every batch size and every sampling setting (greedy, T 0.7 without top_k / top_p,
T 0.7 with top_k 20, T 0.7 with top_p 0.9, T 0.7 with both) `bs` concurrent requests of 512 random
prompt tokens, 8 then N (--new, 72) new tokens (ignore_eos), per-round ms = (tN - t8) / (roundsN - rounds8)
from the requests' spec_verify_ct. "served" means every request answered with all its tokens and the
server still alive afterwards. Peak memory: the server's processes' GPU memory as nvidia-smi reports
it, polled every 0.2 s during the setting (torch's caching allocator holds what the round allocated,
so the peak is what the sampled verify needed on top of the static pools), and the same for the
greedy setting. Writes OUT/sampled_traffic.json and OUT/sampled_traffic.md (the table, with
sampled / greedy round ratios against the 1.3x goal). Needs CUDA and the patched sglang on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from round_cost import COMMON_BY_PIN, DRAFT, TARGET, post

SETTINGS = {  # name: sampling params on top of max_new_tokens / ignore_eos
    "greedy": {"temperature": 0},
    "T0.7": {"temperature": 0.7},
    "T0.7 top_k 20": {"temperature": 0.7, "top_k": 20},
    "T0.7 top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "T0.7 top_k 20 top_p 0.9": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
}


def group_gpu_mib(pgid: int) -> int:
    """GPU memory (MiB) of every process in the server's process group, from nvidia-smi."""
    try:
        pids = {int(x) for x in subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, check=False,
                                               text=True, timeout=5).stdout.split()}
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           check=False, capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return -1
    total = 0
    for line in q.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids and parts[1].isdigit():
            total += int(parts[1])
    return total


class PeakPoller:
    def __init__(self, pgid: int):
        self.pgid, self.peak, self._stop = pgid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, group_gpu_mib(self.pgid))
            self._stop.wait(0.2)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def concurrent_run(port: int, prompts: list, params: dict, new: int) -> tuple[float, int, int]:
    """`len(prompts)` concurrent single requests. Returns (wall s, max spec_verify_ct, tokens)."""
    body = lambda ids: {"input_ids": ids, "sampling_params": dict(params, max_new_tokens=new, ignore_eos=True)}
    t = time.time()
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda ids: post(port, body(ids), timeout=240), prompts))
    wall = time.time() - t
    rounds = max(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
    tokens = sum(len(o.get("output_ids") or []) for o in outs)
    return wall, rounds, tokens


def alive(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        return True
    except OSError:
        return False


def table(res: list) -> str:
    rows = ["| budget | batch | setting | served | round ms | / greedy | peak GPU MiB | over greedy MiB |",
            "|---|---|---|---|---|---|---|---|"]
    greedy = {(r["budget"], r["bs"]): r for r in res if r["setting"] == "greedy" and r.get("round_ms")}
    worst = None
    for r in res:
        g = greedy.get((r["budget"], r["bs"]))
        ratio = r["round_ms"] / g["round_ms"] if g and r.get("round_ms") else None
        if ratio is not None and r["setting"] != "greedy":
            worst = max(worst or 0.0, ratio)
        over = r["peak_mib"] - g["peak_mib"] if g and r.get("peak_mib", -1) >= 0 and g.get("peak_mib", -1) >= 0 else None
        rows.append(f"| {r['budget']} | {r['bs']} | {r['setting']} | {'yes' if r.get('served') else 'NO: ' + r.get('error', '?')} | "
                    f"{r.get('round_ms', '-')} | {f'{ratio:.3f}' if ratio else '-'} | {r.get('peak_mib', '-')} | "
                    f"{over if over is not None else '-'} |")
    served = all(r.get("served") for r in res)
    rows += ["", f"- every setting served: {'yes' if served else 'NO'}",
             f"- worst sampled / greedy round ratio: {worst:.3f} (goal <= 1.3: {'met' if worst <= 1.3 else 'MISSED'})"
             if worst is not None else "- no ratio measured"]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pin", default="0.5.13.post1", choices=sorted(COMMON_BY_PIN))
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--budgets", default="15,63,255")
    ap.add_argument("--bs", default="32,48")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names of SETTINGS")
    ap.add_argument("--mem-fraction-static", default="0.85")
    ap.add_argument("--new", type=int, default=72, help="new tokens of the long run")
    ap.add_argument("--port", type=int, default=30300)
    ap.add_argument("--deadline", type=float, default=560, help="seconds for the whole run")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t00 = time.time()
    for name, cfg in (("rc-target", TARGET), ("rc-draft", DRAFT)):
        os.makedirs(f"/tmp/{name}", exist_ok=True)
        with open(f"/tmp/{name}/config.json", "w") as f:
            json.dump(cfg, f)
    bss = [int(x) for x in a.bs.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]
    settings = [s for s in a.settings.split(",") if s]
    common = shlex.split(COMMON_BY_PIN[a.pin])
    # room for max(bs) requests of 512 + 136 tokens plus a round's reservation, in a shared GPU
    for flag, value in (("--max-running-requests", str(max(bss))), ("--max-total-tokens", str(max(bss) * (512 + a.new + 2 * max(budgets) + 64))),
                        ("--mem-fraction-static", a.mem_fraction_static)):
        common[common.index(flag) + 1] = value
    procs = {}
    for i, b in enumerate(budgets):
        port = a.port + 10 * i
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "/tmp/rc-target", "--load-format", "dummy",
               "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--attention-backend", a.backend,
               *common, "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", "/tmp/rc-draft",
               "--speculative-ddtree-budget", str(b)]
        log = open(os.path.join(a.out, f"st-b{b}.log"), "w")  # noqa: SIM115 - lives with the server
        procs[b] = (port, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(8)
    ready: dict = {}
    while len(ready) < len(procs) and time.time() - t00 < a.deadline * 0.5:
        for b, (port, p) in procs.items():
            if b not in ready and (p.poll() is not None or alive(port)):
                ready[b] = p.poll() is None
        time.sleep(2)
    print(json.dumps({"ready": ready, "t": round(time.time() - t00)}), flush=True)
    res = []
    for b, (port, p) in procs.items():
        rng = random.Random(b)
        for bs in bss:
            prompts = [[rng.randrange(100, 150000) for _ in range(512)] for _ in range(bs)]
            for s in settings:
                r = {"budget": b, "bs": bs, "setting": s}
                if not ready.get(b) or p.poll() is not None:
                    r.update(served=False, error="server not running")
                elif time.time() - t00 > a.deadline:
                    r.update(served=False, error="out of time (not run)")
                else:
                    try:
                        with PeakPoller(p.pid) as poll:
                            concurrent_run(port, prompts, SETTINGS[s], 8)
                            ws, cs, _ = concurrent_run(port, prompts, SETTINGS[s], 8)
                            wl, cl, tok = concurrent_run(port, prompts, SETTINGS[s], a.new)
                        ok = tok == a.new * bs and alive(port)
                        r.update(served=ok, round_ms=round(1000 * (wl - ws) / max(1, cl - cs), 3), rounds=cl - cs,
                                 tokens=tok, peak_mib=poll.peak, **({} if ok else {"error": "short output or server died"}))
                    except Exception as e:  # noqa: BLE001 - recorded in the table
                        r.update(served=False, error=repr(e)[:160], server_alive=alive(port))
                res.append(r)
                print(json.dumps(r), flush=True)
    for _, p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    with open(os.path.join(a.out, "sampled_traffic.json"), "w") as f:
        json.dump(res, f, indent=1)
    report = table(res)
    with open(os.path.join(a.out, "sampled_traffic.md"), "w") as f:
        f.write(report + "\n")
    print(report, flush=True)
    return 0 if all(r.get("served") for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
