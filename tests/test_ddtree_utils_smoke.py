"""One small interpreter case per Triton kernel of ddtree_utils: the fast tier's (and quality gate
7's) check that every kernel still runs and agrees with the torch path or the reference.

The thorough kernel tests (property tests, realistic shapes, boundary rows, the search buffer)
are marked ``interp`` and run in ``make test``; these run in ``make test-fast`` and in
``ddtree-deploy check``. Each case is the smallest one that still takes the kernel's main path.
"""

from __future__ import annotations

import pytest
import torch
from test_ddtree_utils_round import _kv_move_case
from test_ddtree_utils_tree_attention import _case as attention_case

import ddtree_reference as dr
import ddtree_utils as du

pytest.importorskip("triton")
pytestmark = pytest.mark.smoke


def _draft(seed: int = 0, bs: int = 2, depth: int = 4, vocab: int = 9):
    logits = torch.randn(bs, depth, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    return logits


def test_normaliser_kernel():
    """_sumexp_partial_kernel (draft_topk_logprobs) equals the torch path."""
    logits = _draft()
    lp_t, ids_t = du.draft_topk_logprobs(logits, 4, backend="torch")
    lp, ids = du.draft_topk_logprobs(logits, 4, backend="triton")
    assert torch.equal(ids, ids_t)
    torch.testing.assert_close(lp, lp_t, atol=1e-5, rtol=1e-5)


def test_tree_build_and_compile_kernels():
    """_ddtree_build_kernel and _ddtree_compile_kernel equal the torch path, field by field."""
    lp, ids = du.draft_topk_logprobs(_draft(1), 4, backend="torch")
    want = du.build_tree(lp, ids, 7, backend="torch")
    got = du.build_tree(lp, ids, 7, backend="triton")
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b), name
    bonus, seq = torch.tensor([5, 7]), torch.tensor([11, 3])
    want_c = du.compile_tree(want, bonus, seq, backend="torch")
    got_c = du.compile_tree(want, bonus, seq, backend="triton")
    for name, a, b in zip(want_c._fields, want_c, got_c):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("search", [True, False])
def test_sampling_kernel(search):
    """_sample_rows_kernel, with the threshold search and without: the kept sets (thresholds)
    equal the torch path's, greedy rows give the argmax, every draw is a kept token."""
    rows, vocab = 6, 20
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, vocab, generator=gen) * 2
    temp = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 0.5])
    top_k = torch.tensor([5, 1 << 30, 1, 3, 1 << 30, 8] if search else [1 << 30] * rows, dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.6, 1.0, 1.0, 0.8, 0.95] if search else [1.0] * rows)
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.1, 0.0])
    args = (x, temp, top_k, top_p, min_p)
    tok_t, thr_t = du._sample_with_threshold(*args, torch.Generator().manual_seed(0), "torch", search)
    tok, thr = du._sample_with_threshold(*args, torch.Generator().manual_seed(0), "triton", search)
    s = x / torch.where(temp > 0, temp, 1.0).view(rows, 1)
    assert torch.equal(s >= thr.view(rows, 1), s >= thr_t.view(rows, 1))  # the same kept sets
    assert bool((s.gather(1, tok.view(rows, 1)).squeeze(1) >= thr).all())
    assert int(tok[2]) == int(x[2].argmax())


def test_kv_move_kernel():
    """_move_kv_rows_kernel moves the accepted path onto the committed slots (overlapping)."""
    buffers, tgt, src = _kv_move_case(0, bs=2, depth=3, n=6)
    want = [b.clone() for b in buffers]
    for w, b in zip(want, buffers):
        w[tgt.reshape(-1)] = b[src.reshape(-1)]
    du.move_kv_rows(du.kv_rows(buffers), tgt, src, backend="triton")
    for w, b in zip(want, buffers):
        assert torch.equal(w, b)


def test_tree_attention_kernels():
    """_tree_attn_prefix_kernel + _tree_attn_tree_kernel equal the float32 reference (one
    request with a prefix over two splits, one without)."""
    args = attention_case(4, plens=(0, 20), n=4, hq=2, hkv=1, d=16, dtype=torch.float32)
    want = dr.tree_verify_attention_reference(*args, 4, 0.3)
    got = du.tree_verify_attention(*args, 4, 0.3, splits=2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
