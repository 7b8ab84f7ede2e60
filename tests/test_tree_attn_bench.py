"""bench/tree_attn_bench.py's host side: case parsing, the choice of the fastest setting and its
write into a copy of ddtree_utils.py (the timing itself needs CUDA: GPU runs, docs/TESTING.md)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tree_attn_bench", ROOT / "bench" / "tree_attn_bench.py")
tab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tab)


def test_cases_parse_and_bad_ones_are_refused():
    assert tab.parse_cases("1x64x200, 16x16x0") == [(1, 64, 200), (16, 16, 0)]
    for bad in ("1x64", "ax1x2", "0x64x10", "1x64x-1"):
        with pytest.raises(SystemExit, match="--cases"):
            tab.parse_cases(bad)


def test_the_fastest_batch_one_setting_is_summed_over_its_cases():
    def row(bs, us, **s):
        return {"bs": bs, "kernel": "tree", "us": us, "setting_key": json.dumps(s, sort_keys=True)}

    a, b = {"_TREE_ATTN_WARPS": 4}, {"_TREE_ATTN_WARPS": 8}
    results = [row(1, 10, **a), row(1, 30, **a), row(1, 15, **b), row(1, 20, **b),
               row(16, 1, **a), row(16, 100, **b),  # other batches do not count
               {"bs": 1, "kernel": "extend", "us": 1.0, "setting_key": "extend"}]
    assert tab.best_at_batch_one(results) == b  # 35 < 40
    assert tab.best_at_batch_one([]) is None


def test_apply_rewrites_the_constants_of_a_ddtree_utils_copy(tmp_path, monkeypatch):
    copy = tmp_path / "ddtree_utils.py"
    shutil.copy(ROOT / "ddtree_utils.py", copy)
    shutil.copy(ROOT / "ddtree_triton.py", tmp_path / "ddtree_triton.py")
    setting = {"_TREE_ATTN_ROWS": 32, "_TREE_ATTN_ROWS_SMALL": 16, "_TREE_ATTN_WARPS": 8,
               "_TREE_ATTN_MIN_SPLIT_KEYS": 256}
    tab.apply_setting(copy, setting)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("ddtree_utils_applied", copy)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert {k: getattr(mod, k) for k in setting} == setting
    # the rest of the file is untouched
    before = (ROOT / "ddtree_utils.py").read_text().splitlines()
    after = copy.read_text().splitlines()
    assert len(before) == len(after)
    assert sum(x != y for x, y in zip(before, after)) == 4
    # a constant the file does not have: an error, the file as it was
    text = copy.read_text()
    with pytest.raises(SystemExit, match="_NO_SUCH"):
        tab.apply_setting(copy, {"_TREE_ATTN_WARPS": 8, "_NO_SUCH": 1})
    assert copy.read_text() == text
    sys.modules.pop("ddtree_utils_applied", None)
