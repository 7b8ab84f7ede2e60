#!/usr/bin/env python3
"""Check that the test suite still catches the mutations docs/TESTING.md lists as caught.

    .venv/bin/python scripts/mutants.py            # every mutation
    .venv/bin/python scripts/mutants.py --list     # the table only
    .venv/bin/python scripts/mutants.py buffer-fill-drops-last

Each mutation is one exact text replacement in a source file (the text must occur exactly once,
else the table is stale and the script says so). The file is mutated in place, the tests that
`make test` runs against that code are run with pytest (`-x`, no xdist), and the file's original
bytes are put back whatever happens (Ctrl-C included; the script checks the sha256 afterwards).
A mutation is caught when pytest fails; exit 0 when every mutation is caught, 1 otherwise, 2 on a
stale table or bad arguments. A few minutes on 2 cores (the interpreter tests dominate).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (as `make test` collects them) expected to fail
    what: str


MUTATIONS = (
    Mutation(
        "buffer-fill-drops-last",
        "ddtree_triton.py",
        "                            tl.store(buf_row + at, s, mask=band)\n"
        "                            n_buf += nb\n",
        "                            tl.store(buf_row + at, s, mask=band)\n"
        "                            n_buf += nb - 1\n",
        ("tests/test_ddtree_utils_sampling.py::test_search_buffer_and_pivot_switch_keep_the_exact_sets",),
        "the sampling search's buffer loses the last value of its first copy",
    ),
    Mutation(
        "recompaction-halves-count",
        "ddtree_triton.py",
        "                    n_buf = n_keep\n",
        "                    n_buf = n_keep // 2\n",
        ("tests/test_ddtree_utils_sampling.py::test_search_buffer_and_pivot_switch_keep_the_exact_sets",),
        "the buffer's in-place re-compaction keeps half of what it should",
    ),
    Mutation(
        "recompaction-drops-upper-ties",
        "ddtree_triton.py",
        "band = (sk >= lo) & (sk <= hi) & (idx < n_buf)",
        "band = (sk >= lo) & (sk < hi) & (idx < n_buf)",
        ("tests/test_ddtree_utils_sampling.py::test_search_buffer_recompaction_keeps_ties_at_the_upper_key",),
        "the re-compaction drops tokens equal to the bracket's upper key",
    ),
    Mutation(
        "draw-picks-next-column",
        "ddtree_triton.py",
        "pick = tl.min(tl.where(keep & (run > target), cols, V), axis=0)",
        "pick = tl.min(tl.where(keep & (run > target), cols + 1, V), axis=0)",
        ("tests/test_ddtree_utils_sampling.py::test_kernel_draw_is_the_inverse_cdf_of_the_kept_mass",),
        "the kernel's inverse-CDF draw returns the column after the drawn one",
    ),
    Mutation(
        "draw-forgets-earlier-steps",
        "ddtree_triton.py",
        "mass_before = tl.sum(tl.where(steps == j, cum - w_steps, 0.0), axis=0)",
        "mass_before = tl.sum(tl.where(steps == j, cum - w_steps, 0.0), axis=0) * 0.0",
        ("tests/test_ddtree_utils_sampling.py::test_kernel_draw_is_the_inverse_cdf_of_the_kept_mass",),
        "the draw inside the chosen 1024-column step ignores the mass of the steps before it",
    ),
    Mutation(
        "per-request-params-repeat",
        "ddtree_utils.py",
        "        return v.repeat_interleave(n_per_req)\n",
        "        return v.repeat(n_per_req)\n",
        ("tests/test_ddtree_utils_sampling.py::test_tree_targets_expand_per_request_params",
         "tests/sglang_v2/test_v2_pin.py::test_the_016_pin_on_cpu"),
        "per-request sampling parameters expanded to verify rows request-major instead of node-major",
    ),
    Mutation(
        "tree-attention-merges-every-split",
        "ddtree_triton.py",
        "    used = _tree_attn_splits(plen, S, MINK)[1]\n",
        "    used = S\n",
        ("tests/test_ddtree_utils_tree_attention.py::test_a_short_prefix_uses_fewer_splits_and_leaves_the_others_unwritten",),
        "the tree-verify merge reads split slots a short prefix never wrote",
    ),
    Mutation(
        "tree-attention-ignores-min-split-keys",
        "ddtree_triton.py",
        "    per = tl.maximum(tl.cdiv(plen, S), MINK)\n",
        "    per = tl.cdiv(plen, S)\n",
        ("tests/test_ddtree_utils_tree_attention.py::test_a_short_prefix_uses_fewer_splits_and_leaves_the_others_unwritten",),
        "a short prefix is cut into every split again (the minimum keys a split ignored)",
    ),
)
# Caught inside its own test, not applied here: a 0.5.16 build whose KV path gather is flipped
# fails gate 6 (tests/test_pins.py::test_gate_6_uses_the_sglang_of_the_pin builds that build).


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_one(m: Mutation) -> tuple[bool, float, str]:
    path = ROOT / m.file
    original = path.read_bytes()
    text = original.decode()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutants: {m.name}: the text to mutate occurs {text.count(m.old)} times in {m.file} "
                         "(the table is stale: update scripts/mutants.py)")
    before = sha(path)
    t0 = time.monotonic()
    try:
        path.write_text(text.replace(m.old, m.new))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
                              cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        path.write_bytes(original)
    assert sha(path) == before, f"{m.file} was not restored"
    last = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    return proc.returncode == 1, time.monotonic() - t0, last[0].strip("= ")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="mutations to run (default: all)")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    args = ap.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"mutants: unknown mutation(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.file}: {m.what}")
        return 0
    missed = 0
    for m in chosen:
        caught, secs, summary = run_one(m)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {m.name:32} {secs:6.0f} s  {summary}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
