#!/usr/bin/env python3
"""End-to-end DDTREE matrix on one GPU with real SGLang and tiny dummy-weight models.

Starts one server per configuration (several in parallel, each on its own port), sends
the same batch of greedy requests to each and compares outputs token for token with the
plain target's and DFLASH's on the same attention backend. Selected DDTREE servers also
run the extra checks: sampling (T=0.7, top-p, top-k) returns valid tokens, a logprobs
request is refused while other requests keep being served, /get_server_info reports
DDTREE and, with --speculative-ddtree-debug-metrics, the debug metrics.

  python3 tests/gpu/ddtree_e2e.py --out OUT [--pin 0.5.16] [--backends triton,flashinfer] [--budgets 1,15,63,255]

A budget may also be `auto` (--speculative-ddtree-budget auto, the controller's widths) or
`autocycle` (auto with SGLANG_DDTREE_AUTO_CYCLE=1 and SGLANG_DDTREE_AUTO_OFF=1: the width
changes every round, and every few rounds is an `off` round, verify width 1 without the draft
forward); both must match the plain target like a fixed budget (also in the mixed greedy +
sampled batches, which they serve), and /get_server_info must show the controller with at
least two widths run (autocycle: every width and off) and its start-up cost table (with CUDA
graphs: measured by graph replays, every seeded verify time positive; eager: skipped).

Every server also serves (compared with the plain target's outputs): 40 concurrent requests
of random prompt and output lengths, and requests with a stop token (ends inside a round).
DFLASH and the extra-check DDTREE servers serve a mixed batch (greedy and T 0.7 / top-p 0.9
requests at once): every request must be answered within --mixed-timeout and the greedy rows
must equal greedy-only serving (recorded, not required, for DFLASH: upstream stalls there).

Writes OUT/<config>.log, OUT/summary.json and prints a result table. Exit status 0 only
when every check passed. Needs CUDA and the patched sglang on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def _load_by_path(name: str, path: Path):
    """A stdlib-only module of this checkout loaded by path, so no test or bench directory goes
    onto sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ROOT = Path(__file__).resolve().parents[2]
# the tiny model configs shared with the CPU tests
fixtures = _load_by_path("ddtree_tiny_fixtures", _ROOT / "tests" / "sglang" / "fixtures.py")

# A small vocabulary makes random-weight drafts hit the target's argmax often enough that
# trees are accepted several nodes deep (the tree mask, KV compaction and hidden gathers
# then matter for the output); --vocab 2048 gives the near-zero acceptance of a real vocab.
DEFAULT_VOCAB = 32


def model_configs(vocab: int) -> tuple[dict, dict]:
    """Tiny Qwen3 target and DFlash draft configs (dummy weights): the CPU tests' fixtures."""
    return fixtures.target_config(vocab), fixtures.draft_config(16, vocab)


PROMPT_LENS = (3, 9, 26, 48, 77, 120, 191, 260, 14, 33)
# the server flags of every device script, per pin
PF = _load_by_path("ddtree_pin_flags", _ROOT / "bench" / "pin_flags.py")
# 0.5.16: overlap scheduler on (default); 48 running requests so the 40 concurrent requests batch
# together; graphs up to batch 32 (larger batches run eagerly).
COMMON_ARGS_BY_PIN = {
    "0.5.13.post1": PF.common("0.5.13.post1", mem_fraction=0.9, max_total_tokens=65536, max_bs=16, max_running=16),
    "0.5.16": PF.common("0.5.16", mem_fraction=0.9, max_total_tokens=65536, max_bs=32, max_running=48),
}
COMMON_ARGS = COMMON_ARGS_BY_PIN["0.5.13.post1"]
STOP_TOKEN = 5


@dataclass
class Config:
    name: str
    backend: str
    extra: str
    kind: str  # base | dflash | ddtree
    extras_checks: bool = False
    debug_metrics: bool = False
    auto: str = ""  # "", "auto" or "autocycle" (budget auto; cycling the widths)
    env: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)


AUTO_BUDGETS = ("auto", "autocycle")
DEFAULT_BUDGET = "default"  # DDTREE with no budget flag: the pin's default
# pins whose default budget is auto (ddtree_serving.resolve_ddtree_server_args)
DEFAULT_AUTO_PINS = ("0.5.16",)


