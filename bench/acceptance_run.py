#!/usr/bin/env python3
"""Acceptance and throughput of the tiny trained pair under real SGLang, in one GPU call.

    python3 bench/acceptance_run.py --out OUT [--pair DIR] [--budgets 15,63,255]

(bench/acceptance_run.sh installs the offline SGLang archive and the overlay first.)

1. Trains the pair with bench/train_tiny_pair.py into /tmp/tiny-pair (or reuses ``--pair DIR``
   holding target/, draft/, prompts.jsonl, eval.json); the plain server starts as soon as the
   target is saved, while the drafter trains.
2. Starts, in parallel on their own ports: the plain target, DFLASH, and DDTREE at each budget
   (``--skip-tokenizer-init``, token ids in and out, HF_HUB_OFFLINE=1).
3. Greedy check: the same 8 held-out prompts x 64 tokens must give the plain target's tokens on
   every speculative server (lossless).
4. Measures each server alone (the others idle), greedy and T = 1, at every concurrency, with
   deploy/bench.py (the code behind ``ddtree-deploy bench``) on the held-out prompts.
5. Writes OUT/results.json (the ``ddtree-deploy bench --json`` schema, one server entry per
   configuration and temperature, plus ``offline`` = the training script's eval.json, ``train``
   and ``exactness``), OUT/table.md (mean acceptance, tokens/s, speedup over plain, predicted vs
   measured acceptance per budget), OUT/plot.png when matplotlib is importable (else render it
   anywhere with ``ddtree-deploy bench --from-json results.json --plot plot.png``),
   OUT/pair.tgz (the trained pair, for reuse with --pair) and OUT/logs.tgz.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
try:
    from ddtree_deploy.deploy.remote import bench as B  # noqa: E402
except ImportError:  # the GPU machine has the checkout, not the installed toolkit: map deploy/ itself
    import importlib.util
    import types

    sys.modules.setdefault("ddtree_deploy", types.ModuleType("ddtree_deploy")).__path__ = []
    _spec = importlib.util.spec_from_file_location(
        "ddtree_deploy.deploy", ROOT / "deploy" / "__init__.py", submodule_search_locations=[str(ROOT / "deploy")]
    )
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])
    from ddtree_deploy.deploy.remote import bench as B  # noqa: E402
sys.path.insert(0, str(ROOT / "bench"))
import pin_flags as PF  # noqa: E402

# Per pin (bench/pin_flags.py): 0.5.16 runs the v2 worker with the overlap scheduler on (its
# default) and names its graph flags differently; this script's caps on top.
COMMON_BY_PIN = {pin: PF.common(pin, skip_tokenizer_init=True, mem_fraction=0.85, max_total_tokens=65536,
                                max_bs=32, max_running=32) for pin in PF.PINS}


def log(msg: str) -> None:
    print(f"[acceptance_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# The auto words --budgets takes: the server's flag value and the environment it gets. "auto+off"
# is the controller with `off` rounds offered (plain decode under load; docs/DDTREE.md); since the
# sixteenth session that is also what "auto" serves (off is on unless SGLANG_DDTREE_AUTO_OFF=0),
# and "auto+trees" is the controller without off. The older runs' "auto" was "auto+trees".
# "auto@off" runs every round as off (SGLANG_DDTREE_AUTO_ONLY=off): what an off round costs against
# plain decode, alone.
AUTO_MODES: dict[str, dict[str, str]] = {"auto": {}, "auto+off": {"SGLANG_DDTREE_AUTO_OFF": "1"},
                                         "auto+trees": {"SGLANG_DDTREE_AUTO_OFF": "0"},
                                         "auto@off": {"SGLANG_DDTREE_AUTO_ONLY": "off"}}


def ddtree_label(budget: int | str) -> str:
    """"DDTREE b15" for a fixed budget, "DDTREE auto" / "DDTREE auto+off" for the controller."""
    return f"DDTREE b{budget}" if isinstance(budget, int) else f"DDTREE {budget}"


def label_parts(name: str) -> tuple[str | None, int | str | None]:
    """A configuration label's (speculative algorithm, DDTREE budget), the inverse of
    :func:`configs`' labels: "plain" -> (None, None), "DFLASH" -> ("DFLASH", None),
    "DDTREE b15" -> ("DDTREE", 15), "DDTREE auto+off" -> ("DDTREE", "auto+off")."""
    if name == "plain":
        return None, None
    algo, _, word = name.partition(" ")
    if algo != "DDTREE":
        return algo, None
    if word[:1] == "b" and word[1:].isdigit():
        return algo, int(word[1:])
    if word in AUTO_MODES:
        return algo, word
    raise ValueError(f"not a configuration label: {name!r}")


def parse_budgets(text: str) -> list[int | str]:
    """--budgets: fixed budgets (integers), "auto" and "auto+off"."""
    out: list[int | str] = []
    for x in filter(None, text.split(",")):
        if x.isdigit():
            out.append(int(x))
        elif x in AUTO_MODES:
            out.append(x)
        else:
            raise SystemExit(f"--budgets: {x!r} is neither an integer nor one of {', '.join(AUTO_MODES)}")
    return out


def configs(budgets: list[int | str]) -> list[tuple[str, str]]:
    out = [("plain", ""), ("DFLASH", "--speculative-algorithm DFLASH --speculative-draft-model-path {draft}")]
    for b in budgets:
        flag = "auto" if isinstance(b, str) else b
        out.append((ddtree_label(b), "--speculative-algorithm DDTREE --speculative-draft-model-path {draft} "
                    f"--speculative-ddtree-budget {flag}"))
    return out


def parse_without(text: str, cfgs: list[tuple[str, str]]) -> set[str]:
    """--without: configuration names of this run to leave out; plain (the greedy reference) and
    names the run does not have are refused with the names it may use."""
    without = {x.strip() for x in text.split(",") if x.strip()}
    if "plain" in without or without - {n for n, _ in cfgs}:
        raise SystemExit(f"--without: {sorted(without)}: name configurations of this run other than plain "
                         f"({', '.join(n for n, _ in cfgs[1:])})")
    return without


def server_env(name: str, phase_times: bool = False) -> dict[str, str]:
    """The environment a configuration's server gets on top of this process's: the auto mode's
    switches, and SGLANG_DDTREE_PHASE_TIMES=1 on every DDTREE server with --phase-times (the
    round's phases in the log; the same few CUDA events a round on every DDTREE server)."""
    env: dict[str, str] = {}
    algo, budget = label_parts(name)
    if algo == "DDTREE":
        env.update(AUTO_MODES.get(budget, {}) if isinstance(budget, str) else {})
        if phase_times:
            env["SGLANG_DDTREE_PHASE_TIMES"] = "1"
    return env


class Server:
    def __init__(self, name: str, extra: str, port: int, pair: Path, logdir: Path, backend: str, common: str,
                 dtype: str = "bfloat16", env: dict[str, str] | None = None):
        self.name, self.port = name, port
        self.env = dict(env or {})
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(pair / "target"),
                    "--host", "127.0.0.1", "--port", str(port), "--attention-backend", backend, "--dtype", dtype,
                    *shlex.split(common), *shlex.split(extra.format(draft=pair / "draft"))]
        self.logpath = logdir / (name.replace(" ", "-") + ".log")
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0
        self.startup_s: float | None = None
        self.error: str | None = None
        self.attached = False  # --attach found it running (startup_s is then the time to answer)

    def start(self) -> None:
        self.t0 = time.time()
        envs = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        log(f"start {self.name}: {envs + ' ' if envs else ''}{' '.join(self.cmd)}")
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.logpath, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})

    def poll_ready(self) -> bool:
        """True once /health answers; sets error if the process died."""
        if self.startup_s is not None or self.error:
            return True
        if self.proc is not None and self.proc.poll() is not None:
            self.error = f"server exited with {self.proc.returncode} (see {self.logpath.name})"
            return True
        try:
            urllib.request.urlopen(self.url + "/health", timeout=2)
            self.startup_s = round(time.time() - self.t0, 1)
            log(f"{self.name} ready after {self.startup_s} s")
            return True
        except Exception:
            return False

    def verify_limit(self) -> str | None:
        """The DDTREE server's logged verify-token rule (it depends on the memory free at its start)."""
        try:
            lines = [x for x in self.logpath.read_text(errors="replace").splitlines() if "DDTREE verify limit" in x]
        except OSError:
            return None
        return lines[-1].strip()[-300:] if lines else None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def attached_mismatch(s: "Server") -> str | None:
    """None when the server at s's port runs s's configuration (speculative algorithm and DDTREE
    budget from /get_server_info), else why not: --attach must never measure one server under
    another's name."""
    info = B.server_info(s.url)
    algo, budget = info.get("speculative_algorithm"), info.get("speculative_ddtree_budget")
    want_algo, want_budget = label_parts(s.name)
    if isinstance(want_budget, str):  # auto and auto+off both serve --speculative-ddtree-budget auto
        want_budget = "auto"
    if algo != want_algo or (want_budget is not None and str(budget) != str(want_budget)):
        return f"port {s.port} serves algorithm {algo} budget {budget}, not {s.name}"
    return None


