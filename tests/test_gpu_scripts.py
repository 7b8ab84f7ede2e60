"""tests/gpu/run_on_device.sh refuses to start without the carried .gpu folder."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).parent / "gpu" / "run_on_device.sh"


def test_run_on_device_without_gpu_folder_says_what_is_missing(tmp_path):
    root = tmp_path / "repo"  # a checkout without .gpu (git-ignored, carried by hand)
    (root / "tests" / "gpu").mkdir(parents=True)
    script = root / "tests" / "gpu" / "run_on_device.sh"
    shutil.copy(SCRIPT, script)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(script), str(out)], check=False, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"missing {root}/.gpu/wheelhouse/sglang-site.tar.xz" in proc.stderr
    assert "carry" in proc.stderr
    assert not out.exists()  # nothing written before the check


def _load_by_path(name: str, path: Path):
    """A bench/ or tests/gpu/ script loaded as a module by path (no directory goes onto sys.path)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[name]
    return mod


def _load_round_cost():
    return _load_by_path("round_cost", Path(__file__).parents[1] / "bench" / "round_cost.py")


def test_round_cost_phase_table_reads_the_workers_gpu_and_host_line(tmp_path):
    """bench/round_cost.py parses the line DDTreePhaseTimer (0.5.16 patch 0004) logs; the
    format string is taken from the patch itself so the two cannot drift apart."""
    import json

    rc = _load_round_cost()
    patch = (Path(__file__).parents[1] / "patches" / "0.5.16" / "0004-ddtree-worker-v2.patch").read_text()
    fmt = next(ln for ln in patch.splitlines() if "DDTREE phase ms bs=" in ln).strip("+ ").strip('",')
    gpu = {p: 1.0 + i for i, p in enumerate(rc._PHASES)}
    host = {p: 0.5 for p in rc._PHASES}
    line = fmt % (4, 50, json.dumps(gpu), json.dumps(host))
    (tmp_path / "rc-ddtree_b15.log").write_text(f"[2026-12-04 00:00:00] {line}\n")
    table = rc.phase_table(str(tmp_path), ["ddtree_b15", "dflash"])
    row = next(r for r in table.splitlines() if r.startswith("| ddtree_b15 | 4 | 50 |"))
    assert "3.000 (0.500)" in row  # verify: GPU 3.0, host 0.5
    assert row.endswith(f"| {sum(gpu.values()):.3f} ({sum(host.values()):.3f}) |")


def test_round_cost_table_compares_every_ddtree_server_with_dflash_of_the_same_run():
    rc = _load_round_cost()
    res = [
        {"config": "dflash", "bs": 1, "round_ms": 8.0},
        {"config": "ddtree_b15", "bs": 1, "round_ms": 8.8},
        {"config": "ddtree_b15_ext", "bs": 1, "round_ms": 8.2},
        {"config": "ddtree_b63_ext", "bs": 1, "round_ms": 9.0},
        {"config": "ddtree_b63_ext", "bs": 4, "error": "timed out"},
        {"config": "ddtree_b63", "error": "server not ready"},
    ]
    table = rc.table(res, [1, 4])
    lines = table.splitlines()
    assert lines[0] == ("| batch | dflash | ddtree_b15 | ddtree_b15_ext | ddtree_b63_ext | "
                        "ddtree_b15 / DFLASH | ddtree_b15_ext / DFLASH | ddtree_b63_ext / DFLASH |")
    assert lines[2] == "| 1 | 8.00 | 8.80 | 8.20 | 9.00 | 1.100 | 1.025 | 1.125 |"
    assert lines[3] == "| 4 | - | - | - | - | - | - | - |"
    assert "- ddtree_b15 <= 1.05x DFLASH at bs 1: MISSED" in lines
    assert "- ddtree_b15_ext <= 1.05x DFLASH at bs 1: met" in lines
    assert "- ddtree_b63_ext <= 1.2x DFLASH at bs 1: met" in lines
    # a server that never came up is named, not a crash of the table
    assert "- not measured: ddtree_b63 (server not ready)" in lines
    assert rc.SERVER_ENV["ddtree_b15_ext"] == {"SGLANG_DDTREE_TREE_ATTENTION": "0"}


def _acceptance_run_attached(tmp_path: Path, base: int, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
    """bench/acceptance_run.py --attach at ports base + i, on a one-prompt pair; (out, the run)."""
    import json
    import sys

    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "prompts.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "acceptance_run.py"), "--out", str(out), "--pair", str(pair),
                        "--attach", "--port-base", str(base), *args], capture_output=True, text=True, timeout=180)
    return out, r


