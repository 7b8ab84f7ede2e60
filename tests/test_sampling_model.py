"""bench/sampling_model.py's replay of the sampling kernel's search ends on the threshold the
kernel's rule gives (the torch path's radix select), so its loop counts describe the search that
finds the right set. CPU only; the machine-code half of the model is not run here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import ddtree_utils as du

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sampling_model", ROOT / "bench" / "sampling_model.py")
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)


@pytest.mark.parametrize("top_k,top_p", [(20, None), (None, 0.9), (20, 0.9), (None, 0.3), (1000, 0.99)])
def test_replay_ends_on_the_rules_threshold(top_k, top_p):
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 6, 3000
    x = torch.randn(rows, vocab, generator=gen)
    x[0] *= 0.01  # flat: top_p's bracket stays dense
    x[1] *= 5.0  # peaked
    x[2] = torch.randint(-3, 4, (vocab,), generator=gen).float()  # ties
    x[3, :5] = -1e30  # far outliers below
    temp = 0.7
    s = (x / temp).numpy().astype(np.float32)
    src = (ROOT / "ddtree_utils.py").read_text() + (ROOT / "ddtree_triton.py").read_text()
    _, thr = du._sample_with_threshold(x, temp, top_k, top_p, None, None, "torch")
    for r in range(rows):
        counts, got = model.replay(du, src, s[r], top_k, top_p)
        assert got == float(thr[r]), (r, got, float(thr[r]))
        assert counts["passes"] >= 1 and counts["draw_steps"] >= 1
        assert counts["substeps"] + counts["buffer_substeps"] > 0


def test_a_revision_without_the_file_is_a_clear_error(tmp_path):
    """--ref naming nothing: one line saying so, exit 1, no traceback, no temporary files left."""
    before = set(Path(tempfile.gettempdir()).glob("sampling_model_*"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sampling_model.py"), "--ref", "no-such-rev"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("--ref no-such-rev: no ddtree_utils.py there"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert set(Path(tempfile.gettempdir()).glob("sampling_model_*")) == before