def auto_snapshot(url: str) -> dict | None:
    """The controller's state of a DDTREE auto server (internal_states[i].ddtree_budget_auto of
    /get_server_info: widths, cost table, calibration, rounds per width), or None."""
    try:
        info = B._request(url, "/get_server_info", None, 10.0)
    except (OSError, ValueError):  # unreachable (URLError is an OSError) or not JSON
        return None
    if not isinstance(info, dict):
        return None
    for st in info.get("internal_states") or []:
        if isinstance(st, dict) and isinstance(st.get("ddtree_budget_auto"), dict):
            return st["ddtree_budget_auto"]
    return None


def chosen_between(before: dict | None, after: dict | None) -> dict | None:
    """Rounds per option that a level added (the difference of two snapshots' `chosen`)."""
    if not after or not isinstance(after.get("chosen"), dict):
        return None
    b = (before or {}).get("chosen") or {}
    diff = {k: v - b.get(k, 0) for k, v in after["chosen"].items()}
    return {k: v for k, v in diff.items() if v}


def post(url: str, body: dict, timeout: float = 300) -> object:
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(servers: list[Server], deadline: float) -> None:
    pending = list(servers)
    while pending and time.time() < deadline:
        pending = [s for s in pending if not s.poll_ready()]
        time.sleep(1)
    for s in pending:
        s.error = "not ready before the deadline"


