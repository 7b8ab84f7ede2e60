"""Shared fixtures. `project` / `patched_project`: a small synthetic project in tmp_path (see
tests/foundation_support.py); `cli`: Typer's CliRunner on the real app; `ddtree`: the installed
console script in a subprocess (real exit codes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One intra-op thread per process (torch's OpenMP, MKL, OpenBLAS): `make test` runs more xdist
# workers than cores, and a second thread mostly spin-waits for the core the other workers hold
# (measured on 2 cores with one core busy: one sampling test 29 CPU-s with 2 threads, 21 with 1).
# Set before torch is first imported; the tests' subprocesses inherit it.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402

# Without a GPU, Triton kernels (ddtree_utils' fused tree kernels, sglang's helpers) run in
# Triton's interpreter. Triton reads this when it is first imported, so it is set here, before
# any test module imports it. The GPU tests run with --noconftest and compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Gate results are reused across runs only where a test asks for it (tests/test_checks.py): the
# CLI and the gates that tests start run every gate (checks/registry.py, DDTREE_GATE_CACHE).
os.environ.setdefault("DDTREE_GATE_CACHE", "off")

import pytest
from foundation_support import UPSTREAM, Project, edit, udiff


class _InstalledNamesOnly:
    """The project's folders deploy/ and checks/ are the packages ddtree_deploy.deploy and
    ddtree_deploy.checks; pytest runs in the repository root, where `import deploy` would load the
    same files a second time as other modules (two copies of every class and global). Refuse it."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("deploy", "checks"):
            raise ImportError(f"import ddtree_deploy.{name}, not {name} (the installed package name)", name=name)


sys.meta_path.insert(0, _InstalledNamesOnly)


# -- tiers (pyproject's markers; `make test-fast` deselects interp, stat, ssh and slow) ------------
# A ddtree_utils test whose source names the Triton backend or a kernel runs that kernel in Triton's
# interpreter here: it is marked `interp` automatically, so new kernel tests land in the right tier.
# `smoke` tests (one small case per kernel, tests/test_ddtree_utils_smoke.py) stay in the fast tier
# and are what gate 7 runs of the interpreter.
_INTERP_SIGNS = ('"triton"', "'triton'", "_triton(", "_kernel[")


def pytest_collection_modifyitems(config, items):
    import inspect

    for item in items:
        if not item.path.name.startswith("test_ddtree_utils") or item.get_closest_marker("smoke"):
            continue
        fn = getattr(item, "function", None)
        try:
            src = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            src = ""
        if "triton" in item.name or any(sign in src for sign in _INTERP_SIGNS):
            item.add_marker(pytest.mark.interp)


