"""SGLang 0.5.16 pin on the CPU: builds snapshot/sglang-0.5.16 + patches/0.5.16 + ddtree_utils.py,
lays the build over a copy of the real sglang 0.5.16 site (deploy.build.pins.sglang_site: the venv's
sglang-sites/0.5.16 or $DDTREE_SGLANG_SITES/0.5.16, installed by scripts/install_sglang_env.sh)
and runs tests/sglang_v2/inner/ in a child Python with that overlay first on PYTHONPATH and
TRITON_INTERPRET=1. Skips when the site is absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ddtree_deploy.checks.sglang_smoke import make_overlay
from ddtree_deploy.deploy.build import build as b
from ddtree_deploy.deploy.build import pins

ROOT = Path(__file__).resolve().parents[2]
SITE = pins.sglang_site("0.5.16")

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(
        SITE is None,
        reason=f"no sglang 0.5.16 test site in {pins.sites_root()} (scripts/install_sglang_env.sh)",
    ),
]


def test_the_016_pin_on_cpu(tmp_path):
    """The 0.5.16 pin's inner CPU tests (tests/sglang_v2/inner/) in a child Python over the real
    sglang 0.5.16 site. Over 60 s on 2 cores: the child imports sglang 0.5.16 (torch, transformers,
    its Triton helpers in the interpreter) and runs its whole inner suite in one process."""
    build = tmp_path / "build"
    (pin,) = pins.select("0.5.16")
    b.assemble(b.prepare(pin.inputs()), build)
    overlay = make_overlay(build, tmp_path / "overlay", SITE / "sglang")
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(overlay), str(SITE), str(ROOT)]),
        TRITON_INTERPRET="1",
        DDTREE_V2_INNER="1",
        SGLANG_LOGGING_LEVEL="WARNING",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(ROOT / "tests" / "sglang_v2" / "inner")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout, tail