def parse_budgets(text: str) -> list:
    """--budgets: integers, auto / autocycle, and default (no budget flag)."""
    out = []
    for b in text.split(","):
        b = b.strip().lower()
        if b in AUTO_BUDGETS or b == DEFAULT_BUDGET:
            out.append(b)
        elif b.isdigit():
            out.append(int(b))
        else:
            raise SystemExit(f"--budgets: {b!r} is not an integer, auto, autocycle or default")
    return out


def build_matrix(
    backends: list[str], budgets: list, graphs: list[str], pin: str = "0.5.13.post1"
) -> list[Config]:
    """base and DFLASH per backend, DDTREE per budget x graph mode; extra checks on budget 15.
    Budget ``default`` starts DDTREE without a budget flag; where the pin's default is auto, the
    row gets auto's checks (the controller ran, its start-up table, one capture stream)."""
    out: list[Config] = []
    for be in backends:
        out.append(Config(f"{be}-base", be, "", "base"))
        out.append(
            Config(
                f"{be}-dflash",
                be,
                "--speculative-algorithm DFLASH --speculative-draft-model-path {draft}",
                "dflash",
            )
        )
        for b in budgets:
            for g in graphs:
                extras = b == 15
                auto = b if b in AUTO_BUDGETS else ""
                extra = "--speculative-algorithm DDTREE --speculative-draft-model-path {draft}"
                if b == DEFAULT_BUDGET:
                    auto = "auto" if pin in DEFAULT_AUTO_PINS else ""
                else:
                    extra += f" --speculative-ddtree-budget {'auto' if auto else b}"
                env = {}
                if (extras or auto) and g == "cg":
                    # host syncs inside the round reported in the log (0.5.16 worker)
                    env["SGLANG_DDTREE_SYNC_DEBUG"] = "1"
                if auto == "autocycle":
                    env["SGLANG_DDTREE_AUTO_CYCLE"] = "1"
                    env["SGLANG_DDTREE_AUTO_OFF"] = "1"  # off rounds in the cycle
                if g == "eager":
                    extra += " --disable-cuda-graph"
                if extras and g == "cg":
                    extra += " --speculative-ddtree-debug-metrics"
                out.append(
                    Config(
                        f"{be}-ddtree-b{b}-{g}",
                        be,
                        extra,
                        "ddtree",
                        extras_checks=extras,
                        debug_metrics=extras and g == "cg",
                        auto=auto,
                        env=env,
                    )
                )
    return out