# -- `make test`'s order over the xdist workers: the longest tests first ------------------------------
# pytest-xdist's `worksteal` hands each worker one contiguous slice of the collection and lets idle
# workers steal from the end of the others' queues. A long test late in a slice then starts in the
# last minutes and ends the run alone (CPU idle: 22 min for about 15 min of work on 2 cores). Here
# the first distribution is planned instead: every test gets an estimate (LONG_TESTS below, else a
# default by tier), the known-long tests are dealt out longest first to the least loaded worker
# (each starts at t=0 or right after another long one), the other tests follow in units of one
# module (a module's fixtures, e.g. a deploy module's extra host, are set up once per worker), also
# to the least loaded worker; then work stealing balances the end of the run as before. Only the
# order changes: every test runs, in its own process as before.
#
# Seconds on 2 busy cores, from the last `make test --durations` (docs/TESTING.md, ninth session:
# call + setup); a key matches a node id and its parametrizations. Only the ranking matters. A test
# over about 40 s belongs here.
LONG_TESTS = {
    "tests/deploy/test_deploy_journal.py::test_kill_and_drop_at_every_step[kill]": 240,
    "tests/test_ddtree_utils_triton.py::test_kernels_compile_for_the_gpus_we_serve_on[90]": 186,
    "tests/deploy/test_deploy_journal.py::test_kill_and_drop_at_every_step[drop]": 203,
    "tests/deploy/test_deploy_journal.py::test_reboot_of_the_control_machine": 197,
    "tests/test_ddtree_utils_triton.py::test_kernels_compile_for_the_gpus_we_serve_on[120]": 152,
    "tests/deploy/test_deploy_journal.py::test_state_dir_enospc_at_each_step": 131,
    "tests/deploy/test_deploy_journal.py::test_enospc_at_each_step": 81,
    "tests/deploy/test_deploy_launch.py::test_systemd_push_turns_ddtree_on_and_rollback_restores_flags": 76,
    "tests/test_ddtree_utils_sampling.py::test_tree_walk_with_samples_is_lossless": 76,
    "tests/test_pins.py::test_gate_6_uses_the_sglang_of_the_pin": 62,
    "tests/deploy/test_deploy_scenarios.py::test_health_deadline_rolls_back": 60,
    "tests/deploy/test_deploy_report.py::test_messages_name_the_host_once": 59,
    "tests/deploy/test_deploy_launch.py::test_supervisord_auto_rollback_and_rollback_restore_env_file": 53,
    "tests/deploy/test_deploy_report.py::test_a_hand_edit_put_back_by_rollback_shows_as_drift": 48,
    "tests/deploy/test_deploy_launch.py::test_env_file_budget_change_is_restart_pending": 47,
    "tests/test_ddtree_utils_sampling.py::test_search_buffer_and_pivot_switch_keep_the_exact_sets[4096]": 46,
    "tests/deploy/test_deploy_report.py::test_push_of_the_build_in_place_starts_a_stopped_service": 45,
    "tests/sglang_v2/test_v2_pin.py::test_the_016_pin_on_cpu": 44,
    "tests/deploy/test_deploy_report.py::test_a_fault_during_the_automatic_rollback_keeps_the_first_cause": 42,
    "tests/deploy/test_deploy_launch.py::test_dead_push_with_launch_finished_by_next_command": 40,
    "tests/deploy/test_deploy_report.py::test_serial_rollout_stops_at_the_first_failed_host": 39,
}
_DEFAULT_S = (("tests/deploy/", 20.0), ("tests/sglang", 5.0), ("tests/test_ddtree_utils", 3.0), ("", 1.0))


def estimate_s(nodeid: str) -> float:
    """The planning estimate of one test (seconds on 2 busy cores)."""
    for key, s in LONG_TESTS.items():
        if nodeid == key or nodeid.startswith(key + "["):
            return float(s)
    return next(s for prefix, s in _DEFAULT_S if nodeid.startswith(prefix))


def plan_longest_first(collection: list[str], n_workers: int) -> list[list[int]]:
    """Indices of `collection` per worker, in the order each worker runs them (see above)."""
    long_units = [[i] for i, nid in enumerate(collection) if any(nid == k or nid.startswith(k + "[") for k in LONG_TESTS)]
    taken = {u[0] for u in long_units}
    modules: dict[str, list[int]] = {}
    for i, nid in enumerate(collection):
        if i not in taken:
            modules.setdefault(nid.split("::")[0], []).append(i)
    weight = lambda unit: sum(estimate_s(collection[i]) for i in unit)  # noqa: E731
    queues: list[list[int]] = [[] for _ in range(n_workers)]
    load = [0.0] * n_workers
    for units in (long_units, list(modules.values())):  # the long tests, then modules, each heaviest first
        for unit in sorted(units, key=weight, reverse=True):
            w = min(range(n_workers), key=lambda k: (load[k], k))
            queues[w].extend(unit)
            load[w] += weight(unit)
    return queues


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "worksteal":
        return None  # xdist's own scheduler for the other modes
    from xdist.scheduler import WorkStealingScheduling

    class LongestFirst(WorkStealingScheduling):
        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:  # a later call: rebalance as xdist does
                return self.check_schedule()
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = next(iter(self.node2collection.values()))
            nodes = [n for n in self.nodes if not n.shutting_down]
            for node, queue in zip(nodes, plan_longest_first(self.collection, len(nodes))):
                if queue:
                    self.node2pending[node].extend(queue)
                    node.send_runtest_some(queue)
            self.check_schedule()  # nothing left to hand out: an idle worker steals

    return LongestFirst(config, log)


