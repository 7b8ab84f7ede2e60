"""`ddtree-deploy bench` against local HTTP servers that speak SGLang's /generate and
/get_server_info JSON.

The servers are TEST DOUBLES (tests/bench_fake_sglang.py): a real SGLang server needs a GPU,
which CI does not have. The real thing is measured on the GPU by bench/acceptance_run.py, which
uses the same deploy/bench.py code. Expected numbers are derived here from the doubles'
parameters (tokens per request, tokens per verify round), never pasted from a run.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.deploy.remote import bench as B

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fake_sglang import FakeSGLang  # noqa: E402

CLI = Path(sys.executable).parent / "ddtree-deploy"
N_NEW = 10


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def fakes():
    servers = {"plain": FakeSGLang(None, 0, 0.5), "dflash": FakeSGLang("DFLASH", 3, 2.0),
               "ddtree": FakeSGLang("DDTREE", 5, 3.0, budget=63)}
    urls = {k: f"http://127.0.0.1:{s.serve(0)}" for k, s in servers.items()}
    yield servers, urls
    for s in servers.values():
        s.stop()


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join([json.dumps({"input_ids": [5, 6, 7]}), "", json.dumps({"text": "def f(x):"}),
                            json.dumps({"input_ids": list(range(3, 40))})]) + "\n")
    return p


def test_report_accounting_and_schema(fakes, prompts):
    servers, urls = fakes
    r = run("bench", urls["plain"], urls["dflash"], urls["ddtree"], "--label", "plain", "--label", "DFLASH",
            "--label", "DDTREE b63", "--prompts", str(prompts), "--concurrency", "1,4", "--requests", "8",
            "--max-new-tokens", str(N_NEW), "--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["schema"] == B.SCHEMA_VERSION
    assert doc["sampling"] == {"max_new_tokens": N_NEW, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "ignore_eos": True}
    assert [s["label"] for s in doc["servers"]] == ["plain", "DFLASH", "DDTREE b63"]
    for s, fake in zip(doc["servers"], servers.values()):
        assert [lv["concurrency"] for lv in s["levels"]] == [1, 4]
        rounds = fake.rounds_for(N_NEW)
        for lv in s["levels"]:
            assert lv["requests"] == lv["ok_requests"] == 8 and lv["errors"] == []
            assert lv["output_tokens"] == 8 * N_NEW
            # wall_s is stored to the microsecond and tokens/s to 0.01: the recomputed rate agrees to 1e-4
            assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"], rel=1e-4, abs=0.01)
            assert lv["latency_p50_ms"] <= lv["latency_p99_ms"]
            # every request sleeps rounds x round_ms in the double: a lower bound on latency and round time
            assert lv["latency_p50_ms"] >= rounds * fake.round_ms
            forwards = (1 + rounds) if fake.algo else N_NEW
            assert lv["per_round_ms"] >= rounds * fake.round_ms / forwards
            if fake.algo:
                assert lv["verify_rounds"] == 8 * rounds
                assert lv["accept_length"] == pytest.approx(N_NEW / rounds, abs=1e-4)
                assert lv["accept_per_round"] == pytest.approx((N_NEW - 1) / rounds, abs=1e-4)
            else:
                assert lv["accept_length"] is None and lv["verify_rounds"] is None
        info = s["server"]
        assert info["speculative_algorithm"] == fake.algo
        if fake.algo:  # the server's cumulative figure includes the warm-up request
            assert info["avg_spec_accept_length"] == pytest.approx(fake.total_tokens / fake.total_rounds, abs=1e-4)
        else:
            assert "avg_spec_accept_length" not in info
    assert servers["ddtree"].max_in_flight <= 4
    assert doc["servers"][2]["server"]["speculative_ddtree_budget"] == 63
    assert "DDTREE b63" in r.stderr and "tok/s" in r.stderr  # the table goes to stderr


def test_concurrency_is_bounded_and_used(fakes, prompts):
    servers, urls = fakes
    fake = servers["ddtree"]
    r = run("bench", urls["ddtree"], "--prompts", str(prompts), "--concurrency", "3", "--requests", "12",
            "--max-new-tokens", "40", "--json")
    assert r.returncode == 0, r.stderr
    assert fake.max_in_flight == 3  # 12 requests of ~24 ms each: three are in flight together


def test_summarize_matches_an_independent_computation():
    rng = random.Random(5)
    res = [B.RequestResult(rng.uniform(0.01, 0.5), rng.randint(1, 50), rng.randint(1, 20)) for _ in range(17)]
    res.append(B.RequestResult(0.2, 0, None, "HTTP 500: boom"))
    lv = B.summarize(4, res, wall_s=1.7)
    ok = [r for r in res if r.error is None]
    tokens = sum(r.completion_tokens for r in ok)
    assert (lv.requests, lv.ok_requests, lv.errors) == (18, 17, ["HTTP 500: boom"])
    assert lv.output_tokens == tokens
    assert lv.output_tokens_per_s == pytest.approx(tokens / 1.7, abs=0.01)
    vct = sum(r.verify_ct for r in ok)
    assert lv.verify_rounds == vct
    assert lv.accept_length == pytest.approx(tokens / vct, abs=1e-4)
    assert lv.accept_per_round == pytest.approx((tokens - len(ok)) / vct, abs=1e-4)
    want_round = sum(r.latency_s * 1000 / (1 + r.verify_ct) for r in ok) / len(ok)
    assert lv.per_round_ms == pytest.approx(want_round, abs=1e-3)


def test_latency_fit_recovers_a_line_and_splits_request_from_round_cost():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    fixed_ms, round_ms = 31.0, 9.5  # a request's once-only cost and each round's
    res = []
    for _ in range(32):
        v = rng.randint(18, 34)
        res.append(B.RequestResult((fixed_ms + round_ms * v + rng.gauss(0, 0.5)) / 1000.0, 128, v))
    lv = B.summarize(1, res, wall_s=10.0)
    xs = np.array([r.verify_ct for r in res], float)
    ys = np.array([r.latency_s * 1000 for r in res])
    slope, intercept = np.polyfit(xs, ys, 1)  # the independent least-squares line
    assert lv.fit_round_ms == pytest.approx(slope, abs=1e-3)
    assert lv.fit_request_ms == pytest.approx(intercept, abs=1e-2)
    assert abs(lv.fit_round_ms - round_ms) < 0.2 and abs(lv.fit_request_ms - fixed_ms) < 5
    # no fit where the rounds do not vary, for plain decode, or with fewer than 4 requests
    same = [B.RequestResult(0.3, 128, 30) for _ in range(8)]
    assert B.summarize(1, same, 2.4).fit_round_ms is None
    assert B.summarize(1, [B.RequestResult(0.8, 128, None)] * 8, 6.4).fit_request_ms is None
    assert B.latency_fit([(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)]) is None
    # a negative intercept (the sixteenth session's auto at T = 1: -38.7 ms a request) is no split
    assert B.latency_fit([(60.0, 600.0), (62.0, 640.0), (64.0, 660.0), (66.0, 700.0)]) is None
    assert B.latency_fit([(60.0, 640.0), (62.0, 660.0), (64.0, 680.0), (66.0, 700.0)]) == pytest.approx((40.0, 10.0))


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert B.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError):
        B.percentile([], 50)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_and_from_json(fakes, prompts, tmp_path):
    pytest.importorskip("matplotlib")
    servers, urls = fakes
    png = tmp_path / "bench.png"
    r = run("bench", urls["plain"], urls["dflash"], "--prompts", str(prompts), "--concurrency", "1,2",
            "--requests", "4", "--max-new-tokens", "6", "--plot", str(png), "--json")
    assert r.returncode == 0, r.stderr
    w, h = _png_size(png)
    assert w > 100 and h > 100
    saved = tmp_path / "report.json"
    saved.write_text(r.stdout)
    png2 = tmp_path / "again.png"
    r2 = run("bench", "--from-json", str(saved), "--plot", str(png2), "--json")
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["servers"] == json.loads(r.stdout)["servers"]
    assert _png_size(png2) == (w, h)
    # a level with a latency fit (a real server's requests take different round counts) shows its fixed part
    doc = json.loads(r.stdout)
    doc["servers"][1]["levels"][0].update(fit_request_ms=21.598, fit_round_ms=8.777)
    fitted = tmp_path / "fitted.json"
    fitted.write_text(json.dumps(doc))
    r4 = run("bench", "--from-json", str(fitted))
    assert r4.returncode == 0, r4.stderr
    assert "fixed ms" in r4.stderr and "21.6" in r4.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"servers": [{"levels": []}]}')
    r3 = run("bench", "--from-json", str(bad), "--json")
    assert r3.returncode == 2 and json.loads(r3.stdout)["exit_code"] == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_exits_5(prompts):
    url = f"http://127.0.0.1:{_closed_port()}"
    r = run("bench", url, "--prompts", str(prompts), "--json")
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert doc == {"ok": False, "exit_code": 5, "error": doc["error"]} and url in doc["error"]


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    ("", "holds no prompts"),
    ('{"input_ids": [1, 2]}\nnot json\n', ":2: not JSON"),
    ('{"input_ids": [1, -2]}\n', ":1: 'input_ids' must be"),
    ('{"prompt": "x"}\n', ":1: expected 'text' or 'input_ids'"),
    ('[1, 2]\n', ":1: expected an object"),
])
def test_bad_prompt_file_exits_2(fakes, tmp_path, content, needle):
    _, urls = fakes
    p = tmp_path / "p.jsonl"
    if content is not None:
        p.write_text(content)
    r = run("bench", urls["plain"], "--prompts", str(p), "--json")
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and needle in doc["error"]


def test_bad_options_exit_2(fakes, prompts):
    _, urls = fakes
    for args in (["--concurrency", "1,x"], ["--concurrency", "0"], ["--label", "a", "--label", "b"]):
        r = run("bench", urls["plain"], "--prompts", str(prompts), *args, "--json")
        assert r.returncode == 2, (args, r.stderr)
        assert json.loads(r.stdout)["exit_code"] == 2


def test_failed_requests_exit_1_with_the_report(prompts):
    fake = FakeSGLang("DFLASH", 3, 0.5, fail_every=3)
    url = f"http://127.0.0.1:{fake.serve(0)}"
    try:
        r = run("bench", url, "--prompts", str(prompts), "--concurrency", "2", "--requests", "6", "--json")
    finally:
        fake.stop()
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    lv = doc["servers"][0]["levels"][0]
    assert doc["ok"] is False and doc["exit_code"] == 1
    assert lv["requests"] == 6 and 0 < lv["ok_requests"] < 6
    assert lv["errors"] and "HTTP 500" in lv["errors"][0]
    assert lv["output_tokens"] == lv["ok_requests"] * 128  # the default --max-new-tokens


def test_inventory_host_local_uses_its_health_url(fakes, prompts, tmp_path):
    _, urls = fakes
    inv = tmp_path / "hosts.toml"
    inv.write_text(f"""