def test_acceptance_run_attach_refuses_a_server_of_another_configuration(tmp_path):
    """bench/acceptance_run.py --attach measures servers already running at its ports; a port
    that answers with another configuration (here budget 15 where DDTREE b255 belongs, as
    happened in a device run) is refused before anything is measured (exit 2, the reason in
    results.json). The servers are TEST DOUBLES (tests/bench_fake_sglang.py): SGLang needs a GPU."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fake_sglang import FakeSGLang, serve_in_a_row

    fakes = [FakeSGLang(), FakeSGLang("DFLASH", accept=3), FakeSGLang("DDTREE", accept=4, budget=15)]
    base = serve_in_a_row(fakes)  # the driver's ports are port_base + i
    try:
        out, r = _acceptance_run_attached(tmp_path, base, "--budgets", "255", "--concurrency", "1")
        assert r.returncode == 2, r.stderr[-2000:]
        res = json.loads((out / "results.json").read_text())
        assert res["ok"] is False and "serves algorithm DDTREE budget 15, not DDTREE b255" in res["error"]
        assert all(f.count == 0 for f in fakes)  # nothing was generated
    finally:
        for f in fakes:
            f.stop()


def test_acceptance_run_fails_when_a_server_fails_after_it_started(tmp_path):
    """A server that answers at start-up and then fails (the sixteenth session's b255 ran out of
    memory at its warm-up) fails the run in all three places: results.json's ok, the last log
    line and the exit code (that run logged ok=True and exited 0). The servers are TEST DOUBLES
    (tests/bench_fake_sglang.py): SGLang needs a GPU; the DDTREE one answers /get_server_info and
    fails every generate."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fake_sglang import FakeSGLang, serve_in_a_row

    fakes = [FakeSGLang(round_ms=0.2), FakeSGLang("DFLASH", accept=3, round_ms=0.2),
             FakeSGLang("DDTREE", accept=4, round_ms=0.2, budget=255, fail_every=1)]
    base = serve_in_a_row(fakes, first=37400)
    try:
        out, r = _acceptance_run_attached(tmp_path, base, "--budgets", "255", "--concurrency", "1",
                                          "--max-new-tokens", "8", "--log-dir", str(tmp_path / "logs"))
    finally:
        for f in fakes:
            f.stop()
    assert r.returncode == 1, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["ok"] is False and res["exit_code"] == 1
    assert "warm-up failed" in res["server_errors"]["DDTREE b255"]
    last = r.stderr.strip().splitlines()[-1]
    assert "ok=False" in last and "DDTREE b255" in last
    # the servers that worked were measured all the same
    tps = {(s["label"], s["group"]): s["levels"][0]["output_tokens_per_s"] for s in res["servers"]}
    assert tps[("plain", "T=0")] and tps[("DFLASH", "T=0")] and tps[("DDTREE b255", "T=0")] is None


def test_e2e_startup_table_check_reads_the_snapshot_auto_rounds_writes():
    """ddtree_e2e's start-up table check against the snapshot of the real ddtree_budget.AutoRounds
    (seeded as seed_startup_costs does; the times are synthetic, no GPU here): measured and
    positive passes; unmeasured, a width without a seed, or an eager server that measured fails."""
    import json

    import ddtree_budget as db

    e2e = _load_by_path("ddtree_e2e", Path(__file__).parent / "gpu" / "ddtree_e2e.py")
    r = db.AutoRounds([8, 16], 15, [1, 4, 32], graph_sizes=[1, 4])
    snap = lambda: json.loads(json.dumps(r.snapshot()))  # as /get_server_info sends it
    assert not e2e.startup_table_ok(snap(), graphs=True)  # not measured
    r.startup = {"status": "skipped", "reason": "CUDA graphs are off (eager verify)"}
    assert e2e.startup_table_ok(snap(), graphs=False)
    seeded = r.seed_verify({(1, 8): 1e-3, (4, 8): 2e-3, (1, 16): 1.5e-3})
    r.startup = {"status": "measured", "cells": 3, "seeded": seeded}
    assert e2e.startup_table_ok(snap(), graphs=True) and not e2e.startup_table_ok(snap(), graphs=False)
    r.startup["seeded"] = 4  # the snapshot's table holds fewer seeds than the status says
    assert not e2e.startup_table_ok(snap(), graphs=True)
    r2 = db.AutoRounds([8, 16], 15, [1, 4], graph_sizes=[1, 4])
    r2.startup = {"status": "measured", "cells": 1, "seeded": r2.seed_verify({(1, 8): 1e-3})}
    assert not e2e.startup_table_ok(json.loads(json.dumps(r2.snapshot())), graphs=True)  # 16 unseeded