def same_run_ratios(doc: dict, group: str) -> list[tuple[str, dict[int, float | None]]]:
    """Tokens/s ratios of one temperature's levels, all from this run (the goals of issues 27 and
    28 are same-run ratios): every DDTREE configuration against DFLASH, and each auto
    configuration against the best fixed one at that concurrency (DFLASH and the fixed DDTREE
    budgets of the run; no such row in a run without one). None where a level was not measured."""
    servers = [s for s in doc["servers"] if s.get("group") == group]
    tps = {s["label"]: {lv["concurrency"]: lv.get("output_tokens_per_s") for lv in s["levels"]} for s in servers}
    concs = sorted({c for v in tps.values() for c in v})
    fixed = [n for n in tps if n == "DFLASH" or isinstance(label_parts(n)[1], int)]
    rows = []
    for name in tps:
        algo, budget = label_parts(name)
        if algo != "DDTREE":
            continue
        if "DFLASH" in tps:
            rows.append((f"{name} / DFLASH", {c: _ratio(tps[name].get(c), tps["DFLASH"].get(c)) for c in concs}))
        if isinstance(budget, str) and fixed:  # no fixed configuration in the run: no row
            best = {c: max((tps[n].get(c) for n in fixed if tps[n].get(c)), default=None) for c in concs}
            rows.append((f"{name} / best fixed", {c: _ratio(tps[name].get(c), best[c]) for c in concs}))
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def table_md(doc: dict, offline: dict | None, temps: list[float], budgets: list[int | str]) -> str:
    lines = []
    by = {(s["label"], s["group"]): s for s in doc["servers"]}
    for t in temps:
        g = f"T={t:g}"
        concs = sorted({lv["concurrency"] for s in doc["servers"] if s["group"] == g for lv in s["levels"]})
        if not concs:
            continue
        lines.append(f"### {g}\n")
        head = "| config | mean accept |" + "".join(f" tok/s c={c} | speedup c={c} |" for c in concs)
        lines += [head, "|---|---|" + "---|---|" * len(concs)]
        plain = by.get(("plain", g))
        for s in [x for x in doc["servers"] if x["group"] == g]:
            lv = {x["concurrency"]: x for x in s["levels"]}
            acc = [x["accept_length"] for x in s["levels"] if x.get("accept_length") is not None]
            row = f"| {s['label']} | {sum(acc) / len(acc):.2f} |" if acc else f"| {s['label']} | - |"
            for c in concs:
                tps = lv.get(c, {}).get("output_tokens_per_s")
                base = plain and {x["concurrency"]: x for x in plain["levels"]}.get(c, {}).get("output_tokens_per_s")
                row += f" {tps:.0f} |" if tps else " - |"
                row += f" {tps / base:.2f}x |" if tps and base else " - |"
            lines.append(row)
        lines.append("")
        ratios = same_run_ratios(doc, g)
        if ratios:
            lines.append(f"Same-run ratios of tokens/s, {g}:\n")
            lines.append("| ratio |" + "".join(f" c={c} |" for c in concs))
            lines.append("|---|" + "---|" * len(concs))
            for name, by_c in ratios:
                lines.append(f"| {name} |" + "".join(f" {by_c[c]:.2f}x |" if by_c.get(c) else " - |" for c in concs))
            lines.append("")
    exact = doc.get("exactness_vs_first") or {}
    if exact:
        cells = [f"{k} {sum(v)}/{len(v)}" if isinstance(v, list) else f"{k} {v}" for k, v in exact.items()]
        lines.append("Greedy outputs (8 held-out prompts x 64 tokens) equal to the plain target's: " + ", ".join(cells) + "\n")
    if offline:
        lines.append("### Predicted vs measured acceptance (tokens per round)\n")
        lines.append("| config | offline greedy (walk of the target's greedy text) | predicted by the drafter "
                     "(1 + sum of node probabilities) | server T=0 | server T=1 |")
        lines.append("|---|---|---|---|---|")
        for key, label in [("dflash", "DFLASH")] + [(f"ddtree_b{b}", ddtree_label(b)) for b in budgets]:
            o = offline.get(key) or {}
            cells = []
            for t in temps:
                s = by.get((label, f"T={t:g}"))
                acc = [x["accept_length"] for x in (s or {}).get("levels", []) if x.get("accept_length") is not None]
                cells.append(f"{sum(acc) / len(acc):.2f}" if acc else "-")
            lines.append(f"| {label} | {o.get('measured_accept', '-')} | {o.get('predicted_accept', '-')} | "
                         + " | ".join(cells) + " |")
        lines.append("")
        lines.append("Server acceptance is SGLang's completion_tokens / spec_verify_ct (it counts the prefill's "
                     "token, so it reads slightly above tokens per round); offline figures count rounds whose "
                     "whole block fits in the held-out prompts' greedy continuation.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pair", type=Path, default=None, help="reuse a trained pair (target/, draft/, prompts.jsonl)")
    ap.add_argument("--pair-dir", type=Path, default=Path("/tmp/tiny-pair"))
    ap.add_argument("--train-args", default="--time-limit 270", help="extra arguments for train_tiny_pair.py")
    ap.add_argument("--budgets", default="15,63,255", help="fixed budgets, auto, auto+off (comma-separated)")
    ap.add_argument("--without", default="", help="configurations to leave out, by name (e.g. DFLASH): what does not "
                    "fit the card beside the others; plain stays (the greedy reference)")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/acceptance-logs"),
                    help="server logs (its *.log are cleared first): one per run when two runs share a machine")
    ap.add_argument("--phase-times", action="store_true",
                    help="SGLANG_DDTREE_PHASE_TIMES=1 on every DDTREE server (per-phase round times in their logs)")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(8, WAVES x concurrency))")
    ap.add_argument("--order", choices=("temps-first", "conc-first"), default="temps-first",
                    help="temps-first: each server's levels at one temperature, then the next (a deadline "
                    "drops the last servers' T = 1); conc-first: every server and temperature at one "
                    "concurrency, then the next (a deadline drops the highest concurrencies)")
    ap.add_argument("--waves", type=int, default=2, help="requests per level in multiples of the concurrency (at least 8 "
                    "requests); 2 left two runs of a c >= 16 level up to 11 %% apart")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--pin", default="0.5.13.post1", choices=sorted(COMMON_BY_PIN),
                    help="the SGLang version installed (picks the common server flags)")
    ap.add_argument("--common", default=None, help="common server flags (default: the pin's)")
    ap.add_argument("--port-base", type=int, default=31000)
    ap.add_argument("--dtype", default="bfloat16", help="server dtype; float32 separates numerics from bugs in the greedy check")
    ap.add_argument("--exactness-only", action="store_true",
                    help="greedy equality check only (no timing levels); e.g. with --dtype float32 --pair DIR")
    ap.add_argument("--budget-s", type=float, default=540.0, help="whole-run deadline; levels left are skipped")
    ap.add_argument("--plain-last", action="store_true",
                    help="measure plain after the speculative servers (a deadline then drops plain's levels first; "
                         "the fourteenth session lost DFLASH's and b63's c = 1 levels behind plain's 32 requests)")
    ap.add_argument("--ddtree-first", action="store_true",
                    help="start the DDTREE servers first and the others once they are up: each DDTREE server sizes its "
                         "verify forward from the memory free at its start, which servers sharing the GPU would take")
    ap.add_argument("--keep-servers", action="store_true",
                    help="leave the servers running at the end (their own sessions), for a next call with --attach")
    ap.add_argument("--no-warm-levels", action="store_true",
                    help="skip the untimed pass of every concurrency level before timing (the first use of a "
                         "batch size is slower: 2026-12-06 run, c = 4)")
    ap.add_argument("--attach", action="store_true",
                    help="measure servers already running at the ports (an earlier --keep-servers run); starts only "
                         "those not answering")
    a = ap.parse_args()
    if a.common is None:
        a.common = COMMON_BY_PIN[a.pin]
    # the arguments first: a refused run writes nothing and clears no earlier run's logs
    budgets = parse_budgets(a.budgets)
    temps = [float(x) for x in a.temperatures.split(",") if x]
    levels = B.parse_concurrency(a.concurrency)
    if a.waves < 1:
        raise SystemExit(f"--waves: {a.waves}: give 1 or more (requests per level = max(8, waves x concurrency))")
    cfgs = configs(budgets)
    without = parse_without(a.without, cfgs)
    t_start = time.time()
    deadline = t_start + a.budget_s
    a.out.mkdir(parents=True, exist_ok=True)
    logdir = a.log_dir
    logdir.mkdir(parents=True, exist_ok=True)
    for old in logdir.glob("*.log") if not a.attach else []:  # attached servers keep writing theirs
        old.unlink()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    pair = a.pair or a.pair_dir
    servers = [Server(n, e, a.port_base + i, pair, logdir, a.backend, a.common, a.dtype,
                      env=server_env(n, a.phase_times)) for i, (n, e) in enumerate(cfgs) if n not in without]
    if a.exactness_only:
        temps = []
    train_rc = 0
    if a.pair is None:
        if pair.exists():  # a warm machine may hold an earlier run's pair (and its TARGET_READY)
            shutil.rmtree(pair)
        cmd = [sys.executable, str(ROOT / "bench" / "train_tiny_pair.py"), "--out", str(pair), *shlex.split(a.train_args)]
        log("train: " + " ".join(cmd))
        tp = subprocess.Popen(cmd, stdout=open(logdir / "train.log", "w"), stderr=subprocess.STDOUT)
        started_plain = False
        while tp.poll() is None:
            if not started_plain and (pair / "TARGET_READY").exists():
                servers[0].start()  # the plain server comes up while the drafter trains
                started_plain = True
            time.sleep(1)
        train_rc = tp.returncode
        log(f"training finished rc={train_rc} after {time.time() - t_start:.0f} s")
        if train_rc != 0:
            for s in servers:
                s.stop()
            (a.out / "results.json").write_text(json.dumps({"ok": False, "error": f"training failed rc={train_rc}"}) + "\n")
            with tarfile.open(a.out / "logs.tgz", "w:gz") as tf:
                tf.add(logdir, arcname="logs")
            return 1
    exact: dict = {}
    if a.attach:
        for s in servers:
            s.t0 = time.time()
        wait_ready(servers, time.time() + 30)
        for s in servers:  # whatever answers at a port must be this configuration (its /get_server_info)
            if s.startup_s is not None:
                s.attached = True
                why = attached_mismatch(s)
                if why:
                    log(f"{s.name}: {why}")
                    (a.out / "results.json").write_text(json.dumps({"ok": False, "error": f"{s.name}: {why}"}) + "\n")
                    return 2
    elif a.ddtree_first:
        first = [s for s in servers if label_parts(s.name)[0] == "DDTREE" and s.proc is None]
        for s in first:
            s.start()
        wait_ready(first, min(deadline, time.time() + 300))
    for s in servers:
        if s.proc is None and (not a.attach or s.startup_s is None):
            s.error = None  # --attach: a server not answering at its port is started here
            s.start()
    verdict = False  # run_ok's, once the results are written
    try:
        wait_ready(servers, min(deadline, time.time() + 420))
        prompts = B.load_prompts(pair / "prompts.jsonl")
        offline = json.loads((pair / "eval.json").read_text()) if (pair / "eval.json").exists() else None
        train = json.loads((pair / "train_log.json").read_text()) if (pair / "train_log.json").exists() else None
        live = [s for s in servers if s.startup_s is not None]
        # warm-up (untimed): batch 32 at each temperature, then the greedy exactness check
        for s in live:
            for t in temps:
                try:
                    post(s.url, {"input_ids": [p["input_ids"] for p in prompts[:32]],
                                 "sampling_params": {"max_new_tokens": 16, "temperature": t, "ignore_eos": True}})
                except Exception as exc:  # recorded, the server is then measured anyway
                    s.error = f"warm-up failed: {exc}"
        ref = None
        for s in live:
            try:
                outs = post(s.url, {"input_ids": [p["input_ids"] for p in prompts[:8]],
                                    "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}})
                ids = [o["output_ids"] for o in outs]
                if ref is None:
                    ref = ids
                exact[s.name] = [x == y for x, y in zip(ids, ref)]
            except Exception as exc:
                exact[s.name] = f"error: {exc}"
        log(f"greedy outputs equal to the first server's ({live[0].name if live else '-'}): {exact}")
        skipped: list[str] = []
        auto_levels: dict = {}  # auto servers: {name: {T: {c: rounds per option}}}
        auto_final: dict = {}  # auto servers: {name: {T: the controller's snapshot after the levels}}
        blocks = [(t, s) for t in temps for s in servers if s.startup_s is not None]  # results' order
        # --plain-last: plain after the speculative servers at each temperature (and concurrency),
        # so a deadline drops plain's levels, the slowest at c = 1, before DFLASH's and DDTREE's
        measure = sorted(blocks, key=lambda b: (temps.index(b[0]), b[1].name == "plain")) if a.plain_last else blocks
        if a.order == "temps-first":  # each server's levels at one temperature, then the next
            schedule = [(t, s, c) for t, s in measure for c in levels]
        else:  # conc-first: every server and temperature at c, then the next c (a deadline cuts high c)
            schedule = [(t, s, c) for c in levels for t, s in measure]
        runs = {(t, s.name): B.ServerResult(target=s.url, label=s.name, url=s.url, group=f"T={t:g}")
                for t, s in blocks}
        snaps: dict = {}
        warmed: set = set()
        done: set = set()

        def finish(t: float, s: "Server") -> None:  # a block's last level: its server info and snapshot
            key = (t, s.name)
            if key in done:
                return
            done.add(key)
            if isinstance(label_parts(s.name)[1], str):
                auto_final.setdefault(s.name, {})[f"T={t:g}"] = snaps.get(key)
            try:
                runs[key].server = B.server_info(s.url)
            except Exception as exc:  # a server that died mid-run: its levels carry the errors
                s.error = s.error or f"server_info failed: {exc}"

        for t, s, c in schedule:
            key, is_auto = (t, s.name), isinstance(label_parts(s.name)[1], str)
            if key not in warmed:  # untimed: each batch size's first use pays one-time costs
                warmed.add(key)
                if not a.no_warm_levels:
                    warm = B.Sampling(max_new_tokens=16, temperature=t)
                    for wc in levels:
                        if time.time() < deadline:
                            B.run_level(s.url, prompts, wc, wc, warm)
                if is_auto:
                    snaps[key] = auto_snapshot(s.url)
            if time.time() > deadline:
                skipped.append(f"{s.name} T={t:g} c={c}")
            else:
                samp = B.Sampling(max_new_tokens=a.max_new_tokens, temperature=t)
                if is_auto and a.order != "temps-first":  # the other temperature's levels ran since
                    snaps[key] = auto_snapshot(s.url)
                runs[key].levels.append(B.run_level(s.url, prompts, c, B.requests_for(c, a.requests, a.waves), samp))
                lv = runs[key].levels[-1]
                chosen = None
                if is_auto:  # which options the controller ran at this level
                    after = auto_snapshot(s.url)
                    chosen = chosen_between(snaps[key], after)
                    auto_levels.setdefault(s.name, {}).setdefault(f"T={t:g}", {})[str(c)] = chosen
                    snaps[key] = after
                log(f"{s.name} T={t:g} c={c}: {lv.output_tokens_per_s} tok/s, accept {lv.accept_length}, "
                    f"round {lv.per_round_ms} ms, p50 {lv.latency_p50_ms} ms, errors {len(lv.errors)}"
                    + (f", fit {lv.fit_request_ms} ms a request + {lv.fit_round_ms} ms a round"
                       if lv.fit_round_ms is not None else "")
                    + (f", rounds per option {chosen}" if is_auto else ""))
            if c == levels[-1]:
                finish(t, s)
        for t, s in blocks:
            finish(t, s)
        results: list[B.ServerResult] = [runs[(t, s.name)] for t, s in blocks]
        doc = B.report(results, B.Sampling(max_new_tokens=a.max_new_tokens), {
            "driver": "bench/acceptance_run.py", "dtype": a.dtype, "temperatures": temps, "concurrency": levels,
            "offline": offline, "exactness_vs_first": exact, "skipped": skipped,
            "startup_s": {s.name: s.startup_s for s in servers}, "server_errors": servers_failed(servers),
            "verify_limits": {s.name: s.verify_limit() for s in servers if label_parts(s.name)[0] == "DDTREE"},
            "server_cmds": {s.name: "attached: started by an earlier run" if s.attached else " ".join(s.cmd) for s in servers},
            "server_env": {s.name: s.env for s in servers if s.env},
            "auto_rounds_per_level": auto_levels, "auto_snapshot": auto_final,
            "train": {k: train[k] for k in ("stages", "seconds", "truncated", "bytes", "torch", "python")} if train else None,
            "seconds": round(time.time() - t_start, 1),
        })
        verdict = run_ok(doc, [s.startup_s is not None for s in servers])
        doc["ok"], doc["exit_code"] = verdict, 0 if verdict else 1
        (a.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (a.out / "table.md").write_text(table_md(doc, offline, temps, budgets))
        try:
            B.plot(doc, a.out / "plot.png", title="tiny stdlib pair: plain / DFLASH / DDTREE")
        except Exception as exc:  # ImportError without matplotlib; the numbers are written already
            log(f"no plot ({type(exc).__name__}: {exc}): render it with "
                "ddtree-deploy bench --from-json results.json --plot plot.png")
        print((a.out / "table.md").read_text())
    finally:
        for s in servers:
            if not a.keep_servers:
                s.stop()
        if a.pair is None and pair.exists():
            with tarfile.open(a.out / "pair.tgz", "w:gz") as tf:
                for name in ("target", "draft", "prompts.jsonl", "eval.json", "split.json", "train_log.json"):
                    if (pair / name).exists():
                        tf.add(pair / name, arcname=f"tiny-pair/{name}")
        with tarfile.open(a.out / "logs.tgz", "w:gz") as tf:
            tf.add(logdir, arcname="logs")
    ok = bool(verdict)
    log(f"done in {time.time() - t_start:.0f} s, ok={ok}"
        + ("" if ok else f" (server errors: {servers_failed(servers) or 'none'}; see results.json)"))
    return 0 if ok else 1


def servers_failed(servers) -> dict:
    return {s.name: s.error for s in servers if s.error}


def run_ok(doc: dict, started: list[bool]) -> bool:
    """The run's verdict, the same in results.json, the last log line and the exit code: every
    server started and none failed later (``server_errors``: a warm-up or server-info failure, e.g.
    a server that ran out of memory at its first batch), every request of every measured level
    answered, and the greedy check ran on every live server. Greedy equality itself is reported,
    not required: a bf16 verify (many tokens a forward) and decode (one) may round differently at a
    near-tie, which is not a speculative-decoding error. Levels skipped at the deadline are
    reported in ``skipped`` and do not fail the run."""
    exact = doc.get("exactness_vs_first") or {}
    return (all(started) and not doc.get("server_errors") and bool(doc.get("ok")) and bool(exact)
            and all(isinstance(v, list) for v in exact.values()))


if __name__ == "__main__":
    sys.exit(main())
