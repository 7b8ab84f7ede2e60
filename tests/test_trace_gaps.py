"""bench/trace_gaps.py: GPU idle gaps of a profiler trace and the host frames in them.

The GPU side of the traces here is written by the test (this machine has no GPU, so no CUPTI
kernel events): kernels and their launches (CUPTI correlation ids) placed at chosen times. The host
side is real where it can be: a torch.profiler trace of Python code with ``with_stack`` (what
SGLang's /start_profile records), plus a randomised nest of frames checked against a brute-force
per-microsecond oracle.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trace_gaps", ROOT / "bench" / "trace_gaps.py")
tg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tg)


def _kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": 7}}


def _launch(ts, corr, pid, tid, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": 2.0,
            "args": {"correlation": corr}}


def _random_frames(rng, lo, hi, depth, pid, tid, out, prefix="f"):
    """A random nest of frames in [lo, hi] (integers, like a profiler's microseconds)."""
    t = lo
    while t < hi and depth > 0:
        s = rng.randint(t, hi)
        e = rng.randint(s, hi)
        if e - s < 2:
            break
        name = f"{prefix}{depth}.{rng.randint(0, 3)}"
        out.append({"ph": "X", "cat": "python_function", "name": name, "pid": pid, "tid": tid, "ts": float(s),
                    "dur": float(e - s)})
        _random_frames(rng, s, e, depth - 1, pid, tid, out, prefix)
        t = e + 1
    return out


def _oracle(frames, a, b):
    """Per-microsecond: the innermost frame (latest start, then the shortest) and every frame on
    the stack, over [a, b) at integer + 0.5 sample points."""
    leaf, incl = defaultdict(float), defaultdict(float)
    for t in range(int(a), int(b)):
        m = t + 0.5
        live = [f for f in frames if f["ts"] <= m < f["ts"] + f["dur"]]
        if not live:
            leaf["(no Python frame)"] += 1
            continue
        inner = max(live, key=lambda f: (f["ts"], -f["dur"]))
        leaf[inner["name"]] += 1
        for f in live:
            incl[f["name"]] += 1
    return leaf, incl


@pytest.mark.parametrize("seed", range(12))
def test_gap_attribution_equals_a_per_microsecond_oracle(seed):
    """Random nested host frames (every other seed inside one outer frame that spans the trace,
    like the scheduler's event loop); kernels with gaps between them, some launched late by the
    host (attributed to the frames between the GPU going idle and the launch), some launched
    before the gap (a wait elsewhere: not the host's), tiny gaps under the threshold. Leaf and
    inclusive times equal the oracle's, in ms."""
    rng = random.Random(seed)
    pid, tid = 11, 12
    frames = _random_frames(rng, 0, 4000, 5, pid, tid, [])
    if seed % 2:
        frames.append({"ph": "X", "cat": "python_function", "name": "loop", "pid": pid, "tid": tid, "ts": -10.0,
                       "dur": 4500.0})
    events = list(frames)
    t, corr = 0.0, 0
    late, early = [], []
    while t < 3900:
        corr += 1
        dur = float(rng.randint(10, 200))
        gap = float(rng.choice([0, 3, rng.randint(6, 300)])) if corr > 1 else 0.0  # the window opens at a kernel
        start = t + gap
        if gap >= 5 and rng.random() < 0.7:  # the host launched it inside the gap
            lt = float(rng.randint(int(t) + 1, int(start)))
            late.append((t, start, lt))
        else:
            lt = t - 1.0
            if gap >= 5:
                early.append(gap)
        events.append(_launch(lt, corr, pid, tid))
        events.append(_kernel(f"k{corr % 5}", start, dur, corr))
        t = start + dur
    rep = tg.analyse(events, min_gap_us=5.0, top=1000)
    want_leaf, want_incl = defaultdict(float), defaultdict(float)
    for a, b, lt in late:
        lf, inc = _oracle(frames, a, min(b, lt))
        for k, v in lf.items():
            want_leaf[k] += v
        for k, v in inc.items():
            want_incl[k] += v
    got_leaf = {k: v for k, v in rep["idle_host_leaf_ms"]}
    got_incl = {k: v for k, v in rep["idle_host_inclusive_ms"]}
    assert got_leaf.keys() == {k for k, v in want_leaf.items() if v > 0}
    for k, v in want_leaf.items():
        assert got_leaf[k] == pytest.approx(v / 1e3, abs=1e-4)
    for k, v in want_incl.items():
        assert got_incl[k] == pytest.approx(v / 1e3, abs=1e-4)
    causes = rep["idle_by_cause_ms"]
    assert causes["host launched late"] == pytest.approx(sum(b - a for a, b, _ in late) / 1e3, abs=1e-3)
    assert causes["launched before the gap (a wait on another stream or event)"] == pytest.approx(sum(early) / 1e3, abs=1e-3)
    assert rep["gpu_idle_ms"] == pytest.approx(rep["window_ms"] - rep["gpu_busy_ms"], abs=1e-3)


def test_a_real_host_trace_points_at_the_slow_function(tmp_path):
    """A torch.profiler trace (with_stack, CPU) of three steps whose slow part sleeps 2 ms, with
    a kernel before the slow part and the next one launched right after it: the GPU's idle time
    is the slow part's, the inclusive table names it, the leaf table names the sleep, and the
    per-step figures divide by the steps. The file is read gzipped, as SGLang writes it."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    def slow_part():
        time.sleep(0.002)

    def step():
        x = torch.ones(64, 64)
        y = x @ x
        slow_part()
        return y

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for _ in range(3):
            step()
    raw = tmp_path / "host.json"
    prof.export_chrome_trace(str(raw))
    doc = json.loads(raw.read_text())
    frames = [e for e in doc["traceEvents"] if e.get("cat") == "python_function"]
    slow = sorted((e for e in frames if e["name"].endswith(": slow_part")), key=lambda e: e["ts"])
    steps = sorted((e for e in frames if e["name"].endswith(": step")), key=lambda e: e["ts"])
    assert len(slow) == 3 and len(steps) == 3
    pid, tid = slow[0]["pid"], slow[0]["tid"]
    corr = 0
    for st, sp in zip(steps, slow):
        corr += 1  # kernel from the step's start to the slow part's start
        doc["traceEvents"] += [_launch(st["ts"], corr, pid, tid), _kernel("gemm", st["ts"] + 1, sp["ts"] - st["ts"] - 1, corr)]
        corr += 1  # launched right after the slow part: the GPU waited for all of it
        end = sp["ts"] + sp["dur"]
        doc["traceEvents"] += [_launch(end + 1, corr, pid, tid), _kernel("next", end + 5, 10.0, corr)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    rep = tg.analyse(tg.load(path), steps=3, top=10_000)  # under pytest the stack is deep: keep every frame
    incl = {k: v for k, v, _ in rep["idle_host_inclusive_ms"]}
    leaf = {k: v for k, v, _ in rep["idle_host_leaf_ms"]}
    slow_name = slow[0]["name"]
    want = sum(sp["dur"] + 1 for sp in slow) / 1e3  # slow part + the 1 us to the launch
    assert incl[slow_name] == pytest.approx(want, rel=0.01)
    assert max(leaf, key=leaf.get) == "<built-in function sleep>"
    assert leaf["<built-in function sleep>"] > 0.9 * sum(sp["dur"] for sp in slow) / 1e3
    assert rep["per_step_ms"]["gpu_idle"] == pytest.approx(rep["gpu_idle_ms"] / 3, abs=1e-3)
    assert rep["gpu_idle_ms"] > 3 * 2.0 * 0.95  # three 2-ms sleeps at least
    assert tg.main([str(path), "--steps", "3"]) == 0


def test_a_trace_without_gpu_events_is_a_clear_error(tmp_path, capsys):
    p = tmp_path / "cpu.json"
    p.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]}))
    assert tg.main([str(p)]) == 2
    assert "no GPU kernel, memcpy or memset events" in capsys.readouterr().err
    assert tg.main([str(tmp_path / "missing.json")]) == 2


def _steps_trace(steps, kernels, accept_us, step_us=2000.0):
    """Per step: the kernels back to back ((name, us) in order), then the host in an "accept"
    frame for accept_us while the GPU waits, then the next step's first kernel."""
    pid, tid = 5, 6
    ev = [{"ph": "X", "cat": "python_function", "name": "loop", "pid": pid, "tid": tid, "ts": -5.0,
           "dur": steps * step_us + 10.0}]
    corr = 0
    for i in range(steps):
        t = i * step_us
        for name, us in kernels:
            corr += 1
            ev += [_launch(t - 1.0, corr, pid, tid), _kernel(name, t, us, corr)]
            t += us
        ev.append({"ph": "X", "cat": "python_function", "name": "accept", "pid": pid, "tid": tid, "ts": t,
                   "dur": accept_us})
        # the next step's kernels start at (i + 1) * step_us: the GPU idles from t, the host in accept
    return ev


def test_compare_gives_per_step_differences_of_kernels_and_idle_frames(tmp_path, capsys):
    """Two configurations' reports (steps given): a's extra tree kernel and longer verify, and its
    longer accept while the GPU waits, come out as the per-step differences the traces were built
    with; the CLI prints the same from two gaps.json files."""
    steps = 6
    a = tg.analyse(_steps_trace(steps, [("draft", 300.0), ("tree", 80.0), ("verify", 900.0)], 400.0), steps=steps,
                   top=100)
    b = tg.analyse(_steps_trace(steps, [("draft", 300.0), ("verify", 850.0)], 150.0), steps=steps, top=100)
    cmp = tg.compare(a, b)
    kern = {r[0]: r[1] for r in cmp["gpu_time_by_kernel"]}
    assert kern["tree"] == pytest.approx(0.080, abs=1e-4)
    assert kern["verify"] == pytest.approx(0.050, abs=1e-4)
    assert kern.get("draft", 0.0) == pytest.approx(0.0, abs=1e-4)
    idle = {r[0]: r[1] for r in cmp["idle_host_inclusive"]}
    # steps - 1 gaps in the window (the last step's wait is after its last kernel), 250 us more each
    assert idle["accept"] == pytest.approx(0.250 * (steps - 1) / steps, abs=1e-4)
    assert cmp["per_step_ms_diff"]["gpu_busy"] == pytest.approx(0.130, abs=1e-3)
    assert cmp["gpu_time_by_kernel"][0][0] == "tree"  # the largest difference first
    for name, rep in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "gaps.json").write_text(json.dumps(rep))
    assert tg.main([str(tmp_path / "a" / "gaps.json"), "--compare", str(tmp_path / "b" / "gaps.json")]) == 0
    out = capsys.readouterr().out
    assert "a minus b, ms per step:" in out and "+0.0800" in out
    with pytest.raises(ValueError, match="two reports made with steps"):
        tg.compare(tg.analyse(_steps_trace(2, [("k", 10.0)], 50.0)), b)