def test_e2e_range_check_reads_the_snapshot_auto_rounds_writes():
    """ddtree_e2e's batch-range check (startup_seeds_in_range) against the real AutoRounds'
    snapshot with width ranges (synthetic seeds, no GPU here): seeds within each width's range
    with batch 1 everywhere pass; a seed past a width's largest batch (a runner that captured out
    of its range) or a width without a batch-1 seed fails."""
    import json

    import ddtree_budget as db

    e2e = _load_by_path("ddtree_e2e", Path(__file__).parent / "gpu" / "ddtree_e2e.py")

    def rounds(seeds):
        r = db.AutoRounds([8, 16], 15, [1, 4, 32], graph_sizes=[1, 4, 32], limits={8: None, 16: 4}, off=True)
        r.seed_verify(seeds)
        return json.loads(json.dumps(r.snapshot()))

    good = {(1, 1): 5e-4, (4, 1): 6e-4, (32, 1): 9e-4, (1, 8): 1e-3, (4, 8): 2e-3, (32, 8): 4e-3,
            (1, 16): 1.5e-3, (4, 16): 3e-3}
    assert e2e.startup_seeds_in_range(rounds(good))
    assert not e2e.startup_seeds_in_range(rounds({**good, (32, 16): 8e-3}))  # width 16 past batch 4
    assert not e2e.startup_seeds_in_range(rounds({k: v for k, v in good.items() if k != (1, 16)}))
    assert not e2e.startup_seeds_in_range({})


def test_e2e_matrix_default_budget_row_is_auto_where_the_pin_defaults_to_it():
    """ddtree_e2e's `default` budget starts DDTREE with no budget flag; on 0.5.16 (default auto) the
    row gets auto's checks, on 0.5.13.post1 (default block - 1) a fixed budget's."""
    e2e = _load_by_path("ddtree_e2e", Path(__file__).parent / "gpu" / "ddtree_e2e.py")
    assert e2e.parse_budgets("15,default,auto") == [15, "default", "auto"]
    with pytest.raises(SystemExit, match="default"):
        e2e.parse_budgets("15,dflt")
    for pin, auto in (("0.5.16", "auto"), ("0.5.13.post1", "")):
        rows = {c.name: c for c in e2e.build_matrix(["triton"], ["default", 15], ["cg"], pin)}
        row = rows["triton-ddtree-bdefault-cg"]
        assert "--speculative-algorithm DDTREE" in row.extra and "--speculative-ddtree-budget" not in row.extra
        assert row.auto == auto and row.kind == "ddtree"
        assert "--speculative-ddtree-budget 15" in rows["triton-ddtree-b15-cg"].extra
    # the e2e script runs with the standard library only, so it keeps its own list: the same pins
    # as the deploy tool's (the pins whose worker serves auto)
    from ddtree_deploy.deploy.config.launch import DDTREE_AUTO_PINS
    assert e2e.DEFAULT_AUTO_PINS == DDTREE_AUTO_PINS