def post(port: int, path: str, body: dict, timeout: float = 300) -> tuple[int, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


def get(port: int, path: str, timeout: float = 30) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def greedy(port: int, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    code, outs = post(
        port,
        "/generate",
        {
            "input_ids": prompts,
            "sampling_params": {
                "max_new_tokens": max_new,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
    )
    if code != 200:
        raise RuntimeError(f"greedy request failed: HTTP {code}: {str(outs)[:300]}")
    return outs


def concurrent(port: int, reqs: list[tuple[list[int], dict]], timeout: float) -> list:
    """Send every (input_ids, sampling_params) as its own request at once; outputs in order
    (None for a request that failed or was not answered within `timeout`)."""
    results: list = [None] * len(reqs)

    def one(i: int) -> None:
        ids, params = reqs[i]
        try:
            code, out = post(
                port, "/generate", {"input_ids": ids, "sampling_params": params}, timeout
            )
            if code == 200:
                results[i] = out["output_ids"]
        except (OSError, ValueError, KeyError):
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return results


def stress_requests(vocab: int) -> tuple[list, list]:
    """40 greedy requests of random prompt/output lengths, and stop-token requests."""
    rng = random.Random(1)
    conc = []
    for _ in range(40):
        ids = [rng.randrange(3, vocab - 1) for _ in range(rng.randrange(1, 300))]
        conc.append(
            (ids, {"max_new_tokens": rng.randrange(1, 97), "temperature": 0, "ignore_eos": True})
        )
    stop = []
    for _ in range(8):
        ids = [rng.randrange(3, vocab - 1) for _ in range(rng.randrange(2, 80))]
        stop.append(
            (ids, {"max_new_tokens": 64, "temperature": 0, "stop_token_ids": [STOP_TOKEN]})
        )
    return conc, stop


def mixed_batch(
    port: int, prompts: list[list[int]], max_new: int, timeout: float
) -> dict:
    """Greedy and sampled requests at once: all answered in time; greedy rows kept."""
    greedy_p = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    sampled_p = {"max_new_tokens": max_new, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    reqs = []
    for p in prompts:
        reqs.append((p, greedy_p))
        reqs.append((p, sampled_p))
    t0 = time.time()
    outs = concurrent(port, reqs, timeout)
    return {
        "seconds": round(time.time() - t0, 1),
        "answered": sum(o is not None for o in outs),
        "requests": len(outs),
        "greedy_outputs": outs[0::2],
        "sampled_lens_ok": all(o is not None and len(o) == max_new for o in outs[1::2]),
    }


def mixed_batch_check(
    port: int, prompts: list[list[int]], max_new: int, reference: list[list[int]], timeout: float = 120
) -> dict:
    """Greedy and sampled (T 0.7, top-p 0.9, no top-k) requests in one batch: the server must
    answer (upstream DFLASH hung here, patch 0008) and greedy rows must equal greedy-only."""
    greedy_sp = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    sampled_sp = {"max_new_tokens": max_new, "temperature": 0.7, "top_p": 0.9, "ignore_eos": True}
    params = [greedy_sp if i % 2 == 0 else sampled_sp for i in range(len(prompts))]
    try:
        code, outs = post(port, "/generate", {"input_ids": prompts, "sampling_params": params}, timeout=timeout)
    except OSError as e:  # a hang shows up as a timeout
        return {"mixed_batch_served": False, "mixed_batch_error": repr(e)}
    if code != 200:
        return {"mixed_batch_served": False, "mixed_batch_error": str(outs)[:200]}
    greedy_equal = all(outs[i]["output_ids"] == reference[i] for i in range(0, len(prompts), 2))
    return {"mixed_batch_served": True, "mixed_batch_greedy_equal": greedy_equal}


def extra_checks(
    cfg: Config,
    port: int,
    prompts: list[list[int]],
    max_new: int,
    reference: list[list[int]],
    vocab: int,
) -> dict:
    """Sampling, logprobs refusal while serving, /get_server_info (and debug metrics)."""
    checks: dict = {}
    code, outs = post(
        port,
        "/generate",
        {
            "input_ids": prompts,
            "sampling_params": {
                "max_new_tokens": max_new,
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
                "ignore_eos": True,
            },
        },
    )
    ok = code == 200 and all(
        len(o["output_ids"]) == max_new and all(0 <= t < vocab for t in o["output_ids"])
        for o in outs
    )
    checks["sampling_valid"] = bool(ok)
    if ok:
        checks["sampling_differs_from_greedy"] = any(
            o["output_ids"] != r for o, r in zip(outs, reference)
        )

    # A logprobs request must be refused while a concurrent greedy request is served.
    served: dict = {}

    def background() -> None:
        try:
            served["outs"] = [
                o["output_ids"] for o in greedy(port, prompts[:4], max_new)
            ]
        except (OSError, RuntimeError, ValueError, KeyError) as e:  # checked below
            served["error"] = repr(e)

    t = threading.Thread(target=background)
    t.start()
    code, body = post(
        port,
        "/generate",
        {
            "input_ids": prompts[0],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    t.join()
    text = json.dumps(body) if not isinstance(body, str) else body
    checks["logprobs_refused"] = code != 200 or "error" in text.lower()
    checks["logprobs_message"] = text[:200]
    checks["served_during_refusal"] = served.get("outs") == reference[:4]
    after = [o["output_ids"] for o in greedy(port, prompts, max_new)]
    checks["served_after_refusal"] = after == reference

    info = get(port, "/get_server_info")
    checks["server_info_algorithm"] = info.get("speculative_algorithm")
    checks["server_info_ddtree"] = info.get("speculative_algorithm") == "DDTREE"
    states = info.get("internal_states") or [{}]
    metrics = states[0].get("ddtree_debug_metrics")
    if cfg.debug_metrics:
        checks["debug_metrics"] = metrics
        checks["debug_metrics_present"] = bool(metrics) and metrics.get("rounds", 0) > 0
    return checks


def run_config(
    cfg: Config,
    port: int,
    models: str,
    out_dir: str,
    prompts: list[list[int]],
    max_new: int,
    startup_timeout: float,
    vocab: int,
    common_args: str = COMMON_ARGS,
    mixed_timeout: float = 120,
) -> None:
    tdir, ddir = os.path.join(models, "target"), os.path.join(models, "draft")
    extra = cfg.extra.format(draft=ddir, target=tdir)
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        tdir,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--attention-backend",
        cfg.backend,
        *shlex.split(common_args),
        *shlex.split(extra),
    ]
    rec = cfg.result
    rec["cmd"] = " ".join(cmd)
    log = open(os.path.join(out_dir, f"{cfg.name}.log"), "w")  # noqa: SIM115 - closed in finally
    t0 = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1", **cfg.env),
    )
    SERVERS.append(proc)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode} during startup"
                )
            if time.time() - t0 > startup_timeout:
                raise RuntimeError("startup timeout")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        rec["startup_s"] = round(time.time() - t0, 1)
        _phase(cfg, "greedy")
        t1 = time.time()
        outs = greedy(port, prompts, max_new)
        rec["gen_s"] = round(time.time() - t1, 2)
        rec["outputs"] = [o["output_ids"] for o in outs]
        rec["accept_len"] = [o["meta_info"].get("spec_accept_length") for o in outs]
        conc, stop = stress_requests(vocab)
        _phase(cfg, "concurrent + stop")
        rec["concurrent_outputs"] = concurrent(port, conc, 300)
        rec["stop_outputs"] = concurrent(port, stop, 300)
        if cfg.auto:
            _phase(cfg, "budget auto: /get_server_info")
            rec["auto"] = auto_check(cfg, port, os.path.join(out_dir, f"{cfg.name}.log"))
        if cfg.kind == "dflash" or cfg.extras_checks or cfg.auto:
            _phase(cfg, "mixed batch (one request per prompt)")
            rec["mixed"] = mixed_batch(port, prompts, max_new, mixed_timeout)
        if cfg.extras_checks:
            _phase(cfg, "extra checks")
            rec["checks"] = extra_checks(
                cfg, port, prompts, max_new, rec["outputs"], vocab
            )
        if cfg.kind == "dflash" or cfg.extras_checks or cfg.auto:
            _phase(cfg, "mixed batch (one batched request)")
            rec.setdefault("checks", {}).update(
                mixed_batch_check(port, prompts, max_new, rec["outputs"], mixed_timeout)
            )
            if not rec["checks"].get("mixed_batch_served"):
                dump_stacks(proc)
    except Exception as e:  # noqa: BLE001 - any failure is recorded in the summary
        rec["error"] = repr(e)
    finally:
        stop_server(proc)
        log.close()
        rec["total_s"] = round(time.time() - t0, 1)
        if cfg.env.get("SGLANG_DDTREE_SYNC_DEBUG"):
            with open(os.path.join(out_dir, f"{cfg.name}.log"), errors="replace") as f:
                lines = f.read().splitlines()
            hits = [i for i, ln in enumerate(lines) if "synchronizing CUDA operation" in ln]
            rec["round_host_syncs"] = len(hits)  # distinct sites (warnings print once each)
            rec["round_host_sync_sites"] = [
                " | ".join(lines[max(0, i - 1) : i + 2])[:300] for i in hits[:8]
            ]


SERVERS: list[subprocess.Popen] = []  # every server started, so a deadline can stop them all


def _phase(cfg: Config, what: str) -> None:
    """Say which step a config is in (a hang then names its step), and keep it in the record."""
    cfg.result["phase"] = what
    print(f"  {cfg.name}: {what}", flush=True)


def dump_stacks(proc: subprocess.Popen) -> None:
    """A server that stopped answering: SIGABRT its process group, so that faulthandler
    (PYTHONFAULTHANDLER=1) writes every process's Python stack into the server log."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        time.sleep(3)
    except ProcessLookupError:
        pass


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def startup_table_ok(snap: dict, graphs: bool) -> bool:
    """Budget auto's start-up cost table (graph replays): with CUDA graphs, measured, and every
    seeded verify time positive, every width with a seed (monotone in the width is not
    guaranteed, so not checked); eager: skipped (the table fills online)."""
    startup = snap.get("startup") or {}
    if not graphs:
        return startup.get("status") == "skipped"
    rows = (snap.get("cost_table") or {}).get("verify_ms") or []
    cells = [ms for row in rows for ms in row if ms is not None]
    columns = list(zip(*rows)) if rows else []
    return (
        startup.get("status") == "measured"
        and (startup.get("seeded") or 0) > 0
        and len(cells) == startup.get("seeded")
        and all(ms > 0 for ms in cells)
        and bool(columns)
        and all(any(ms is not None for ms in col) for col in columns)
    )


def startup_seeds_in_range(snap: dict) -> bool:
    """Budget auto's batch range per width on a GPU: every width's verify graphs were captured
    only within its range (patch 0005's seam), so a start-up seed (a replayed graph) lies in a
    bucket no larger than the width's largest batch (snapshot "max_batch"; None: every batch),
    and every width has a seed at the smallest bucket (batch 1 is in every range)."""
    table = snap.get("cost_table") or {}
    buckets, options = table.get("buckets") or [], table.get("options") or []
    rows = table.get("verify_ms") or []
    limits = snap.get("max_batch") or {}
    if not rows or not buckets:
        return False
    for i, bucket in enumerate(buckets):
        for j, option in enumerate(options):
            limit = limits.get(option)
            if rows[i][j] is not None and limit is not None and bucket > limit:
                return False
    return all(ms is not None for ms in rows[0])


WIDTH_BUILT = re.compile(r"DDTREE auto: verify width (\d+) built \(([^)]*)\)")
SHARED_STREAM = "CUDA graphs, on the widest width's capture stream"


def capture_streams_shared(log_text: str) -> bool:
    """Budget auto's start-up log (ddtree_auto_v2.build_verify_states): every width besides the
    widest was captured with CUDA graphs on the widest width's capture stream (patch 0005's seam),
    so its graphs reuse the pool blocks that stream's graphs freed. False without such lines."""
    built = WIDTH_BUILT.findall(log_text)
    return bool(built) and all(how == SHARED_STREAM for _, how in built)


def auto_check(cfg: Config, port: int, log_path: str | None = None) -> dict:
    """Budget auto after the greedy, concurrent and stop requests: /get_server_info's
    internal_states carry the controller's snapshot; at least two widths ran (autocycle: all,
    and off rounds); the start-up cost table is there (graphs: measured and positive; eager:
    skipped)."""
    states = get(port, "/get_server_info").get("internal_states") or [{}]
    snap = states[0].get("ddtree_budget_auto") or {}
    chosen = {w: n for w, n in (snap.get("chosen") or {}).items() if n}
    widths = snap.get("widths") or []
    cycle = cfg.auto == "autocycle"
    need = len(snap.get("options") or widths) if cycle else 2
    graphs = "--disable-cuda-graph" not in cfg.extra
    startup_ok = startup_table_ok(snap, graphs) and (not graphs or startup_seeds_in_range(snap))
    streams_shared = None
    if graphs and log_path:
        with open(log_path, errors="replace") as f:
            streams_shared = capture_streams_shared(f.read())
        startup_ok = startup_ok and streams_shared
    return {
        "widths": widths,
        "off": snap.get("off"),
        "mode": snap.get("mode"),
        "chosen": snap.get("chosen"),
        "observed_rounds": snap.get("observed_rounds"),
        "dropped_rounds": snap.get("dropped_rounds"),
        "startup": snap.get("startup"),
        "startup_ok": startup_ok,
        "capture_streams_shared": streams_shared,
        "max_batch": snap.get("max_batch"),
        "cost_table": snap.get("cost_table"),
        "expected_committed": snap.get("expected_committed"),
        "ok": bool(snap)
        and snap.get("mode") == ("cycle" if cycle else "controller")
        and (not cycle or (snap.get("off") is True and "off" in chosen))
        and len(chosen) >= max(need, 1)
        and (snap.get("observed_rounds") or 0) > 0
        and startup_ok,
    }


def compare(configs: list[Config]) -> None:
    """Per backend: every config's greedy outputs vs the base's and DFLASH's."""
    by_name = {c.name: c for c in configs}
    for c in configs:
        base = by_name.get(f"{c.backend}-base")
        dfl = by_name.get(f"{c.backend}-dflash")
        outs = c.result.get("outputs")
        if base is not None and base is not c:
            for key in ("concurrent_outputs", "stop_outputs"):
                mine, theirs = c.result.get(key), base.result.get(key)
                if mine is not None and theirs is not None:
                    c.result[key.replace("outputs", "match_base")] = mine == theirs and all(
                        o is not None for o in mine
                    )
            mixed = c.result.get("mixed")
            if mixed is not None and base.result.get("outputs") is not None:
                mixed["greedy_match_base"] = mixed["greedy_outputs"] == base.result["outputs"]
                mixed["ok"] = (
                    mixed["answered"] == mixed["requests"]
                    and mixed["greedy_match_base"]
                    and mixed["sampled_lens_ok"]
                )
        for label, ref in (("matches_base", base), ("matches_dflash", dfl)):
            if (
                ref is None
                or ref is c
                or outs is None
                or ref.result.get("outputs") is None
            ):
                continue
            c.result[label] = outs == ref.result["outputs"]
            if not c.result[label]:
                c.result[label + "_per_prompt"] = [
                    x == y for x, y in zip(outs, ref.result["outputs"])
                ]


def passed(c: Config) -> bool:
    r = c.result
    if "error" in r or "outputs" not in r:
        return False
    if r.get("matches_base") is False or r.get("matches_dflash") is False:
        return False
    for key in ("concurrent_match_base", "stop_match_base"):
        if r.get(key) is False:
            return False
    if c.auto and not (r.get("auto") or {}).get("ok"):
        return False
    # Upstream DFLASH's mixed-batch result is recorded, not required.
    if c.kind == "ddtree" and "mixed" in r and not r["mixed"].get("ok"):
        return False
    ch = r.get("checks", {})
    keys = (
        "sampling_valid",
        "logprobs_refused",
        "served_during_refusal",
        "served_after_refusal",
        "server_info_ddtree",
    )
    if c.extras_checks and not all(ch.get(k) for k in keys):
        return False
    if "mixed_batch_served" in ch and not (ch["mixed_batch_served"] and ch.get("mixed_batch_greedy_equal")):
        return False
    return not (c.debug_metrics and not ch.get("debug_metrics_present"))


def _sync_note(r: dict) -> str:
    note = "" if "round_host_syncs" not in r else f", host syncs in round: {r['round_host_syncs']}"
    if r.get("auto") is not None:
        a = r["auto"]
        note += f", auto {'ok' if a.get('ok') else 'FAIL'} ran {a.get('chosen')}"
        note += f", start-up table {'ok' if a.get('startup_ok') else 'FAIL'}"
        if a.get("capture_streams_shared") is not None:
            note += f", widths on one capture stream: {a['capture_streams_shared']}"
    return note


def _mixed_cell(m) -> str:
    if not m:
        return "-"
    return (
        f"{m['answered']}/{m['requests']} in {m['seconds']} s, greedy={m.get('greedy_match_base', '-')}"
    )


def table(configs: list[Config]) -> str:
    rows = [
        "| config | startup s | gen s | = base | = DFLASH | mean accept | concurrent/stop = base | mixed batch | extra checks | result |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        r = c.result
        acc = [a for a in r.get("accept_len") or [] if a is not None]
        mean = f"{sum(acc) / len(acc):.2f}" if acc else "-"
        ch = r.get("checks")
        chs = (
            "-"
            if not ch
            else ", ".join(
                f"{k}={'ok' if v else 'FAIL'}"
                for k, v in ch.items()
                if isinstance(v, bool)
            )
        )
        rows.append(
            f"| {c.name} | {r.get('startup_s', '-')} | {r.get('gen_s', '-')} | "
            f"{r.get('matches_base', '-')} | {r.get('matches_dflash', '-')} | {mean} | "
            f"{r.get('concurrent_match_base', '-')}/{r.get('stop_match_base', '-')} | "
            f"{_mixed_cell(r.get('mixed'))} | {chs}{_sync_note(r)} | {'PASS' if passed(c) else 'FAIL: ' + r.get('error', 'mismatch')[:80]} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="/tmp/ddtree-tiny-models")
    ap.add_argument("--backends", default="triton,flashinfer")
    ap.add_argument("--budgets", default="1,15,63,255")
    ap.add_argument("--graphs", default="cg,eager")
    ap.add_argument("--only", default="", help="regex on config names")
    ap.add_argument("--parallel", type=int, default=12)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--startup-timeout", type=float, default=420)
    ap.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    ap.add_argument("--pin", default="0.5.13.post1", choices=sorted(COMMON_ARGS_BY_PIN))
    ap.add_argument("--mixed-timeout", type=float, default=120)
    ap.add_argument(
        "--deadline",
        type=float,
        default=0,
        help="seconds; when reached, write the table with what finished (the rest: unfinished) and stop",
    )
    a = ap.parse_args()

    os.makedirs(a.out, exist_ok=True)
    for sub, cfg in zip(("target", "draft"), model_configs(a.vocab)):
        os.makedirs(os.path.join(a.models, sub), exist_ok=True)
        with open(os.path.join(a.models, sub, "config.json"), "w") as f:
            json.dump(cfg, f)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, a.vocab - 1) for _ in range(n)] for n in PROMPT_LENS]

    configs = build_matrix(
        a.backends.split(","),
        parse_budgets(a.budgets),
        a.graphs.split(","),
        a.pin,
    )
    if a.only:
        configs = [c for c in configs if re.search(a.only, c.name)]

    # FlashInfer JIT-compiles on its first start: start one flashinfer server first and
    # hold the other flashinfer servers until it is up (or failed).
    first_fi = next((c for c in configs if c.backend == "flashinfer"), None)
    fi_ready = threading.Event()
    slots = threading.Semaphore(a.parallel)
    order = ([first_fi] if first_fi else []) + [c for c in configs if c is not first_fi]

    def worker(cfg: Config, port: int) -> None:
        if cfg.backend == "flashinfer" and cfg is not first_fi:
            fi_ready.wait()
        with slots:
            print(f"start {cfg.name} on :{port}", flush=True)
            run_config(
                cfg,
                port,
                a.models,
                a.out,
                prompts,
                a.max_new_tokens,
                a.startup_timeout,
                a.vocab,
                COMMON_ARGS_BY_PIN[a.pin],
                a.mixed_timeout,
            )
            print(
                f"done  {cfg.name}: { {k: v for k, v in cfg.result.items() if k not in ('outputs', 'cmd', 'checks', 'concurrent_outputs', 'stop_outputs', 'mixed')} }",
                flush=True,
            )
        if cfg is first_fi:
            fi_ready.set()

    t_start = time.time()
    threads = []
    for i, cfg in enumerate(order):
        t = threading.Thread(target=worker, args=(cfg, a.port + i), daemon=True)
        t.start()
        threads.append(t)
        time.sleep(0.5)
    for t in threads:
        left = None if not a.deadline else max(0.0, a.deadline - (time.time() - t_start))
        t.join(left)
    unfinished = [c for c, t in zip(order, threads) if t.is_alive()]
    for c in unfinished:  # a record taken now, before the servers are stopped below
        c.result["error"] = f"unfinished at the deadline (in: {c.result.get('phase', 'startup')})"
    if unfinished:
        for proc in SERVERS:
            stop_server(proc)

    compare(configs)
    summary = {c.name: dict(c.result, passed=passed(c)) for c in configs}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    report = table(configs)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(report + "\n")
    print(report, flush=True)
    return 0 if configs and all(passed(c) for c in configs) else 1


if __name__ == "__main__":
    sys.exit(main())