def _rounds_trace(kinds, pid=5, tid=6):
    """Rounds back to back on one thread: a decode round is an outer worker frame with two
    kernels of 3000 + 1000 us (a 500 us gap between them) launched from inside it; a prefill round
    also holds an eager-extend frame and launches one 200 us kernel. A nested frame with the same
    name (the target worker inside the spec worker) must not count as a round of its own."""
    ev, t, corr = [], 0.0, 0
    for kind in kinds:
        host = 6000.0 if kind == "decode" else 40000.0
        name = "sglang/srt/speculative/dflash_worker_v2.py(1399): forward_batch_generation"
        ev.append({"ph": "X", "cat": "python_function", "name": name, "pid": pid, "tid": tid, "ts": t, "dur": host})
        ev.append({"ph": "X", "cat": "python_function", "name": "tp_worker.py(529): forward_batch_generation",
                   "pid": pid, "tid": tid, "ts": t + 10.0, "dur": host - 20.0})
        if kind == "prefill":
            ev.append({"ph": "X", "cat": "python_function", "name": "eager_runner.py(252): _execute_extend",
                       "pid": pid, "tid": tid, "ts": t + 20.0, "dur": host - 40.0})
        work = [(100.0, 3000.0), (3600.0, 1000.0)] if kind == "decode" else [(30000.0, 200.0)]
        for off, dur in work:
            corr += 1
            ev += [_launch(t + 50.0 + corr, corr, pid, tid, name="cuLaunchKernelEx"), _kernel("k", t + off, dur, corr)]
        t += host + 1000.0
    # a launch from another thread inside a round is not the round's work
    corr += 1
    ev += [_launch(100.0, corr, pid, tid + 1), _kernel("other", 3200.0, 300.0, corr)]
    return ev


