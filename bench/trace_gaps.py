#!/usr/bin/env python3
"""Where a serving round's time goes: GPU busy time, the gaps in which the GPU waited, and what the
host was doing in them, from a PyTorch profiler (Kineto) Chrome trace.

A round costs its GPU work plus the time the GPU sits idle between kernels. Idle time on the
GPU with the host still busy is per-round overhead that a faster host path (fewer launches, a
captured graph, no sync) removes; idle time with the host blocked in a synchronize is a sync.
This tool finds every gap between the GPU's kernels / copies (all streams merged), the launch that
ended it (by CUPTI correlation id), and the host Python frames on the launching thread during the
gap, and sums them per frame:

- ``leaf``: per innermost frame (where the host's time in gaps went, each microsecond once);
- ``inclusive``: per frame anywhere on the stack (what a whole step, e.g. the scheduler's result
  processing or the worker's accept, cost the GPU in idle time).

It also sums GPU time per kernel name (what the GPU itself spent the round on). Traces need
``with_stack`` for Python frames (SGLang: ``/start_profile`` with ``"with_stack": true``);
without them the gaps are still found and attributed to the CUDA API call that ended them.

    python3 bench/trace_gaps.py TRACE.json[.gz] [--steps N] [--top 25] [--json]

Pure Python, no torch: it runs where the trace is read (the GPU machine, or here on a copy).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
FRAME_CAT = "python_function"


def load(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]


def _interval(e: dict) -> tuple[float, float]:
    t = float(e["ts"])
    return t, t + float(e.get("dur", 0.0))


def gpu_gaps(gpu: list[dict], min_gap_us: float) -> tuple[list[tuple[float, float, dict]], float, float, float]:
    """Merge the GPU events' intervals (every stream together). Returns (gaps as (start, end,
    the event that ended the gap), busy us, first start, last end); gaps shorter than
    ``min_gap_us`` (a kernel's launch latency) are not gaps."""
    ev = sorted(gpu, key=lambda e: float(e["ts"]))
    gaps: list[tuple[float, float, dict]] = []
    busy = 0.0
    start, end = _interval(ev[0])
    first = start
    for e in ev[1:]:
        s, t = _interval(e)
        if s > end:
            busy += end - start
            if s - end >= min_gap_us:
                gaps.append((end, s, e))
            start, end = s, t
        else:
            end = max(end, t)
    busy += end - start
    return gaps, busy, first, end


class FrameTimeline:
    """The Python frames of one host thread as a sequence of non-overlapping segments, each with
    its innermost frame (a parent pointer gives the stack). Built once by a sweep (frames of one
    thread nest; a frame that overruns its parent is clipped to it); a query of [a, b] then costs
    a binary search plus the segments inside, so a trace of a million frames and thousands of
    gaps stays fast (a whole-trace outer frame, like the scheduler's event loop, is one segment
    boundary, not a scan)."""

    NONE = "(no Python frame)"

    def __init__(self, frames: list[dict]):
        frames = sorted(frames, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        self.names = [e["name"] for e in frames]
        self.parent = [-1] * len(frames)
        ends = [0.0] * len(frames)
        self.seg_start: list[float] = []
        self.seg_end: list[float] = []
        self.seg_frame: list[int] = []
        stack: list[int] = []
        cur = float(frames[0]["ts"]) if frames else 0.0

        def emit(upto: float) -> None:
            nonlocal cur
            if upto > cur:
                self.seg_start.append(cur)
                self.seg_end.append(upto)
                self.seg_frame.append(stack[-1] if stack else -1)
                cur = upto

        for i, e in enumerate(frames):
            s, t = _interval(e)
            while stack and ends[stack[-1]] <= s:
                emit(ends[stack[-1]])
                stack.pop()
            emit(s)
            if stack:
                self.parent[i] = stack[-1]
                t = min(t, ends[stack[-1]])
            ends[i] = t
            stack.append(i)
        while stack:
            emit(ends[stack[-1]])
            stack.pop()

    def split(self, a: float, b: float) -> tuple[dict[str, float], dict[str, float]]:
        """Time of [a, b] per innermost frame (leaf) and per frame name on the stack (inclusive;
        a name on the stack twice, a recursion, counts once)."""
        leaf: dict[str, float] = defaultdict(float)
        incl: dict[str, float] = defaultdict(float)
        covered = 0.0
        i = max(0, bisect.bisect_right(self.seg_start, a) - 1)
        while i < len(self.seg_start) and self.seg_start[i] < b:
            d = min(b, self.seg_end[i]) - max(a, self.seg_start[i])
            if d > 0:
                covered += d
                j = self.seg_frame[i]
                leaf[self.names[j] if j >= 0 else self.NONE] += d
                seen = set()
                while j >= 0:
                    if self.names[j] not in seen:
                        seen.add(self.names[j])
                        incl[self.names[j]] += d
                    j = self.parent[j]
            i += 1
        if b - a - covered > 1e-9:  # before the first frame or after the last
            leaf[self.NONE] += b - a - covered
        return dict(leaf), dict(incl)


def analyse(events: list[dict], min_gap_us: float = 5.0, steps: int | None = None, top: int = 25) -> dict:
    """The report (times in ms; per step too when ``steps`` is given)."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError("no GPU kernel, memcpy or memset events in the trace (a CPU-only profile?)")
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    frames_by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == FRAME_CAT:
            frames_by_thread[(e.get("pid"), e.get("tid"))].append(e)
    timelines = {k: FrameTimeline(v) for k, v in frames_by_thread.items()}

    gaps, busy, first, last = gpu_gaps(gpu, min_gap_us)
    leaf: dict[str, float] = defaultdict(float)
    incl: dict[str, float] = defaultdict(float)
    by_api: dict[str, float] = defaultdict(float)
    kinds = {"host launched late": 0.0, "launched before the gap (a wait on another stream or event)": 0.0,
             "no launch found": 0.0}
    sizes = {"5-20 us": 0, "20-100 us": 0, "0.1-1 ms": 0, ">1 ms": 0}
    for a, b, ender in gaps:
        d = b - a
        sizes["5-20 us" if d < 20 else "20-100 us" if d < 100 else "0.1-1 ms" if d < 1000 else ">1 ms"] += 1
        launch = launches.get(ender.get("args", {}).get("correlation"))
        if launch is None:
            kinds["no launch found"] += d
            continue
        by_api[launch["name"]] += d
        lt = float(launch["ts"])
        if lt <= a:
            kinds["launched before the gap (a wait on another stream or event)"] += d
            continue
        kinds["host launched late"] += d
        tl = timelines.get((launch.get("pid"), launch.get("tid")))
        if tl is None:
            leaf["(no Python frames: trace without with_stack)"] += d
            continue
        # the host's time from the GPU going idle to the launch that ended it
        lf, inc = tl.split(a, min(b, lt))
        for k, v in lf.items():
            leaf[k] += v
        for k, v in inc.items():
            incl[k] += v

    kernels: dict[str, float] = defaultdict(float)
    for e in gpu:
        kernels[e["name"]] += float(e.get("dur", 0.0))

    def table(d: dict[str, float]) -> list[list]:
        rows = sorted(d.items(), key=lambda kv: -kv[1])[:top]
        out = []
        for k, v in rows:
            row = [k, round(v / 1e3, 4)]
            if steps:
                row.append(round(v / 1e3 / steps, 4))
            out.append(row)
        return out

    window = last - first
    idle = window - busy
    rep = {
        "window_ms": round(window / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_idle_ms": round(idle / 1e3, 3),
        "gpu_idle_share": round(idle / window, 4) if window > 0 else 0.0,
        "gaps": len(gaps),
        "gap_sizes": sizes,
        "idle_by_cause_ms": {k: round(v / 1e3, 3) for k, v in kinds.items()},
        "idle_by_launch_api_ms": table(by_api),
        "idle_host_leaf_ms": table(leaf),
        "idle_host_inclusive_ms": table(incl),
        "gpu_time_by_kernel_ms": table(kernels),
        "steps": steps,
    }
    rep["rounds"] = rounds(events)
    if steps:
        rep["per_step_ms"] = {"window": round(window / 1e3 / steps, 4), "gpu_busy": round(busy / 1e3 / steps, 4),
                              "gpu_idle": round(idle / 1e3 / steps, 4)}
    return rep


ROUND_FRAME = "forward_batch_generation"
PREFILL_MARKERS = ("_execute_extend", "_make_next_draft_input_prefill", "forward_extend")


def rounds(events: list[dict], round_frame: str = ROUND_FRAME, prefill_markers=PREFILL_MARKERS) -> dict:
    """The trace's scheduler rounds, decode and prefill apart. A round is an outermost host frame
    whose name contains ``round_frame`` (the spec worker's, or the target worker's for plain
    decode); it is a prefill when a frame inside it names one of ``prefill_markers`` (an eager
    extend, the drafter's prefill input). Its GPU work is every kernel / copy launched from the
    frame's thread during it (CUPTI correlation), wherever it ran. Per kind: the count and the
    means of host ms, GPU span (first start to last end of its work), GPU busy (the union), and
    the start-to-start time to the next round's GPU work (the round's share of the window; None
    for the last round). A window of 30 steps at concurrency 1 can hold 0 or 2 prefills of 40 ms
    each, so per-step means mix them in; these do not."""
    frames = sorted((e for e in events if e.get("cat") == FRAME_CAT), key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    outer: list[dict] = []
    for e in frames:
        if round_frame in e["name"] and not (outer and outer[-1]["tid"] == e.get("tid")
                                            and _interval(e)[0] < _interval(outer[-1])[1]):
            outer.append(e)
    if not outer:
        return {}
    gpu_by_corr: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS and "correlation" in e.get("args", {}):
            gpu_by_corr[e["args"]["correlation"]].append(e)
    launches = sorted((e for e in events if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})),
                      key=lambda e: float(e["ts"]))
    launch_ts = [float(e["ts"]) for e in launches]
    frame_ts = [float(e["ts"]) for e in frames]
    rows = []
    for r in outer:
        a, b = _interval(r)
        inside = [f for f in frames[bisect.bisect_left(frame_ts, a):bisect.bisect_left(frame_ts, b)]
                  if f.get("tid") == r.get("tid")]
        kind = "prefill" if any(m in f["name"] for f in inside for m in prefill_markers) else "decode"
        work = [g for lo in launches[bisect.bisect_left(launch_ts, a):bisect.bisect_right(launch_ts, b)]
                if lo.get("tid") == r.get("tid") for g in gpu_by_corr.get(lo["args"]["correlation"], ())]
        if not work:
            continue
        _, busy, first, last = gpu_gaps(work, float("inf"))
        rows.append({"kind": kind, "host": (b - a) / 1e3, "span": (last - first) / 1e3, "busy": busy / 1e3,
                     "first": first})
    for this, nxt in itertools.pairwise(rows):
        this["next"] = (nxt["first"] - this["first"]) / 1e3
    out = {}
    for kind in ("decode", "prefill"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        nexts = [r["next"] for r in rs if "next" in r]
        out[kind] = {"rounds": len(rs),
                     **{f"{k}_ms": round(sum(r[k] for r in rs) / len(rs), 4) for k in ("host", "span", "busy")},
                     "start_to_start_ms": round(sum(nexts) / len(nexts), 4) if nexts else None}
    return out


def compare(a: dict, b: dict, top: int = 20) -> dict:
    """Per-step differences of two reports with ``steps`` (a minus b, ms per step): the window,
    GPU busy and idle time, and the kernels and inclusive host frames whose per-step time differs
    most. Names outside a report's tables count 0 there (analyse with a large ``top`` first)."""
    if not (a.get("per_step_ms") and b.get("per_step_ms")):
        raise ValueError("compare needs two reports made with steps")
    head = {k: round(a["per_step_ms"][k] - b["per_step_ms"][k], 4) for k in ("window", "gpu_busy", "gpu_idle")}

    def diff(key: str) -> list[list]:
        ta = {row[0]: row[2] for row in a[key]}
        tb = {row[0]: row[2] for row in b[key]}
        rows = [[k, round(ta.get(k, 0.0) - tb.get(k, 0.0), 4), ta.get(k, 0.0), tb.get(k, 0.0)] for k in {*ta, *tb}]
        rows.sort(key=lambda r: (-abs(r[1]), r[0]))
        return rows[:top]

    da, db = (a.get("rounds") or {}).get("decode"), (b.get("rounds") or {}).get("decode")
    decode = None
    if da and db:
        decode = {k: [da[k], db[k], None if da[k] is None or db[k] is None else round(da[k] - db[k], 4)]
                  for k in ("start_to_start_ms", "busy_ms", "span_ms", "host_ms")}
    return {"per_step_ms_diff": head, "per_step_a": a["per_step_ms"], "per_step_b": b["per_step_ms"],
            "decode_round": decode,
            "gpu_time_by_kernel": diff("gpu_time_by_kernel_ms"),
            "idle_host_inclusive": diff("idle_host_inclusive_ms")}


def render_compare(cmp: dict, name_a: str, name_b: str) -> str:
    a, b, d = cmp["per_step_a"], cmp["per_step_b"], cmp["per_step_ms_diff"]
    lines = [f"{name_a} minus {name_b}, ms per step:",
             f"   window {a['window']} - {b['window']} = {d['window']:+.4f}",
             f"   GPU busy {a['gpu_busy']} - {b['gpu_busy']} = {d['gpu_busy']:+.4f}",
             f"   GPU idle {a['gpu_idle']} - {b['gpu_idle']} = {d['gpu_idle']:+.4f}"]
    if cmp.get("decode_round"):
        lines.append(f"decode rounds only ({name_a} | {name_b} | difference), ms; prefill steps left out:")
        lines.extend(f"   {k[:-3]} {va} | {vb} | {'-' if d is None else f'{d:+.4f}'}"
                     for k, (va, vb, d) in cmp["decode_round"].items())
    for key, title in (("gpu_time_by_kernel", "GPU time by kernel"), ("idle_host_inclusive", "host frames in GPU-idle time")):
        lines.append(f"-- {title} (difference | {name_a} | {name_b}), ms per step")
        lines.extend(f"   {r[1]:+.4f} | {r[2]} | {r[3]}  {r[0][:140]}" for r in cmp[key])
    return "\n".join(lines)


def render(rep: dict, top: int = 25) -> str:
    per = rep.get("per_step_ms")
    head = (f"window {rep['window_ms']} ms: GPU busy {rep['gpu_busy_ms']} ms, idle {rep['gpu_idle_ms']} ms "
            f"({100 * rep['gpu_idle_share']:.1f} %) in {rep['gaps']} gaps {rep['gap_sizes']}")
    lines = [head]
    if per:
        lines.append(f"per step ({rep['steps']}): window {per['window']} ms, busy {per['gpu_busy']}, idle {per['gpu_idle']}")
    lines.append(f"idle by cause (ms): {rep['idle_by_cause_ms']}")
    for kind, r in (rep.get("rounds") or {}).items():
        lines.append(f"{kind} rounds: {r}")
    for key, title in (("idle_host_leaf_ms", "host frames in GPU-idle time (innermost)"),
                       ("idle_host_inclusive_ms", "host frames in GPU-idle time (inclusive)"),
                       ("idle_by_launch_api_ms", "the launch that ended a gap"),
                       ("gpu_time_by_kernel_ms", "GPU time by kernel")):
        lines.append(f"-- {title}: ms{' | ms per step' if per else ''}")
        lines.extend("   " + " | ".join(str(x) for x in row[1:]) + f"  {row[0][:140]}" for row in rep[key][:top])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a trace, or with --compare the first report (gaps.json)")
    ap.add_argument("--compare", type=Path, default=None, metavar="GAPS_JSON",
                    help="print TRACE's report (a gaps.json) minus this one's, per step")
    ap.add_argument("--steps", type=int, default=None, help="decode steps in the trace: adds per-step figures")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    a = ap.parse_args(argv)
    if a.compare is not None:
        try:
            ra, rb = (json.loads(Path(x).read_text()) for x in (a.trace, a.compare))
            print(render_compare(compare(ra, rb, a.top), a.trace.parent.name, a.compare.parent.name))
        except (OSError, ValueError, KeyError) as exc:
            print(f"trace_gaps: --compare: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        rep = analyse(load(a.trace), a.min_gap_us, a.steps, a.top)
    except (OSError, ValueError, KeyError) as exc:
        print(f"trace_gaps: {a.trace}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=1) if a.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
