"""The fused Triton kernels of build_tree / compile_tree, run on the CPU by Triton's interpreter.

CI has no GPU, so the kernels run here under ``TRITON_INTERPRET=1`` (Triton's own interpreter,
the same kernel source, numpy semantics); the compiled kernels are checked on an H200 by
tests/gpu/test_ddtree_utils_cuda.py. The interpreter is slow (seconds per call at L = 15), so
the property test keeps L, K and B small and two fixed cases cover the realistic shape.

tests/conftest.py sets the variable before Triton is first imported (Triton decides at
decoration time whether a kernel is compiled or interpreted).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ddtree_utils_tree import TREE_CASES, assert_tree_matches_brute, random_inputs

import ddtree_reference as dr
import ddtree_utils as du

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail(
        "TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)"
    )


def assert_same(want, got, what=""):
    for name, a, b in zip(want._fields, want, got):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name)
        assert torch.equal(a, b), (what, name)


def check_compile(tree, depth, seed):
    gen = torch.Generator().manual_seed(seed)
    bs = tree.tokens.shape[0]
    bonus = torch.randint(0, 1000, (bs,), generator=gen)
    seq = torch.randint(0, 500, (bs,), generator=gen)
    want = du.compile_tree(tree, bonus, seq, max_depth=depth, backend="torch")
    got = du.compile_tree(tree, bonus, seq, max_depth=depth, backend="triton")
    assert_same(want, got, "compile")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **{**TREE_CASES, "budget": st.integers(1, 24)}
)  # smaller B: the interpreter is slow
def test_kernels_equal_brute_force_and_reference(
    seed, bs, depth, vocab, k, budget, levels, p_ninf, cap, invalid_mask
):
    """Ties (few logit levels), -inf holes, invalid rows, caps, B beyond the prefix count."""
    lp, ids = random_inputs(seed, bs, depth, vocab, k, levels, p_ninf)
    valid = torch.tensor([not (invalid_mask >> b) & 1 for b in range(bs)])
    got = du.build_tree(lp, ids, budget, valid=valid, topk_cap=cap, backend="triton")
    assert_tree_matches_brute(got, lp, ids, budget, valid.tolist(), cap)
    ref = dr.build_tree_reference(lp, ids, budget, valid=valid, topk_cap=cap)
    assert_same(ref, got, "build")
    check_compile(got, depth, seed)


@pytest.mark.parametrize("budget,k,levels", [(64, 16, 3), (40, 40, 10**6)])
def test_kernels_realistic_shape(budget, k, levels):
    """L = 15 as with DFlash block 16; heavy ties with 3 logit levels."""
    gen = torch.Generator().manual_seed(budget + levels)
    logits = torch.randint(0, levels, (2, 15, 300), generator=gen).float() / levels * 8
    lp, ids = du.draft_topk_logprobs(logits, k)
    valid = torch.tensor([True, False])
    got = du.build_tree(lp, ids, budget, valid=valid, backend="triton")
    assert_same(dr.build_tree_reference(lp, ids, budget, valid=valid), got, "build")
    check_compile(got, 15, budget)


def test_kernel_pruned_grid_covers_the_threshold():
    """All candidates tie except one column: the B-th best lies outside (j+1)(r+1) <= B."""
    lp = torch.zeros(1, 2, 8)
    lp[0, 0, :] = torch.tensor([0.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    lp[0, 1, :] = -1.0
    ids = torch.arange(16).view(1, 2, 8)
    for budget in (3, 8, 12, 20):
        got = du.build_tree(lp, ids, budget, backend="triton")
        assert_same(dr.build_tree_reference(lp, ids, budget), got, f"B={budget}")


def test_backend_choice(monkeypatch):
    lp, ids = du.draft_topk_logprobs(torch.randn(1, 3, 10), 4)
    with pytest.raises(ValueError, match="backend"):
        du.build_tree(lp, ids, 4, backend="bogus")

    def no_kernel(*args):
        raise AssertionError("auto must not launch the kernel for CPU tensors")

    # "auto" on the CPU runs the torch ops, even under the interpreter
    monkeypatch.setattr(du, "_build_tree_triton", no_kernel)
    monkeypatch.setattr(du, "_compile_tree_triton", no_kernel)
    tree = du.build_tree(lp, ids, 4)
    assert_same(dr.build_tree_reference(lp, ids, 4), tree)
    du.compile_tree(
        tree, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    )
    assert du._pow2(1) == 1 and du._pow2(5) == 8 and du._pow2(64) == 64


def test_pruned_grid_cells():
    pj, pr = du._pruned_grid(12, 5, torch.device("cpu"))
    cells = set(zip(pj.tolist(), pr.tolist()))
    want = {(j, r) for j in range(12) for r in range(5) if (j + 1) * (r + 1) <= 12}
    assert cells == want and len(pj) == len(want)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((2, 3, 700), torch.bfloat16),
        ((1, 2, 20000), torch.float32),
        ((2, 2, 5), torch.float16),
    ],
)
def test_normaliser_kernel_equals_torch(shape, dtype):
    """draft_topk_logprobs with the Triton normaliser (one read of the logits) against the
    chunked torch normaliser: same ids, log-probabilities within float32 rounding."""
    gen = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    logits[0, 0, :] = float("-inf")  # an all -inf row: -inf log-probabilities
    logits[-1, -1, : shape[-1] // 2] = float("-inf")
    for k in (1, 4, 16):
        lp, ids = du.draft_topk_logprobs(logits, k, backend="triton")
        t_lp, t_ids = du.draft_topk_logprobs(logits, k, backend="torch")
        assert torch.equal(ids, t_ids)
        assert torch.equal(lp.isneginf(), t_lp.isneginf())
        assert torch.allclose(lp, t_lp, atol=1e-5)
        ref = torch.log_softmax(logits.double(), -1).gather(-1, ids)
        live = torch.isfinite(ref)
        assert torch.allclose(lp.double()[live], ref[live], atol=1e-4)


def test_normaliser_kernel_rejects_nan_and_inf():
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(1, 2, 100)
        logits[0, 1, 3] = bad
        with pytest.raises(ValueError, match="NaN"):
            du.draft_topk_logprobs(logits, 4, backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 120])
def test_kernels_compile_for_the_gpus_we_serve_on(tmp_path, arch):
    """The interpreter accepts code the compiler may reject: compile every kernel with the
    launch options the code uses, for sm_90 (H100/H200, where the project has run) and sm_120
    (RTX PRO 6000 Blackwell, ct200's cards), with the installed Triton and its bundled ptxas, no
    GPU needed. Over 60 s on 2 cores: Triton's passes and ptxas on 15-16 specialisations; the
    largest, budget 1023's tree build (a 3.8 MB cubin, over half the time), on sm_120 only
    (tests/triton_aot.py says why)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    script = Path(__file__).with_name("triton_aot.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(arch)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # one "ok" line per specialisation the script lists (its CASES; the count is its last line, so
    # no second interpreter has to import torch and Triton to read it), every one compiled
    m = re.search(r"^(\d+) of (\d+) specialisations compiled for sm_(\d+)$", proc.stdout, re.MULTILINE)
    assert m, proc.stdout
    n_cases = int(m.group(2))
    assert int(m.group(3)) == arch and int(m.group(1)) == n_cases >= 9, proc.stdout
    assert proc.stdout.count("ok   ") == n_cases, proc.stdout
    assert "FAIL" not in proc.stdout, proc.stdout


def test_forced_triton_without_cuda_or_interpreter_is_refused(monkeypatch):
    lp, ids = du.draft_topk_logprobs(torch.randn(1, 3, 10), 4)
    before = (lp.clone(), ids.clone())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"backend='triton' needs Triton and a CUDA"):
        du.build_tree(lp, ids, 4, backend="triton")
    with pytest.raises(RuntimeError, match=r"backend='triton' needs Triton and a CUDA"):
        du.draft_topk_logprobs(torch.randn(1, 3, 10), 4, backend="triton")
    assert torch.equal(lp, before[0]) and torch.equal(
        ids, before[1]
    )  # inputs untouched
