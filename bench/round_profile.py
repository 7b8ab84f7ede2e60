#!/usr/bin/env python3
"""Profile the serving round of several configurations at concurrency 1 and say where each
round's time goes (bench/trace_gaps.py): GPU busy time, GPU idle time and the host frames in it.

The question it answers (BENCHMARKS.md, thirteenth session): at batch 1 a DDTREE b63 round costs
about 1.15x upstream DFLASH's while its GPU phases add up to less than the difference, so is the
rest the host (launches, Python between phases, the scheduler) or the GPU?

Per configuration (one server each, started in parallel as bench/acceptance_run.py starts them,
then profiled one at a time so that no two share the GPU): two warm-up requests, then
``/start_profile`` with ``num_steps`` forward steps, CPU + GPU activities and Python stacks,
while requests of ``--max-new-tokens`` tokens run back to back at concurrency 1; SGLang stops the
profiler after the steps and writes the trace; the trace is analysed here and the report goes to
``OUT/<config>/gaps.json`` (and ``gaps.txt``), the trace itself kept when it is under
``--keep-trace-mb``. A step is one scheduler forward: at 128 new tokens about one in 20-30 is a
prefill.

    PYTHONPATH=/tmp/site python3 bench/round_profile.py --out $OUT/prof --pin 0.5.16 --pair /tmp/lifted \\
        --budgets 63 --steps 60 --common "..."
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ar = _load("acceptance_run")
tg = _load("trace_gaps")
B = ar.B


def start_profile(url: str, body: dict, timeout: float = 120.0) -> str:
    """POST /start_profile; SGLang answers in plain text ("Start profiling."), not JSON."""
    req = urllib.request.Request(url.rstrip("/") + "/start_profile", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def newest_trace(folder: Path) -> Path | None:
    found = sorted(folder.rglob("*.trace.json*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def profile_one(s, prompts: list[dict], out: Path, steps: int, max_new: int, temperature: float,
                timeout_s: float) -> dict:
    """Profile ``steps`` forward steps of server ``s`` under back-to-back requests at c = 1."""
    folder = out / s.name.replace(" ", "-")
    folder.mkdir(parents=True, exist_ok=True)
    samp = B.Sampling(max_new_tokens=max_new, temperature=temperature)
    for i in range(2):
        B.generate_one(s.url, prompts[i % len(prompts)], samp, 120.0)
    stop = threading.Event()
    sent = [0]

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            B.generate_one(s.url, prompts[i % len(prompts)], samp, 120.0)
            i += 1
            sent[0] = i

    th = threading.Thread(target=traffic, daemon=True)
    th.start()
    time.sleep(0.5)  # the first request is in decode
    body = {"output_dir": str(folder), "num_steps": steps, "activities": ["CPU", "GPU"], "with_stack": True,
            "record_shapes": False}
    start_profile(s.url, body)
    t0, trace, last = time.time(), None, -1
    while time.time() - t0 < timeout_s:  # written once the steps are done; wait until its size settles
        trace = newest_trace(folder)
        if trace is not None:
            size = trace.stat().st_size
            if size == last and size > 0:
                break
            last = size
        time.sleep(2.0)
    stop.set()
    th.join(150)
    if trace is None:
        return {"error": f"no trace in {folder} after {timeout_s:.0f} s"}
    rep = tg.analyse(tg.load(trace), steps=steps, top=300)  # compare() needs the tables' tails
    rep["trace"] = str(trace)
    rep["requests_during_profile"] = sent[0]
    (folder / "gaps.json").write_text(json.dumps(rep, indent=1))
    (folder / "gaps.txt").write_text(tg.render(rep) + "\n")
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pair", required=True, type=Path, help="target/, draft/, prompts.jsonl (e.g. the lifted pair)")
    ap.add_argument("--pin", default="0.5.16", choices=sorted(ar.COMMON_BY_PIN))
    ap.add_argument("--budgets", default="63", help="DDTREE budgets / auto words beside plain and DFLASH")
    ap.add_argument("--without", default="", help="configurations to leave out (not plain)")
    ap.add_argument("--common", default=None)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--port-base", type=int, default=31000)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--trace-timeout", type=float, default=120.0)
    ap.add_argument("--keep-trace-mb", type=float, default=8.0)
    ap.add_argument("--budget-s", type=float, default=520.0, help="whole-run deadline: servers left are skipped")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/round-profile-logs"))
    a = ap.parse_args()
    if a.steps < 1:
        raise SystemExit(f"--steps: {a.steps}: give 1 or more")
    cfgs = ar.configs(ar.parse_budgets(a.budgets))
    without = ar.parse_without(a.without, cfgs)
    common = a.common or ar.COMMON_BY_PIN[a.pin]
    a.out.mkdir(parents=True, exist_ok=True)
    a.log_dir.mkdir(parents=True, exist_ok=True)
    prompts = B.load_prompts(a.pair / "prompts.jsonl")
    servers = [ar.Server(n, e, a.port_base + i, a.pair, a.log_dir, a.backend, common, env=ar.server_env(n))
               for i, (n, e) in enumerate(cfgs) if n not in without]
    for s in servers:
        s.start()
    results: dict[str, dict] = {}
    t_start = time.time()
    try:
        ar.wait_ready(servers, t_start + a.startup_timeout)
        for s in servers:
            if s.startup_s is None:
                results[s.name] = {"error": s.error or "not ready before the deadline"}
                continue
            if time.time() - t_start > a.budget_s:
                results[s.name] = {"error": f"skipped: past --budget-s {a.budget_s:.0f}"}
                ar.log(f"{s.name}: {results[s.name]['error']}")
                continue
            try:
                rep = profile_one(s, prompts, a.out, a.steps, a.max_new_tokens, a.temperature, a.trace_timeout)
            except Exception as exc:  # noqa: BLE001  one server's failure must not lose the others' reports
                rep = {"error": f"{type(exc).__name__}: {exc}"}
            results[s.name] = rep
            if "per_step_ms" in rep:
                per = rep["per_step_ms"]
                ar.log(f"{s.name}: per step window {per['window']} ms, GPU busy {per['gpu_busy']}, idle {per['gpu_idle']}")
                print(f"==== {s.name}\n" + tg.render(rep), flush=True)
            else:
                ar.log(f"{s.name}: {rep.get('error')}")
            trace = Path(rep["trace"]) if "trace" in rep else None
            if trace is not None and trace.stat().st_size > a.keep_trace_mb * 1e6:
                trace.unlink()
    finally:
        for s in servers:
            s.stop()
        for s in servers:
            if s.logpath.exists():
                (a.out / s.logpath.name).write_text(s.logpath.read_text(errors="replace")[-200_000:])
    (a.out / "round_profile.json").write_text(json.dumps(results, indent=1))
    base = results.get("DFLASH", {})
    for name, rep in results.items():  # each DDTREE configuration minus DFLASH, per step
        if ar.label_parts(name)[0] == "DDTREE" and "per_step_ms" in rep and "per_step_ms" in base:
            text = tg.render_compare(tg.compare(rep, base), name, "DFLASH")
            (a.out / f"compare-{name.replace(' ', '-')}-vs-DFLASH.txt").write_text(text + "\n")
            print(f"==== {name} vs DFLASH\n{text}", flush=True)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