@pytest.fixture(autouse=True)
def _sglang_stays_unimported(request):
    """tests/sglang imports sglang once per worker, from the build laid over it (the
    sglang_overlay fixture). A test elsewhere that imports the installed sglang in-process (say
    through pytest.importorskip) breaks every overlay test that xdist later hands the same worker:
    fail that test, by name, instead (CI's 16 overlay errors of the tenth session's try)."""
    had = "sglang" in sys.modules
    yield
    if not had and "sglang" in sys.modules and "sglang_overlay" not in request.fixturenames:
        where = getattr(sys.modules["sglang"], "__file__", "?")
        pytest.fail(f"this test imported sglang in-process ({where}); use importlib.util.find_spec "
                    "or a subprocess, or request the sglang_overlay fixture")


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """Snapshot of UPSTREAM, an empty series, a tiny ddtree_utils.py; nothing built yet."""
    proj = Project(tmp_path / "proj")
    proj.write_snapshot(UPSTREAM)
    proj.patches_dir.mkdir(parents=True)
    (proj.patches_dir / "series").write_text("# empty series\n")
    proj.utils.write_text('"""Stand-in for the real ddtree_utils.py in synthetic builds."""\n\nBUDGET = 4\n')
    return proj


@pytest.fixture
def patched_project(project: Project) -> Project:
    """`project` with two patches: 0001 edits mod.py (alpha, gamma) and adds a new file;
    0002 edits mod.py (beta) and other.py."""
    mod = UPSTREAM["srt/speculative/mod.py"]
    mod1 = edit(edit(mod, "return x + 1", "return x + 10"), "return z - 3", "return z - 30")
    new_file = '"""Added by the series."""\n\nNEW = True\n'
    project.add_patch(
        "0001-alpha-gamma.patch",
        udiff("srt/speculative/mod.py", mod, mod1) + udiff("srt/speculative/added.py", None, new_file),
        desc="Change alpha and gamma; add a module.",
    )
    mod2 = edit(mod1, "return y * 2", "return y * 20")
    other = UPSTREAM["srt/other.py"]
    project.add_patch(
        "0002-beta-other.patch",
        udiff("srt/speculative/mod.py", mod1, mod2)
        + udiff("srt/other.py", other, edit(other, "VALUE_20 = 20", "VALUE_20 = 200")),
        desc="Change beta and one value.",
    )
    return project


@pytest.fixture(scope="session")
def cli():
    """Typer's CliRunner on the real app (commands registered once)."""
    from ddtree_deploy.deploy import cli as deploy_cli
    from typer.testing import CliRunner

    deploy_cli._register()

    class Runner:
        def __init__(self):
            self.runner = CliRunner()

        def __call__(self, *args: str):
            return self.runner.invoke(deploy_cli.app, [str(a) for a in args])

    return Runner()


@pytest.fixture(scope="session")
def ddtree():
    """Run the installed console script in a subprocess: the real entry point and exit codes.
    Wide COLUMNS so rich does not wrap the one-line error message."""
    import os
    import shutil
    import subprocess
    import sys

    exe = Path(sys.executable).parent / "ddtree-deploy"
    exe = str(exe) if exe.exists() else shutil.which("ddtree-deploy")
    assert exe, "the ddtree-deploy console script is not installed (pip install -e .)"
    env = dict(os.environ, COLUMNS="400", NO_COLOR="1")

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([exe, *map(str, args)], check=False, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)

    return run