[hosts.local]
python = "{sys.executable}"
restart = {{ strategy = "command", start = "true", stop = "true", status = "true" }}
[hosts.local.health]
url = "{urls['dflash']}"
""")
    r = run("bench", "local", "-i", str(inv), "--prompts", str(prompts), "--concurrency", "1", "--requests", "2",
            "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["servers"][0]
    assert s["label"] == "local" and s["url"] == urls["dflash"] and s["server"]["speculative_algorithm"] == "DFLASH"
    r = run("bench", "nosuchhost", "-i", str(inv), "--prompts", str(prompts), "--json")
    assert r.returncode == 2 and "nosuchhost" in json.loads(r.stdout)["error"]


def test_unreachable_inventory_host_exits_5(prompts, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    inv = tmp_path / "hosts.toml"
    inv.write_text(f"""
[hosts.gone]
address = "127.0.0.1"
port = {_closed_port()}
user = "root"
known_hosts = "{kh}"
connect_timeout_s = 3
python = "/usr/bin/python3"
restart = {{ strategy = "command", start = "true", stop = "true", status = "true" }}
""")
    r = run("bench", "gone", "-i", str(inv), "--prompts", str(prompts), "--json")
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 5 and "gone" in doc["error"]


def test_plot_series_leaves_out_a_server_that_measured_nothing():
    """A server whose every level failed or was skipped (b63's T = 1 levels past a run's deadline)
    was drawn as a dotted 'no speculation' line at 1.0; it is now no line and named as not
    measured, and each server keeps its colour on both panels whatever is left out."""
    from ddtree_deploy.deploy.remote import bench as B

    def level(c, tps, acc):
        return {"concurrency": c, "output_tokens_per_s": tps, "accept_length": acc}

    doc = {"servers": [
        {"label": "plain", "group": "T=1", "levels": [level(1, 150.0, None), level(4, 580.0, None)]},
        {"label": "DDTREE b63", "group": "T=1", "levels": [level(1, None, None), level(4, None, None)]},
        {"label": "DFLASH", "group": "T=1", "levels": [level(1, 164.0, 1.49), level(4, None, None)]},
    ]}
    series, unmeasured = B.plot_series(doc)
    assert unmeasured == ["DDTREE b63 (T=1)"]
    assert [(a["name"], a["color"]) for a in series] == [("plain (T=1)", "C0"), ("DFLASH (T=1)", "C2")]
    assert series[0]["accept"] is None and series[1]["accept"][0] == 1.49
    assert series[1]["tokens_per_s"][0] == 164.0 and series[1]["tokens_per_s"][1] != series[1]["tokens_per_s"][1]
