"""bench/round_profile.py's profiling of one server: warm-up, /start_profile with Python stacks
while requests run back to back at c = 1, the trace picked up once written, analysed
(bench/trace_gaps.py) and reported. The server is tests/bench_fake_sglang.py's stand-in for SGLang
(no GPU here): it writes a Kineto-shaped trace after the profiled steps, whose per-step GPU
busy time, idle time and the host frame in it are set by its TRACE_* constants."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fake_sglang import FakeSGLang


def _module():
    spec = importlib.util.spec_from_file_location("round_profile", ROOT / "bench" / "round_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_one_reports_where_the_fake_round_time_goes(tmp_path):
    rp = _module()
    fake = FakeSGLang("DDTREE", 5, 0.5, budget=63)
    url = f"http://127.0.0.1:{fake.serve(0)}"
    try:
        server = SimpleNamespace(name="DDTREE b63", url=url)
        prompts = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
        rep = rp.profile_one(server, prompts, tmp_path, steps=20, max_new=16, temperature=0.0, timeout_s=30)
    finally:
        fake.stop()
    F = FakeSGLang
    assert "error" not in rep, rep
    folder = tmp_path / "DDTREE-b63"
    assert json.loads((folder / "gaps.json").read_text()) == rep
    assert "host frames in GPU-idle time" in (folder / "gaps.txt").read_text()
    per = rep["per_step_ms"]
    busy = (F.TRACE_BUSY_US + F.TRACE_SHORT_US) / 1e3
    assert per["gpu_busy"] == pytest.approx(busy, abs=1e-3)
    # the window ends at the last step's short kernel: one tail less than steps x a step
    window = (20 * F.TRACE_STEP_US - F.TRACE_TAIL_US) / 1e3
    assert rep["window_ms"] == pytest.approx(window, abs=1e-3)
    leaf = {k: v for k, v, _ in rep["idle_host_leaf_ms"]}
    assert leaf["worker.py(20): accept"] == pytest.approx(20 * F.TRACE_ACCEPT_US / 1e3, abs=1e-3)
    assert max(leaf, key=leaf.get) == "worker.py(20): accept"
    assert rep["idle_by_cause_ms"]["host launched late"] == pytest.approx(rep["gpu_idle_ms"], abs=1e-3)
    assert rep["requests_during_profile"] >= 1 and fake.profiles_written == 1


def test_bad_arguments_are_refused_before_anything_starts(tmp_path):
    out = tmp_path / "out"
    for args, msg in ((["--steps", "0"], "--steps: 0: give 1 or more"),
                      (["--without", "plain"], "--without: ['plain']")):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "round_profile.py"), "--out", str(out), "--pair",
                            str(tmp_path / "pair"), "--log-dir", str(tmp_path / "logs"), *args],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 1 and msg in r.stderr, r.stderr[-2000:]
        assert not out.exists() and not (tmp_path / "logs").exists()