def test_rounds_separate_decode_from_prefill_and_compare_uses_decode_only(tmp_path):
    ev = _rounds_trace(["decode", "decode", "prefill", "decode"])
    r = tg.rounds(ev)
    assert r["decode"]["rounds"] == 3 and r["prefill"]["rounds"] == 1
    assert r["decode"]["busy_ms"] == pytest.approx(4.0) and r["decode"]["span_ms"] == pytest.approx(4.5)
    assert r["decode"]["host_ms"] == pytest.approx(6.0)
    assert r["prefill"]["busy_ms"] == pytest.approx(0.2) and r["prefill"]["host_ms"] == pytest.approx(40.0)
    # start to start: decode rounds 0 and 1 are followed 7 ms later; round 1 -> the prefill's kernel at +30 ms
    want_next = ((7000.0) + (7000.0 + 29900.0)) / 2 / 1e3
    assert r["decode"]["start_to_start_ms"] == pytest.approx(want_next)
    assert tg.rounds([e for e in ev if e["cat"] != "python_function"]) == {}
    # compare: a trace with an extra prefill in its window still compares decode rounds alike
    a = tg.analyse(_rounds_trace(["decode", "prefill", "decode", "decode"]), steps=4, top=50)
    b = tg.analyse(_rounds_trace(["decode"] * 4), steps=4, top=50)
    cmp = tg.compare(a, b)
    assert cmp["decode_round"]["busy_ms"][2] == pytest.approx(0.0)
    assert cmp["per_step_ms_diff"]["window"] > 5  # the per-step view is skewed by the prefill
    assert "decode rounds only" in tg.render_compare(cmp, "a", "b")
