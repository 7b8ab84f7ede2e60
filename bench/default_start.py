#!/usr/bin/env python3
"""Start each configuration the way a user would, with SGLang's default memory settings, one at a
time on the whole card, and load it at high concurrency (one GPU call; 0.5.16).

    python3 bench/default_start.py --out OUT --pair /tmp/lifted [--configs auto,plain,DFLASH,b15]

Every other device script caps the KV cache (``--max-total-tokens``) and sets
``--mem-fraction-static`` so that several servers share one card. A user does neither: SGLang
then sizes the KV cache from the card's memory *before* the CUDA graphs are captured, keeping a
reserve for them. This run answers what that means per configuration:

- does it start at all (a verify graph set larger than the reserve runs out of memory at capture);
- how many KV tokens it gets (``KV Cache is allocated ... #tokens``: the capacity the configuration
  costs a user) and the running-request cap SGLang derives;
- the memory each capture phase took, and what was free after start-up;
- whether it serves its largest batch: levels up to ``--concurrency`` (default 64 and 256, T = 0)
  with no request error.

Only the flags every device script shares are passed (``bench/pin_flags.py``'s base: token ids
in and out, the pytorch sampler, no grammar; triton attention, bf16, seed 0); decode and prefill
graphs, memory fraction and caps are SGLang's defaults. Writes OUT/results.json, OUT/table.md and
OUT/logs.tgz (the servers' logs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import acceptance_run as AR  # noqa: E402
import pin_flags as PF  # noqa: E402

B = AR.B

# A configuration word of --configs -> (label, server flags); the drafter path is filled in.
_DRAFT = "--speculative-draft-model-path {draft}"


def config_flags(word: str) -> tuple[str, str]:
    """``plain``, ``DFLASH``, ``DDTREE`` (no budget flag: the pin's default), ``b<budget>`` or
    ``auto`` -> (label, speculative flags). A suffix ``@N`` adds ``--max-running-requests N``
    (SGLang's DFLASH handling resets an unset cap to 48 for every DFlash-family server; ``auto@256``
    asks what lifting it costs in memory and gives at high load)."""
    base, at, running = word.partition("@")
    if at:
        if not running.isdigit() or int(running) < 1:
            raise ValueError(f"--configs: {word!r}: the running cap after @ must be a positive integer")
        label, flags = config_flags(base)
        return f"{label} (running {int(running)})", f"{flags} --max-running-requests {int(running)}".strip()
    if word == "DDTREE":
        return "DDTREE default", f"--speculative-algorithm DDTREE {_DRAFT}"
    # plain, DFLASH and a budget's DDTREE: the flags acceptance_run starts them with
    if word == "auto" or (word[:1] == "b" and word[1:].isdigit()):
        return AR.configs(["auto" if word == "auto" else int(word[1:])])[-1]
    if word in ("plain", "DFLASH"):
        return word, dict(AR.configs([]))[word]
    raise ValueError(f"--configs: {word!r} is none of plain, DFLASH, DDTREE, b<budget>, auto")


def default_common() -> str:
    """The shared flags without any memory or graph setting: SGLang's defaults for the rest."""
    return f"--skip-tokenizer-init {PF.BASE} --random-seed 0"


_KV = re.compile(r"KV Cache is allocated\. .*?#tokens: (\d+)")
_PHASE = re.compile(r"Capture (.+?) CUDA graph end\. elapsed=([\d.]+) s, mem usage=([\d.]+) GB, avail mem=([\d.]+) GB")
_WIDTH = re.compile(r"DDTREE auto: verify width (\d+) built \(([^)]*)\) in ([\d.]+)s, device memory ([\d.]+) GiB")
_AVAIL = re.compile(r"avail mem=([\d.]+) GB")
_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")


def read_log(text: str) -> dict:
    """What a server's start-up log says about memory: the target's KV tokens (the first KV
    allocation; DFLASH / DDTREE log the drafter's second), each capture phase's seconds and GB,
    each auto width's GiB, the last free memory logged, and whether it ran out of memory."""
    kv = _KV.findall(text)
    avail = _AVAIL.findall(text)
    return {
        "kv_tokens": int(kv[0]) if kv else None,
        "phases": [{"phase": p, "s": float(s), "gb": float(gb), "avail_gb": float(av)}
                   for p, s, gb, av in _PHASE.findall(text)],
        "widths": [{"width": int(w), "how": how, "s": float(s), "gib": float(g)}
                   for w, how, s, g in _WIDTH.findall(text)],
        "avail_gb_last": float(avail[-1]) if avail else None,
        "out_of_memory": bool(_OOM.search(text)),
    }


def server_caps(url: str) -> tuple[int | None, int | None]:
    """The running-request cap and KV token count the server settled on (/get_server_info: the
    scheduler's internal state, else the server args)."""
    info = B._request(url, "/get_server_info", None, 10.0)
    info = info if isinstance(info, dict) else {}
    state = next((st for st in info.get("internal_states") or [] if isinstance(st, dict)), {})

    def pick(key: str) -> int | None:
        value = state.get(key, info.get(key))
        return int(value) if isinstance(value, (int, float)) else None

    return pick("max_running_requests"), pick("max_total_num_tokens")


def table_md(rows: list[dict], concs: list[int]) -> str:
    head = ("| config | started | start-up s | KV tokens | max running | graphs GB (phases) | free GB after start |"
            + "".join(f" tok/s c={c} |" for c in concs) + " errors |")
    lines = [head, "|---|---|---|---|---|---|---|" + "---|" * len(concs) + "---|"]
    for r in rows:
        m = r.get("memory") or {}
        graphs = sum(p["gb"] for p in m.get("phases", [])) + sum(w["gib"] * 1.073741824 for w in m.get("widths", []))
        levels = {lv["concurrency"]: lv for lv in r.get("levels", [])}
        cells = "".join(f" {levels[c]['output_tokens_per_s']:.0f} |" if c in levels else " - |" for c in concs)
        errors = sum(len(lv.get("errors") or []) for lv in r.get("levels", []))
        lines.append(
            f"| {r['label']} | {'yes' if r.get('startup_s') is not None else 'NO: ' + str(r.get('error'))} | "
            f"{r.get('startup_s', '-')} | {m.get('kv_tokens', '-')} | {r.get('max_running_requests', '-')} | "
            f"{graphs:.1f} | {m.get('avail_gb_last', '-')} |{cells} {errors} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--pair", required=True, type=Path, help="target/, draft/, prompts.jsonl (e.g. the lifted pair)")
    ap.add_argument("--configs", default="auto,plain,DFLASH,b15", help="plain, DFLASH, DDTREE (no budget flag: the pin's default), b<budget>, auto, each with an optional @N (--max-running-requests N); in start order (a deadline drops the last)")
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--startup-timeout", type=float, default=330.0)
    ap.add_argument("--min-start-s", type=float, default=120.0,
                    help="skip a configuration when less than this is left of the run's deadline")
    ap.add_argument("--budget-s", type=float, default=560.0, help="whole-run deadline; configurations left are skipped")
    ap.add_argument("--port", type=int, default=31100)
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after a server stops, for the card's memory")
    ap.add_argument("--print-commands", action="store_true", help="print each server's command and exit")
    a = ap.parse_args(argv)
    t0 = time.time()
    concs = B.parse_concurrency(a.concurrency)
    labels = [config_flags(w.strip()) for w in a.configs.split(",") if w.strip()]
    logdir = a.out / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    servers = [AR.Server(label, extra, a.port, a.pair, logdir, "triton", default_common()) for label, extra in labels]
    if a.print_commands:
        for s in servers:
            print(" ".join(s.cmd))
        return 0
    prompts = B.load_prompts(a.pair / "prompts.jsonl")
    rows, ok = [], True
    for s in servers:
        row: dict = {"label": s.name, "cmd": " ".join(s.cmd), "levels": []}
        rows.append(row)
        if time.time() - t0 > a.budget_s - a.min_start_s:
            row["error"] = "skipped: run deadline"
            ok = False
            continue
        s.start()
        try:
            AR.wait_ready([s], min(time.time() + a.startup_timeout, t0 + a.budget_s))
            row["startup_s"], row["error"] = s.startup_s, s.error
            if s.error is None:
                row["max_running_requests"], row["max_total_num_tokens"] = server_caps(s.url)
                samp = B.Sampling(max_new_tokens=a.max_new_tokens, temperature=0.0)
                for c in concs:
                    if time.time() - t0 > a.budget_s:
                        break
                    lv = B.run_level(s.url, prompts, c, 2 * c, samp)
                    row["levels"].append(dataclasses.asdict(lv))
                    AR.log(f"{s.name} c={c}: {row['levels'][-1].get('output_tokens_per_s')} tok/s, "
                           f"errors {len(row['levels'][-1].get('errors') or [])}")
        finally:
            s.stop()
            row["memory"] = read_log(s.logpath.read_text(errors="replace")) if s.logpath.exists() else {}
            time.sleep(a.settle_s)
        ok = ok and row["error"] is None and len(row["levels"]) == len(concs) and not any(
            lv.get("errors") for lv in row["levels"])
    doc = {"ok": ok, "configs": rows, "concurrency": concs, "seconds": round(time.time() - t0, 1)}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    (a.out / "table.md").write_text(table_md(rows, concs))
    with tarfile.open(a.out / "logs.tgz", "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    print(table_md(rows, concs))
    AR.log(f"done in {doc['seconds']} s, ok={ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
