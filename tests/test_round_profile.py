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


def test_the_whole_run_against_stand_in_servers(tmp_path):
    """round_profile.py end to end as the device runs it: servers started as `python -m
    sglang.launch_server ...` (here a stand-in package on PYTHONPATH that serves
    tests/bench_fake_sglang.py on the given port, for the flags' speculative algorithm), waited
    for, profiled one after the other, stopped; a report per configuration and the summary."""
    import os

    shim = tmp_path / "shim" / "sglang"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "launch_server.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import bench_fake_sglang as f\n"
        "argv = sys.argv[1:]\n"
        "def flag(name, default=None):\n"
        "    return argv[argv.index(name) + 1] if name in argv else default\n"
        "budget = flag('--speculative-ddtree-budget')\n"
        "sys.argv = [sys.argv[0], '--port', flag('--port'), '--round-ms', '0.3']\n"
        "if flag('--speculative-algorithm'):\n"
        "    sys.argv += ['--algo', flag('--speculative-algorithm'), '--accept', '4']\n"
        "if budget and budget.isdigit():\n"
        "    sys.argv += ['--budget', budget]\n"
        "f.main()\n")
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "prompts.jsonl").write_text(json.dumps({"input_ids": [3, 4, 5]}) + "\n")
    port = _free_port_block(3)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "shim"))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "round_profile.py"), "--out", str(out), "--pair", str(pair),
                        "--budgets", "63", "--steps", "12", "--max-new-tokens", "16", "--port-base", str(port),
                        "--log-dir", str(tmp_path / "logs"), "--startup-timeout", "60", "--trace-timeout", "30"],
                       capture_output=True, text=True, timeout=240, env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "round_profile.json").read_text())
    assert list(summary) == ["plain", "DFLASH", "DDTREE b63"]
    for name, rep in summary.items():
        assert "error" not in rep, (name, rep)
        assert rep["steps"] == 12 and rep["gaps"] >= 12
        assert (out / name.replace(" ", "-") / "gaps.json").exists()
    assert "==== DDTREE b63" in r.stdout and "host frames in GPU-idle time" in r.stdout
    # each DDTREE configuration minus DFLASH, per step (the stand-ins write the same trace: 0)
    text = (out / "compare-DDTREE-b63-vs-DFLASH.txt").read_text()
    assert "DDTREE b63 minus DFLASH, ms per step:" in text and "= +0.0000" in text
    assert "==== DDTREE b63 vs DFLASH" in r.stdout


def _free_port_block(n: int) -> int:
    """A base port with n free ports after it (the run numbers its servers port-base + i)."""
    import socket

    for base in range(36100, 60000, 17):
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")
