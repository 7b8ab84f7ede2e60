#!/usr/bin/env python3
"""Per-round cost of plain decode, DFLASH and DDTREE at a real model's shape, side by side.

  python3 bench/round_cost.py --out OUT [--pin 0.5.16] [--backend triton] [--bs 1,4,16,32]

Qwen3-8B-shaped target (36 layers, hidden 4096, vocab 151936) and a 5-layer DFlash draft
(block 16), dummy weights, so no draft token is ever accepted and every figure is the cost
of one round. All servers start in parallel (KV capped with --max-total-tokens), then each is
measured alone, batch size by batch size (every server at one batch size before the next):
`bs` prompts of 512 tokens, 8 then 136 new tokens, per-round
ms = (t136 - t8) / (rounds136 - rounds8). Writes OUT/round_cost.json and OUT/round_cost.md
(the table, ratios against DFLASH and the issue-12 goals: DDTREE b15 <= 1.05x DFLASH at every
batch, b63 <= 1.2x at batch 1). DDTREE servers run with SGLANG_DDTREE_PHASE_TIMES=1 (0.5.16
pin): the table adds their GPU time per phase of the round (draft+tree, mask, verify, accept,
KV move, commit) from CUDA events; round ms minus their sum is host time not hidden by the GPU.
Needs CUDA and the patched sglang on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pin_flags as PF  # noqa: E402

TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
DRAFT = dict(
    TARGET,
    architectures=["DFlashDraftModel"],
    num_hidden_layers=5,
    block_size=16,
    num_target_layers=36,
    dflash_config={"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669, "block_size": 16},
)
# bench/pin_flags.py's flags with this script's caps
COMMON_BY_PIN = {pin: PF.common(pin, mem_fraction=0.9, max_total_tokens=40000, max_bs=32, max_running=32)
                 for pin in PF.PINS}
SPEC = "--speculative-algorithm {algo} --speculative-draft-model-path {draft}"
CONFIGS = {
    "plain": "",
    "dflash": SPEC.format(algo="DFLASH", draft="{draft}"),
    "ddtree_b15": SPEC.format(algo="DDTREE", draft="{draft}") + " --speculative-ddtree-budget 15",
    "ddtree_b63": SPEC.format(algo="DDTREE", draft="{draft}") + " --speculative-ddtree-budget 63",
}
# --extend-attention: the same DDTREE servers again with SGLANG_DDTREE_TREE_ATTENTION=0 (SGLang's
# extend kernel verifies the tree instead of the split-KV tree attention that 0.5.16 patch 0008
# uses by default on triton), measured in the same run.
EXTEND_ATTENTION = {f"{name}_ext": CONFIGS[name] for name in ("ddtree_b15", "ddtree_b63")}
SERVER_ENV = {name: {"SGLANG_DDTREE_TREE_ATTENTION": "0"} for name in EXTEND_ATTENTION}


def post(port: int, body: dict, timeout: float = 300) -> list:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def timed(port: int, ids: list, new: int) -> tuple[float, int]:
    t = time.time()
    out = post(port, {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}})
    return time.time() - t, int(out[0]["meta_info"].get("spec_verify_ct") or new)


def table(res: list, bss: list) -> str:
    ms = {(r["config"], r.get("bs")): r.get("round_ms") for r in res}
    names = list(dict.fromkeys(r["config"] for r in res if "bs" in r))
    failed = [f"{r['config']} ({r['error']})" for r in res if "bs" not in r]
    ddtree = [c for c in names if c.startswith("ddtree")]
    rows = ["| batch | " + " | ".join(names) + " | " + " | ".join(f"{c} / DFLASH" for c in ddtree) + " |",
            "|---" * (len(names) + len(ddtree) + 1) + "|"]
    goals = []
    for bs in bss:
        cells = [f"{ms.get((c, bs)):.2f}" if ms.get((c, bs)) else "-" for c in names]
        d = ms.get(("dflash", bs))
        ratios = []
        for c in ddtree:
            v = ms.get((c, bs))
            ratios.append(f"{v / d:.3f}" if v and d else "-")
        rows.append(f"| {bs} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        for c in ddtree:
            if d and c.startswith("ddtree_b15") and ms.get((c, bs)):
                goals.append((f"{c} <= 1.05x DFLASH at bs {bs}", ms[(c, bs)] / d <= 1.05))
            if bs == 1 and d and c.startswith("ddtree_b63") and ms.get((c, bs)):
                goals.append((f"{c} <= 1.2x DFLASH at bs 1", ms[(c, bs)] / d <= 1.2))
    rows.append("")
    rows += [f"- not measured: {f}" for f in failed]
    rows += [f"- {g}: {'met' if ok else 'MISSED'}" for g, ok in goals]
    return "\n".join(rows)


_PHASE_RE = re.compile(
    r"DDTREE phase ms bs=(\d+) \(mean of (\d+) rounds\): GPU (\{.*?\}) host (\{.*\})"
)
_PHASES = ("draft+tree", "mask", "verify", "accept", "kv_move", "commit")


def phase_table(out: str, names: list) -> str:
    """Last logged per-phase means of each DDTREE server, per batch size: GPU time between the
    phase's CUDA events, and host time (Python issuing the phase) in brackets. A GPU phase
    much longer than its work with a host phase as long is the GPU waiting for the host."""
    rows = ["| config | batch | rounds | " + " | ".join(_PHASES + ("sum",)) + " |",
            "|---" * 10 + "|"]
    for name in names:
        path = os.path.join(out, f"rc-{name}.log")
        if not name.startswith("ddtree") or not os.path.exists(path):
            continue
        last: dict = {}
        with open(path, errors="replace") as f:
            for line in f:
                m = _PHASE_RE.search(line)
                if m:
                    last[int(m.group(1))] = (
                        int(m.group(2)), json.loads(m.group(3)), json.loads(m.group(4))
                    )
        for bs in sorted(last):
            rounds, gpu, host = last[bs]
            cells = [f"{gpu.get(p, 0):.3f} ({host.get(p, 0):.3f})" for p in _PHASES]
            rows.append(f"| {name} | {bs} | {rounds} | " + " | ".join(cells)
                        + f" | {sum(gpu.values()):.3f} ({sum(host.values()):.3f}) |")
    return "\n".join(rows)


def profile_round(port: int, ids: list, out_dir: str, steps: int = 20) -> dict:
    """GPU kernels of `steps` decode rounds at len(ids) concurrent requests, from SGLang's own
    torch profiler (POST /start_profile, GPU activity only, CUDA-graph kernels included):
    per round, the GPU busy time, the span from the first kernel start to the last kernel end,
    and the kernels by total time."""
    import glob
    import gzip
    import threading

    os.makedirs(out_dir, exist_ok=True)
    worker = threading.Thread(target=timed, args=(port, ids, 136))
    worker.start()
    time.sleep(0.5)  # prefill done, decoding
    body = {"output_dir": out_dir, "num_steps": steps, "activities": ["GPU"], "with_stack": False}
    req = urllib.request.Request(  # answers plain text, not JSON as /generate (post)
        f"http://127.0.0.1:{port}/start_profile", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(req, timeout=60).read()
    worker.join()
    traces: list = []
    for _ in range(60):
        traces = glob.glob(os.path.join(out_dir, "*.trace.json.gz"))
        if traces:
            break
        time.sleep(1)
    if not traces:
        return {"error": "no trace written"}
    time.sleep(1)  # the file is written in one go; let it finish
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "no kernel events"}
    by_name: dict = {}
    for e in kernels:
        d = by_name.setdefault(e["name"][:90], [0.0, 0])
        d[0] += float(e["dur"])
        d[1] += 1
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "steps": steps,
        "busy_ms_per_round": round(sum(e["dur"] for e in kernels) / 1e3 / steps, 3),
        "span_ms_per_round": round(span / 1e3 / steps, 3),
        "kernels_per_round": round(len(kernels) / steps, 1),
        "top": [{"name": n, "ms_per_round": round(t / 1e3 / steps, 4), "calls_per_round": round(c / steps, 2)}
                for n, (t, c) in top],
    }


def profile_table(profiles: dict) -> str:
    rows = []
    for name, p in profiles.items():
        if "error" in p:
            rows.append(f"### {name}: {p['error']}")
            continue
        rows.append(f"### {name} (bs {p['bs']}, {p['steps']} rounds): GPU busy {p['busy_ms_per_round']} ms/round, "
                    f"kernel span {p['span_ms_per_round']} ms/round, {p['kernels_per_round']} kernels/round")
        rows.append("")
        rows.append("| kernel | ms/round | calls/round |")
        rows.append("|---|---|---|")
        rows += [f"| `{k['name']}` | {k['ms_per_round']} | {k['calls_per_round']} |" for k in p["top"]]
        rows.append("")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pin", default="0.5.16", choices=sorted(COMMON_BY_PIN))
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--bs", default="1,4,16,32")
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--budgets", default="",
                    help="more DDTREE budgets as configs ddtree_b<B> (e.g. 7,31,127,255: the widths "
                         "--speculative-ddtree-budget auto chooses among, for its cost table)")
    ap.add_argument("--port", type=int, default=30100)
    ap.add_argument("--deadline", type=float, default=540, help="seconds for the whole run")
    ap.add_argument("--extend-attention", action="store_true",
                    help="also DDTREE b15/b63 with SGLANG_DDTREE_TREE_ATTENTION=0 (0.5.16: SGLang's "
                         "extend kernel instead of patch 0008's tree attention)")
    ap.add_argument("--profile-bs", type=int, default=0,
                    help="also profile each server's GPU kernels over 20 rounds at this batch size")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t00 = time.time()
    for name, cfg in (("rc-target", TARGET), ("rc-draft", DRAFT)):
        os.makedirs(f"/tmp/{name}", exist_ok=True)
        with open(f"/tmp/{name}/config.json", "w") as f:
            json.dump(cfg, f)
    configs = {**CONFIGS, **(EXTEND_ATTENTION if a.extend_attention else {})}
    for b in (int(x) for x in a.budgets.split(",") if x.strip()):
        configs.setdefault(f"ddtree_b{b}", SPEC.format(algo="DDTREE", draft="{draft}") + f" --speculative-ddtree-budget {b}")
    names = [n for n in configs if not a.only or n in a.only.split(",")]
    procs = {}
    for i, name in enumerate(names):
        port = a.port + 10 * i
        cmd = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", "/tmp/rc-target",
            "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--attention-backend", a.backend, *shlex.split(COMMON_BY_PIN[a.pin]),
            *shlex.split(configs[name].format(draft="/tmp/rc-draft")),
        ]
        log = open(os.path.join(a.out, f"rc-{name}.log"), "w")  # noqa: SIM115 - lives with the server
        env = (
            dict(os.environ, SGLANG_DDTREE_PHASE_TIMES="1", **SERVER_ENV.get(name, {}))
            if name.startswith("ddtree")
            else None
        )
        procs[name] = (
            port,
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env),
        )
        time.sleep(8)
    ready: dict = {}
    while len(ready) < len(procs) and time.time() - t00 < a.deadline * 0.6:
        for name, (port, p) in procs.items():
            if name in ready:
                continue
            if p.poll() is not None:
                ready[name] = False
                continue
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                ready[name] = True
            except OSError:
                pass
        time.sleep(2)
    print(json.dumps({"ready": ready, "t": round(time.time() - t00)}), flush=True)
    bss = [int(x) for x in a.bs.split(",")]
    res = [{"config": n, "error": "server not ready"} for n in procs if not ready.get(n)]
    live = {n: port for n, (port, _) in procs.items() if ready.get(n)}
    profiles: dict = {}
    # Batch-major: every server is measured at one batch size before the next, so DFLASH and
    # DDTREE at a batch size run minutes apart at most (the GPU's clock drifts a few % over a run).
    rng = random.Random(0)
    for bs in bss:
        ids = [[rng.randrange(100, 150000) for _ in range(512)] for _ in range(bs)]
        for name, port in live.items():
            if time.time() - t00 > a.deadline:
                break
            try:
                timed(port, ids, 8)
                ts, cs = timed(port, ids, 8)
                tl, cl = timed(port, ids, 136)
                r = {"config": name, "bs": bs, "round_ms": round(1000 * (tl - ts) / max(1, cl - cs), 3), "rounds": cl - cs}
            except Exception as e:  # noqa: BLE001 - recorded
                r = {"config": name, "bs": bs, "error": repr(e)[:200]}
            res.append(r)
            print(json.dumps(r), flush=True)
    for name, port in live.items():
        if a.profile_bs and time.time() - t00 < a.deadline:
            ids = [[rng.randrange(100, 150000) for _ in range(512)] for _ in range(a.profile_bs)]
            try:
                prof = profile_round(port, ids, os.path.join("/tmp/rc-prof", name))
            except Exception as e:  # noqa: BLE001 - recorded
                prof = {"error": repr(e)[:200]}
            profiles[name] = dict(prof, bs=a.profile_bs)
            print(json.dumps({"profile": name, **{k: v for k, v in prof.items() if k != "top"}}), flush=True)
    for _, p in procs.values():
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    with open(os.path.join(a.out, "round_cost.json"), "w") as f:
        json.dump(res, f, indent=1)
    report = table(res, bss) + "\n\n" + phase_table(a.out, names)
    if profiles:
        with open(os.path.join(a.out, "profiles.json"), "w") as f:
            json.dump(profiles, f, indent=1)
        report += "\n\n" + profile_table(profiles)
    with open(os.path.join(a.out, "round_cost.md"), "w") as f:
        f.write(report + "\n")
    print(report, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
