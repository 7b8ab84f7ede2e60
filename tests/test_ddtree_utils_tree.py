"""Tree construction: both builders against brute-force enumeration of all prefixes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddtree_reference as dr
import ddtree_utils as du

NEG_INF = float("-inf")


def brute_force_tree(lp: torch.Tensor, ids: torch.Tensor, budget: int, cap: int | None):
    """All prefixes of one request, scored by float32 left-to-right sums, sorted by the tie rule.

    Returns a list of (score, depth, ranks, token) for the chosen nodes, in tie-rule order.
    """
    depth_limit, k = lp.shape
    k = min(k, cap) if cap is not None else k
    prefixes = []
    for d in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = torch.tensor(0.0, dtype=torch.float32)
            for i, r in enumerate(ranks):
                score = score + lp[i, r].float()
            s = float(score)
            if s != NEG_INF:
                prefixes.append((-s, d, ranks))
    prefixes.sort()
    chosen = prefixes[:budget]
    return [(-neg, d, ranks, int(ids[d - 1, ranks[-1]])) for neg, d, ranks in chosen]


def assert_tree_matches_brute(tree: du.DDTree, lp, ids, budget, valid, cap):
    bs = lp.shape[0]
    for b in range(bs):
        want = brute_force_tree(lp[b], ids[b], budget, cap) if valid[b] else []
        n = len(want)
        assert tree.node_valid[b, :n].all() and not tree.node_valid[b, n:].any()
        assert torch.isneginf(tree.score[b, n:]).all()
        index_of = {}
        for j, (score, d, ranks, token) in enumerate(want):
            index_of[ranks] = j + 1
            assert float(tree.score[b, j]) == score
            assert int(tree.depth[b, j]) == d
            assert int(tree.tokens[b, j]) == token
            parent = (
                index_of[ranks[:-1]] if d > 1 else 0
            )  # prefix-closed: parent already listed
            assert int(tree.parents[b, j]) == parent < j + 1


def random_inputs(
    draw_seed: int, bs: int, depth: int, vocab: int, k: int, levels: int, p_ninf: float
):
    """Quantised logits (many exact ties), some -inf, through the real draft_topk_logprobs."""
    gen = torch.Generator().manual_seed(draw_seed)
    logits = torch.randint(0, levels, (bs, depth, vocab), generator=gen).float() * 0.5
    holes = torch.rand(bs, depth, vocab, generator=gen) < p_ninf
    logits[holes] = NEG_INF
    return du.draft_topk_logprobs(logits, k)


# Small random tree problems (shared with the Triton kernel tests): few logit levels give exact
# ties, p_ninf punches -inf holes, invalid_mask marks requests invalid, cap is topk_cap.
TREE_CASES = {
    "seed": st.integers(0, 2**31 - 1),
    "bs": st.integers(1, 3),
    "depth": st.integers(1, 4),
    "vocab": st.integers(1, 5),
    "k": st.integers(1, 6),
    "budget": st.integers(1, 40),
    "levels": st.integers(1, 4),
    "p_ninf": st.sampled_from([0.0, 0.0, 0.3, 0.9]),
    "cap": st.one_of(st.none(), st.integers(1, 4)),
    "invalid_mask": st.integers(0, 7),
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**TREE_CASES)
def test_builders_equal_brute_force(
    seed, bs, depth, vocab, k, budget, levels, p_ninf, cap, invalid_mask
):
    lp, ids = random_inputs(seed, bs, depth, vocab, k, levels, p_ninf)
    valid = torch.tensor([not (invalid_mask >> b) & 1 for b in range(bs)])
    ref = dr.build_tree_reference(lp, ids, budget, valid=valid, topk_cap=cap)
    fast = du.build_tree(lp, ids, budget, valid=valid, topk_cap=cap)
    assert_tree_matches_brute(ref, lp, ids, budget, valid.tolist(), cap)
    for name, a, b in zip(ref._fields, ref, fast):
        assert a.dtype == b.dtype and a.shape == b.shape == (bs, budget), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("budget", [1, 16, 64, 200])
@pytest.mark.parametrize("levels", [3, 1000])
def test_batched_equals_reference_realistic(budget, levels):
    """L = 15 like DFlash b16, many requests; heavy ties when levels is small."""
    gen = torch.Generator().manual_seed(budget * 7 + levels)
    logits = torch.randint(0, levels, (6, 15, 300), generator=gen).float() / levels * 8
    lp, ids = du.draft_topk_logprobs(logits, budget)
    valid = torch.tensor([True, True, False, True, True, True])
    ref = dr.build_tree_reference(lp, ids, budget, valid=valid, topk_cap=None)
    fast = du.build_tree(lp, ids, budget, valid=valid)
    for name, a, b in zip(ref._fields, ref, fast):
        assert torch.equal(a, b), name
    assert ref.node_valid[valid].all() and not ref.node_valid[~valid].any()


def test_probability_one_parents_first():
    """V = 1: every prefix has probability 1; the chain must be listed root-to-leaf."""
    lp, ids = du.draft_topk_logprobs(torch.zeros(2, 5, 1), 4)
    assert torch.equal(lp, torch.zeros(2, 5, 1))
    for build in (dr.build_tree_reference, du.build_tree):
        tree = build(lp, ids, 8)
        assert tree.node_valid[:, :5].all() and not tree.node_valid[:, 5:].any()
        assert tree.depth[0, :5].tolist() == [1, 2, 3, 4, 5]
        assert tree.parents[0, :5].tolist() == [0, 1, 2, 3, 4]


def test_budget_one_is_the_argmax_token():
    logits = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(3))
    lp, ids = du.draft_topk_logprobs(logits, 1)
    for build in (dr.build_tree_reference, du.build_tree):
        tree = build(lp, ids, 1)
        assert torch.equal(tree.tokens[:, 0], logits[:, 0].argmax(-1))
        assert tree.parents.eq(0).all() and tree.depth.eq(1).all()


def test_budget_beyond_existing_prefixes():
    """V = 2, L = 2 has 2 + 4 = 6 prefixes; B = 10 leaves 4 nonexistent nodes."""
    logits = torch.tensor([[[0.3, -0.2], [1.0, 0.1]]])
    lp, ids = du.draft_topk_logprobs(logits, 5)  # K > V
    assert lp.shape == (1, 2, 2)
    for build in (dr.build_tree_reference, du.build_tree):
        tree = build(lp, ids, 10)
        assert tree.node_valid.sum() == 6
        tok, par, dep = (
            tree.tokens[0].tolist(),
            tree.parents[0].tolist(),
            tree.depth[0].tolist(),
        )
        paths = {
            (tok[j],) if dep[j] == 1 else (tok[par[j] - 1], tok[j]) for j in range(6)
        }
        assert paths == {(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)}
        assert not tree.node_valid[0, 6:].any()


def test_all_rows_invalid_and_empty_batch():
    lp, ids = du.draft_topk_logprobs(torch.randn(3, 4, 10), 4)
    valid = torch.zeros(3, dtype=torch.bool)
    for build in (dr.build_tree_reference, du.build_tree):
        tree = build(lp, ids, 7, valid=valid)
        assert not tree.node_valid.any() and torch.isneginf(tree.score).all()
        assert (
            tree.parents.eq(0).all()
            and tree.depth.eq(1).all()
            and tree.tokens.eq(0).all()
        )
        empty = build(lp[:0], ids[:0], 7)
        assert empty.tokens.shape == (0, 7)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("logit_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(id_dtype, logit_dtype):
    logits = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(1)).to(
        logit_dtype
    )
    lp, ids = du.draft_topk_logprobs(logits, 8)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64
    ref = dr.build_tree_reference(lp, ids.to(id_dtype), 20)
    fast = du.build_tree(lp, ids.to(id_dtype), 20)
    for a, b in zip(ref, fast):
        assert torch.equal(a, b)
    assert ref.tokens.dtype == torch.int64 and ref.score.dtype == torch.float32


def test_reference_rejects_bad_inputs():
    lp, ids = du.draft_topk_logprobs(torch.randn(1, 3, 10), 4)
    with pytest.raises(ValueError, match="log-probabilities"):
        dr.build_tree_reference(lp.abs(), ids, 4)
    with pytest.raises(ValueError, match="sorted"):
        dr.build_tree_reference(lp.flip(-1), ids, 4)
    bad = lp.clone()
    bad[0, 1, 2] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        dr.build_tree_reference(bad, ids, 4)
    for build in (dr.build_tree_reference, du.build_tree):
        with pytest.raises(ValueError, match="budget"):
            build(lp, ids, 0)
        with pytest.raises(ValueError, match="topk_cap"):
            build(lp, ids, 3, topk_cap=0)
        with pytest.raises(ValueError, match=r"\[bs, L, K\]"):
            build(lp[0], ids[0], 3)


@pytest.mark.parametrize("method", ["topk", "sort", "threshold", "auto"])
def test_beam_selection_variants_equal_reference(method, monkeypatch):
    """The three per-depth selection kernels of build_tree give the reference tree."""
    monkeypatch.setattr(du, "_BEAM_SELECT", method)
    for seed in range(40):
        gen = torch.Generator().manual_seed(seed)
        depth, vocab, budget = 1 + seed % 5, 1 + seed % 7, 1 + (seed * 7) % 45
        lp, ids = random_inputs(
            seed, 3, depth, vocab, 8, 1 + seed % 4, 0.2 * (seed % 3)
        )
        valid = torch.rand(3, generator=gen) > 0.2
        ref = dr.build_tree_reference(lp, ids, budget, valid=valid)
        fast = du.build_tree(lp, ids, budget, valid=valid)
        for name, a, b in zip(ref._fields, ref, fast):
            assert torch.equal(a, b), (seed, name)