def test_acceptance_run_takes_auto_beside_fixed_budgets_and_checks_it_on_attach():
    """--budgets 15,auto gives a "DDTREE b15" and a "DDTREE auto" server; --attach accepts a port
    whose /get_server_info says budget "auto" for the latter and refuses it for b15. The server
    is a TEST DOUBLE (tests/bench_fake_sglang.py): SGLang needs a GPU."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fake_sglang import FakeSGLang

    ar = _load_by_path("acceptance_run_t", Path(__file__).resolve().parents[1] / "bench" / "acceptance_run.py")

    assert ar.parse_budgets("15,auto,auto+off") == [15, "auto", "auto+off"]
    names = [n for n, _ in ar.configs(ar.parse_budgets("15,auto,auto+off"))]
    assert names == ["plain", "DFLASH", "DDTREE b15", "DDTREE auto", "DDTREE auto+off"]
    assert "--speculative-ddtree-budget auto" in ar.configs(["auto"])[-1][1]
    assert ar.configs(["auto+off"])[-1][1].endswith("--speculative-ddtree-budget auto")
    with pytest.raises(SystemExit, match="neither an integer nor one of auto, auto"):
        ar.parse_budgets("15,big")
    # every label configs() makes parses back into its algorithm and budget, one rule for all uses
    assert [ar.label_parts(n) for n in names] == [(None, None), ("DFLASH", None), ("DDTREE", 15), ("DDTREE", "auto"),
                                                  ("DDTREE", "auto+off")]
    with pytest.raises(ValueError, match="not a configuration label"):
        ar.label_parts("DDTREE big")
    # the server environment: off rounds only for auto+off, phase times on every DDTREE server
    assert ar.server_env("DDTREE auto+off") == {"SGLANG_DDTREE_AUTO_OFF": "1"}
    assert ar.server_env("DDTREE auto+trees") == {"SGLANG_DDTREE_AUTO_OFF": "0"}  # off is on by default
    assert ar.server_env("DDTREE auto@off") == {"SGLANG_DDTREE_AUTO_ONLY": "off"}  # every round off
    assert ar.label_parts("DDTREE auto@off") == ("DDTREE", "auto@off")
    assert ar.configs(["auto@off"])[-1][1].endswith("--speculative-ddtree-budget auto")
    assert ar.server_env("DDTREE auto") == {} and ar.server_env("plain", phase_times=True) == {}
    assert ar.server_env("DDTREE b15", phase_times=True) == {"SGLANG_DDTREE_PHASE_TIMES": "1"}
    # the rounds a level added per option, from two controller snapshots
    assert ar.chosen_between({"chosen": {"16": 3, "off": 1}}, {"chosen": {"16": 10, "off": 1, "64": 2}}) == {"16": 7, "64": 2}
    assert ar.chosen_between(None, {"chosen": {"16": 3}}) == {"16": 3} and ar.chosen_between(None, None) is None

    fake = FakeSGLang("DDTREE", accept=4, budget="auto")
    for port in range(35100, 60000, 11):
        try:
            fake.serve(port)
            break
        except OSError:
            continue
    try:
        def server(name):
            return SimpleNamespace(name=name, port=port, url=f"http://127.0.0.1:{port}")

        assert ar.attached_mismatch(server("DDTREE auto")) is None
        assert ar.attached_mismatch(server("DDTREE auto+off")) is None  # the flag value is auto
        assert "budget auto, not DDTREE b15" in ar.attached_mismatch(server("DDTREE b15"))
    finally:
        fake.stop()


def test_acceptance_run_refuses_a_bad_without_before_touching_anything(tmp_path):
    """--without naming plain (the greedy reference) or a configuration the run does not have is
    refused with the names it may use, before the run creates its output folder or clears the
    server logs of an earlier run in --log-dir."""
    import sys

    root = Path(__file__).resolve().parents[1]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "DFLASH.log").write_text("an earlier run's log\n")
    for word, shown in (("plain", "['plain']"), ("b15", "['b15']")):
        out = tmp_path / f"out-{word}"
        r = subprocess.run([sys.executable, str(root / "bench" / "acceptance_run.py"), "--out", str(out),
                            "--budgets", "auto+off", "--without", word, "--log-dir", str(logs)],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 1, r.stderr[-2000:]
        assert f"--without: {shown}: name configurations of this run other than plain (DFLASH, DDTREE auto+off)" in r.stderr
        assert not out.exists()
        assert (logs / "DFLASH.log").read_text() == "an earlier run's log\n"


def test_acceptance_run_waves_set_the_requests_per_level_and_a_bad_value_changes_nothing(tmp_path):
    """--waves W sends max(8, W x c) requests a level (2, the default, left c >= 16 levels a few
    seconds long and two runs of them 10 % apart); --requests still overrides it. A value below 1
    is refused before the run creates its output folder."""
    import sys

    from ddtree_deploy.deploy.remote import bench as B

    assert [B.requests_for(c, None) for c in (1, 4, 16, 64)] == [8, 8, 32, 128]
    assert [B.requests_for(c, None, 4) for c in (1, 4, 16, 64)] == [8, 16, 64, 256]
    assert B.requests_for(64, 10, 4) == 10
    with pytest.raises(ValueError):
        B.requests_for(16, None, 0)
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(root / "bench" / "acceptance_run.py"), "--out", str(out), "--waves", "0",
                        "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and "--waves: 0: give 1 or more" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_device_shell_scripts_parse():
    """The device scripts run only on the GPU machine, where a syntax error costs a whole call:
    every bench/ and tests/gpu/ shell script (and the sourced bench/lifted_setup.sh) parses."""
    root = Path(__file__).resolve().parents[1]
    scripts = sorted([*root.glob("bench/*.sh"), *root.glob("tests/gpu/*.sh")])
    assert any(p.name == "lifted_setup.sh" for p in scripts) and len(scripts) >= 6
    for p in scripts:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{p.name}: {r.stderr}"


def test_acceptance_run_prints_same_run_ratios_against_dflash_and_the_best_fixed():
    """The goals of issues 27 and 28 are ratios within one run: each DDTREE configuration against
    DFLASH, and auto against the best fixed configuration (DFLASH or a fixed budget) at each
    concurrency. Checked against the ratios computed here from the same synthetic levels; a level
    not measured gives no ratio."""

    ar = _load_by_path("acceptance_run_r", Path(__file__).resolve().parents[1] / "bench" / "acceptance_run.py")
    tps = {"plain": {1: 150.0, 16: 2200.0}, "DFLASH": {1: 400.0, 16: 2800.0}, "DDTREE b63": {1: 480.0, 16: 2240.0},
           "DDTREE auto+off": {1: 490.0, 16: None}}
    doc = {"servers": [{"label": n, "group": "T=0", "levels": [{"concurrency": c, "output_tokens_per_s": v}
                                                                for c, v in by.items()]} for n, by in tps.items()]}
    rows = dict(ar.same_run_ratios(doc, "T=0"))
    assert list(rows) == ["DDTREE b63 / DFLASH", "DDTREE auto+off / DFLASH", "DDTREE auto+off / best fixed"]
    assert rows["DDTREE b63 / DFLASH"][1] == pytest.approx(480 / 400, abs=1e-4)
    assert rows["DDTREE b63 / DFLASH"][16] == pytest.approx(2240 / 2800, abs=1e-4)
    assert rows["DDTREE auto+off / best fixed"][1] == pytest.approx(490 / max(400, 480), abs=1e-4)
    assert rows["DDTREE auto+off / best fixed"][16] is None and rows["DDTREE auto+off / DFLASH"][16] is None
    md = ar.table_md(doc, None, [0.0], [63, "auto+off"])
    assert "| DDTREE b63 / DFLASH | 1.20x | 0.80x |" in md and "| DDTREE auto+off / best fixed | 1.02x | - |" in md
    assert ar.same_run_ratios(doc, "T=1") == []
    alone = {"servers": [s for s in doc["servers"] if s["label"] in ("plain", "DDTREE auto+off")]}
    assert ar.same_run_ratios(alone, "T=0") == []  # auto beside plain only: nothing to compare with


@pytest.mark.parametrize("order,plain_last", [("temps-first", False), ("conc-first", False), ("conc-first", True),
                                              ("temps-first", True)])
def test_acceptance_run_orders_its_levels(tmp_path, order, plain_last):
    """--order temps-first measures each server's levels at one temperature, then the next;
    conc-first every server and temperature at one concurrency, then the next, so a deadline
    drops the highest concurrencies rather than the last servers' T = 1 (the thirteenth session
    lost b63's T = 1 that way); --plain-last measures plain after the others at each temperature
    and concurrency. Either way results.json holds every (server, temperature) in server order, with
    its levels in concurrency order. The servers are TEST DOUBLES (tests/bench_fake_sglang.py,
    attached at their ports): SGLang needs a GPU."""
    import json
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_fake_sglang import FakeSGLang, serve_in_a_row

    fakes = [FakeSGLang(round_ms=0.2), FakeSGLang("DFLASH", accept=3, round_ms=0.2),
             FakeSGLang("DDTREE", accept=4, round_ms=0.2, budget=63)]
    base = serve_in_a_row(fakes, first=37100)
    try:
        out, r = _acceptance_run_attached(tmp_path, base, "--budgets", "63", "--concurrency", "1,4", "--max-new-tokens",
                                          "8", "--order", order, "--log-dir", str(tmp_path / "logs"),
                                          *(["--plain-last"] if plain_last else []))
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        for f in fakes:
            f.stop()
    measured = re.findall(r"\] (plain|DFLASH|DDTREE b63) T=(\d) c=(\d+):", r.stderr)
    blocks = [(n, t) for t in "01" for n in ("plain", "DFLASH", "DDTREE b63")]
    names = ("DFLASH", "DDTREE b63", "plain") if plain_last else ("plain", "DFLASH", "DDTREE b63")
    measured_blocks = [(n, t) for t in "01" for n in names]
    if order == "temps-first":
        want = [(n, t, c) for n, t in measured_blocks for c in ("1", "4")]
    else:
        want = [(n, t, c) for c in ("1", "4") for n, t in measured_blocks]
    assert measured == want
    res = json.loads((out / "results.json").read_text())
    assert [(s["label"], s["group"]) for s in res["servers"]] == [(n, f"T={t}") for n, t in blocks]
    assert all([lv["concurrency"] for lv in s["levels"]] == [1, 4] for s in res["servers"])
    assert all(s["server"].get("speculative_algorithm") == (None if s["label"] == "plain" else s["label"].split()[0])
               for s in res["servers"])


def test_every_device_script_takes_its_server_flags_from_pin_flags():
    """One table of per-pin server flags (bench/pin_flags.py): acceptance_run, round_cost and
    ddtree_e2e build theirs from it (only their size caps differ), every flag each of them names
    exists in that pin's vendored server_args.py, and the graph flag names follow the pin."""
    root = Path(__file__).resolve().parents[1]
    pf = _load_by_path("pin_flags_t", root / "bench" / "pin_flags.py")
    tables = {
        "acceptance_run": _load_by_path("acceptance_run_pf", root / "bench" / "acceptance_run.py").COMMON_BY_PIN,
        "round_cost": _load_round_cost().COMMON_BY_PIN,
        "ddtree_e2e": _load_by_path("ddtree_e2e_pf", root / "tests" / "gpu" / "ddtree_e2e.py").COMMON_ARGS_BY_PIN,
    }
    for name, table in tables.items():
        assert sorted(table) == sorted(pf.PINS), name
        for pin, flags in table.items():
            source = (root / "snapshot" / f"sglang-{pin}" / "srt" / "server_args.py").read_text()
            for flag in re.findall(r"--[a-z0-9-]+", flags):
                assert flag[2:].replace("-", "_") in source, (name, pin, flag)
            assert flags.startswith(("--skip-tokenizer-init " + pf.BASE, pf.BASE)), (name, flags)
            assert f"{pf.DECODE_GRAPH_BS[pin]} " in flags and pf.PREFILL_GRAPH_OFF[pin] in flags, (name, pin)
            other = [p for p in pf.PINS if p != pin][0]
            assert pf.PREFILL_GRAPH_OFF[other] not in flags, (name, pin)
    # the prefill graph sizes, and a bad pin or size refused
    assert pf.prefill_graph_sizes(1) == [1] and pf.prefill_graph_sizes(100) == [1, 2, 4, 8, 16, 32, 64]
    assert pf.graph_flags("0.5.13.post1", 512) == "--disable-piecewise-cuda-graph"  # eager prefill on the v1 pin
    with pytest.raises(ValueError, match="0.5.17"):
        pf.common("0.5.17")
    with pytest.raises(ValueError, match=">= 1"):
        pf.prefill_graph_sizes(0)
    r = subprocess.run(["python3", str(root / "bench" / "pin_flags.py"), "--prefill-graph-max", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--prefill-graph-max must be >= 0" in r.stderr


@pytest.mark.parametrize(
    "env,want,unwanted",
    [
        ({}, ["--cuda-graph-backend-prefill disabled", "--cuda-graph-max-bs-decode"], ["--cuda-graph-max-bs-prefill"]),
        ({"PREFILL_GRAPHS": "1"}, ["--cuda-graph-max-bs-prefill 512", "--cuda-graph-bs-prefill 1 2 4 8 16 32 64 128 256 512 "],
         ["--cuda-graph-backend-prefill"]),
        ({"PREFILL_GRAPHS": "1", "PREFILL_GRAPH_MAX": "64"}, ["--cuda-graph-max-bs-prefill 64",
                                                              "--cuda-graph-bs-prefill 1 2 4 8 16 32 64 "], ["128"]),
        ({"PIN": "0.5.13.post1", "PREFILL_GRAPHS": "1"}, ["--disable-piecewise-cuda-graph", "--cuda-graph-max-bs"],
         ["prefill", "decode"]),
    ],
)
def test_pin_flags_of_the_device_scripts(env, want, unwanted):
    """bench/lifted_setup.sh's pin_flags: each pin's server flags, and PREFILL_GRAPHS keeping
    0.5.16's own prefill graph (capped) instead of turning it off; every flag it names exists in
    that pin's vendored server_args.py."""
    root = Path(__file__).resolve().parents[1]
    clean = {k: v for k, v in os.environ.items() if k not in ("PIN", "PREFILL_GRAPHS", "PREFILL_GRAPH_MAX")}
    r = subprocess.run(["bash", "-c", f'source "{root}/bench/lifted_setup.sh"; pin_flags; echo "$pin|$common $graph_bs"'],
                       capture_output=True, text=True, check=True, env={**clean, **env})
    pin, flags = r.stdout.strip().split("|")
    assert pin == env.get("PIN", "0.5.16")
    for w in want:
        assert w in flags, flags
    for u in unwanted:
        assert u not in flags, flags
    source = (root / "snapshot" / f"sglang-{pin}" / "srt" / "server_args.py").read_text()
    for flag in re.findall(r"--[a-z0-9-]+", flags):
        assert flag[2:].replace("-", "_") in source, flag


@pytest.mark.parametrize("mem,env,refused", [
    (81559, {"BUDGETS": "255", "WITHOUT": ""}, True),  # the sixteenth session's call 5
    (81559, {"BUDGETS": "63,511", "WITHOUT": "b15"}, True),
    (81559, {"BUDGETS": "255", "PIN": "0.5.13.post1"}, True),  # that pin's default keeps DFLASH
    (81559, {"BUDGETS": "255", "WITHOUT": "DFLASH"}, False),
    (81559, {"BUDGETS": "255"}, False),  # 0.5.16's default on an 80 GB card leaves DFLASH out
    (81559, {"BUDGETS": "63,auto+off", "WITHOUT": ""}, False),
    (143771, {"BUDGETS": "255", "WITHOUT": ""}, False),  # an H200 holds all three
])
def test_lifted_auto_run_refuses_b255_beside_dflash_on_an_80_gb_card(tmp_path, mem, env, refused):
    """bench/lifted_auto_run.sh refuses (exit 2, before any setup) a fixed budget of 255 or more
    beside plain and DFLASH on a card of 100 GB or less, where it ran out of memory twice. The
    card's size comes from a TEST DOUBLE of nvidia-smi on PATH (no GPU here); a run that is not
    refused goes on to its setup, which fails here on the missing site (exit 1)."""
    root = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {mem}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if k not in ("BUDGETS", "WITHOUT", "PIN", "CONC", "MAX_BS")}
    r = subprocess.run(["bash", str(root / "bench" / "lifted_auto_run.sh"), str(out), str(tmp_path / "no-site.tar.xz"),
                        "pair", "overlay"], capture_output=True, text=True, timeout=120,
                       env={**base, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    if refused:
        assert r.returncode == 2 and "set WITHOUT=DFLASH" in r.stderr, r.stderr
        assert not out.exists()
    else:
        assert r.returncode != 2 and "WITHOUT=DFLASH" not in r.stderr, r.stderr


@pytest.mark.parametrize("conc,max_bs", [("1,8", "4"), ("1,x", "64"), ("1", "y")])
def test_lifted_auto_run_refuses_levels_its_servers_cannot_batch_before_any_setup(tmp_path, conc, max_bs):
    """bench/lifted_auto_run.sh: MAX_BS sets every server's decode-graph batch and running-request
    cap; a CONC level above it (or a word) is refused with exit 2 before the site is unpacked or
    anything is written."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(root / "bench" / "lifted_auto_run.sh"), str(out), "site", "pair", "overlay"],
                       capture_output=True, text=True, env={**os.environ, "CONC": conc, "MAX_BS": max_bs})
    assert r.returncode == 2 and "above MAX_BS" in r.stderr, r.stderr
    assert not out.exists()


_FAKE_LAUNCH = '''
"""TEST DOUBLE of `python -m sglang.launch_server` (SGLang needs a GPU): prints start-up lines in
SGLang 0.5.16's format, then serves tests/bench_fake_sglang.py's API on --port."""
import argparse, sys, time
sys.path.insert(0, {tests!r})
from bench_fake_sglang import FakeSGLang
ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
ap.add_argument("--speculative-algorithm", default=None)
ap.add_argument("--speculative-ddtree-budget", default=None)
a, _ = ap.parse_known_args()
if a.speculative_ddtree_budget == "oom":
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 46.00 MiB.", flush=True)
    sys.exit(1)
kv = 400000 if a.speculative_algorithm is None else 300000
print(f"[t] KV Cache is allocated. dtype: torch.bfloat16, #tokens: {{kv}}, K size: 28.00 GB, V size: 28.00 GB")
print("[t] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 9999, K size: 0.10 GB, V size: 0.10 GB")
print("[t] Capture target verify CUDA graph end. elapsed=6.16 s, mem usage=5.02 GB, avail mem=9.61 GB.")
if a.speculative_ddtree_budget == "auto":
    print("[t] DDTREE auto: verify width 8 built (CUDA graphs, on the widest width's capture stream) in 15.18s, device memory 1.119 GiB")
print("[t] Capture draft verify CUDA graph end. elapsed=4.55 s, mem usage=3.36 GB, avail mem=6.25 GB.", flush=True)
FakeSGLang(a.speculative_algorithm, 3, 0.2).serve(a.port)
while True:
    time.sleep(1)
'''


def test_default_start_starts_each_config_alone_and_reads_its_memory(tmp_path, monkeypatch):
    """bench/default_start.py end to end on the CPU: each configuration is started alone with no
    memory or graph flag (only the shared base flags), loaded at every level, stopped; its log's KV
    tokens (the target's, the first allocation), capture phases and auto widths are read; a
    configuration that runs out of memory at start is reported as not started and fails the run.
    The servers are TEST DOUBLES (a fake `sglang.launch_server` over tests/bench_fake_sglang.py):
    SGLang needs a GPU."""
    import json

    ds = _load_by_path("default_start_t", Path(__file__).resolve().parents[1] / "bench" / "default_start.py")
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(_FAKE_LAUNCH.format(tests=str(Path(__file__).parent)))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": [1, 2, 3, i]}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    import socket

    with socket.socket() as sock:  # a free port for the fake servers (one at a time)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rc = ds.main(["--out", str(out), "--pair", str(pair), "--configs", "auto,plain,b15", "--concurrency", "2,4",
                  "--max-new-tokens", "8", "--startup-timeout", "60", "--port", str(port), "--settle-s", "0"])
    doc = json.loads((out / "results.json").read_text())
    assert rc == 0 and doc["ok"], doc
    rows = {r["label"]: r for r in doc["configs"]}
    assert list(rows) == ["DDTREE auto", "plain", "DDTREE b15"]
    for label, r in rows.items():
        assert "--mem-fraction-static" not in r["cmd"] and "--max-total-tokens" not in r["cmd"]
        assert "cuda-graph" not in r["cmd"] and "--max-running-requests" not in r["cmd"]
        assert [lv["concurrency"] for lv in r["levels"]] == [2, 4]
        assert all(lv["ok_requests"] == 2 * lv["concurrency"] and not lv["errors"] for lv in r["levels"])
        assert r["memory"]["kv_tokens"] == (400000 if label == "plain" else 300000)
        assert [p["phase"] for p in r["memory"]["phases"]] == ["target verify", "draft verify"]
        assert r["memory"]["avail_gb_last"] == 6.25 and not r["memory"]["out_of_memory"]
    assert rows["DDTREE auto"]["memory"]["widths"] == [
        {"width": 8, "how": "CUDA graphs, on the widest width's capture stream", "s": 15.18, "gib": 1.119}]
    assert "--speculative-ddtree-budget auto" in rows["DDTREE auto"]["cmd"]
    table = (out / "table.md").read_text()
    assert "| DDTREE auto | yes |" in table and "| 300000 |" in table
    with pytest.raises(ValueError, match="none of plain"):
        ds.config_flags("b15x")
    label, flags = ds.config_flags("DDTREE")  # the pin's default budget: no budget flag at all
    assert label == "DDTREE default" and "--speculative-algorithm DDTREE" in flags and "budget" not in flags
    label, flags = ds.config_flags("auto@256")  # the running-request cap lifted
    assert label == "DDTREE auto (running 256)" and flags.endswith("--speculative-ddtree-budget auto --max-running-requests 256")
    assert ds.config_flags("plain@64") == ("plain (running 64)", "--max-running-requests 64")
    for bad in ("auto@", "auto@x", "auto@0"):
        with pytest.raises(ValueError, match="running cap"):
            ds.config_flags(bad)
    # a configuration that runs out of memory at start: reported, the run fails, the next still runs
    monkeypatch.setattr(ds, "config_flags", lambda w: (
        ("DDTREE oom", "--speculative-algorithm DDTREE --speculative-ddtree-budget oom") if w == "oom" else
        ("plain", "")))
    rc = ds.main(["--out", str(out), "--pair", str(pair), "--configs", "oom,plain", "--concurrency", "2",
                  "--max-new-tokens", "8", "--startup-timeout", "60", "--port", str(port), "--settle-s", "0"])
    doc = json.loads((out / "results.json").read_text())
    assert rc == 1 and not doc["ok"]
    oom, plain = doc["configs"]
    assert oom["error"].startswith("server exited") and oom["memory"]["out_of_memory"] and not oom["levels"]
    assert plain["error"] is None and plain["levels"][0]["ok_requests"] == 4
    assert "| DDTREE oom | NO: server exited" in (out / "table.md").read_text()
