"""Tree compilation: SGLang verify arrays, ancestor masks and the flat FULL custom mask."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ddtree_utils as du


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def reachable(next_token: list[int], next_sibling: list[int]) -> list[int]:
    """Every node a first-child / next-sibling walk can reach from the root (DFS order)."""
    seen, stack = [], [0]
    while stack:
        node = stack.pop()
        seen.append(node)
        child = next_token[node]
        while child != -1:
            stack.append(child)
            child = next_sibling[child]
    return seen


def check_compiled(tree: du.DDTree, bonus, seq_lens, ct: du.CompiledTree):
    bs, budget = tree.tokens.shape
    n = budget + 1
    assert ct.draft_tokens.shape == ct.positions.shape == (bs * n,)
    assert torch.equal(ct.retrieve_index, torch.arange(bs * n).view(bs, n))
    masks = []
    for b in range(bs):
        par = [-1] + tree.parents[b].tolist()
        valid = [True] + tree.node_valid[b].tolist()
        depth = [0] + tree.depth[b].tolist()
        assert (
            ct.draft_tokens.view(bs, n)[b].tolist()
            == [int(bonus[b])] + tree.tokens[b].tolist()
        )
        assert ct.positions.view(bs, n)[b].tolist() == [
            int(seq_lens[b]) + d for d in depth
        ]
        assert ct.parents[b].tolist() == par and ct.depth[b].tolist() == depth
        children = {
            i: [c for c in range(1, n) if valid[c] and par[c] == i] for i in range(n)
        }
        for i in range(n):
            row = {j for j in range(n) if ct.tree_mask[b, i, j]}
            assert row == (ancestors_or_self(par, i) if valid[i] else {0, i})
            kids = children[i] if valid[i] else []
            assert int(ct.retrieve_next_token[b, i]) == (kids[0] if kids else -1)
            for a, c in zip(kids, kids[1:] + [-1]):
                assert int(ct.retrieve_next_sibling[b, a]) == c
            if not valid[i]:
                assert int(ct.retrieve_next_sibling[b, i]) == -1
        nt, ns = (
            ct.retrieve_next_token[b].tolist(),
            ct.retrieve_next_sibling[b].tolist(),
        )
        assert sorted(reachable(nt, ns)) == [i for i in range(n) if valid[i]]
        s = int(seq_lens[b])
        for i in range(n):
            masks.append([True] * s + ct.tree_mask[b, i].tolist())
    flat = [x for row in masks for x in row]
    assert ct.custom_mask.dtype == torch.bool and ct.custom_mask.tolist() == flat


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bs=st.integers(1, 3),
    depth=st.integers(1, 5),
    vocab=st.integers(1, 6),
    budget=st.integers(1, 25),
    invalid_row=st.booleans(),
)
def test_compiled_arrays_consistent(seed, bs, depth, vocab, budget, invalid_row):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (bs, depth, vocab), generator=gen).float()
    lp, ids = du.draft_topk_logprobs(logits, budget)
    valid = torch.ones(bs, dtype=torch.bool)
    valid[0] = not invalid_row
    tree = du.build_tree(lp, ids, budget, valid=valid)
    bonus = torch.randint(0, 100, (bs,), generator=gen)
    seq_lens = torch.randint(0, 6, (bs,), generator=gen)
    ct = du.compile_tree(tree, bonus, seq_lens, max_depth=depth)
    check_compiled(tree, bonus, seq_lens, ct)
    # the default depth bound (B) and a host copy of seq_lens give the same arrays
    again = du.compile_tree(tree, bonus, seq_lens, seq_lens_cpu=seq_lens.tolist())
    for name, a, b in zip(ct._fields, ct, again):
        assert torch.equal(a, b), name


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40))
def test_arrays_from_arbitrary_parents(raw):
    """Any parents-before-children tree (not only DDTree shapes), chains included."""
    par = [-1] + [r % (i + 1) for i, r in enumerate(raw)]
    n = len(par)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[par[i]] + 1
    parents = torch.tensor([par])
    mask, nt, ns = du.tree_arrays_from_parents(
        parents, torch.ones(1, n, dtype=torch.bool), max(depth)
    )
    for i in range(n):
        assert {j for j in range(n) if mask[0, i, j]} == ancestors_or_self(par, i)
        kids = [c for c in range(1, n) if par[c] == i]
        assert int(nt[0, i]) == (kids[0] if kids else -1)
        for a, c in zip(kids, kids[1:] + [-1]):
            assert int(ns[0, a]) == c


def test_custom_mask_separately_and_without():
    lp, ids = du.draft_topk_logprobs(torch.randn(2, 4, 9), 8)
    tree = du.build_tree(lp, ids, 8)
    seq = torch.tensor([3, 0])
    ct = du.compile_tree(tree, torch.tensor([1, 2]), seq, build_custom_mask=False)
    assert ct.custom_mask.numel() == 0
    full = du.tree_custom_mask(ct.tree_mask, seq)
    assert full.numel() == 9 * (3 + 9) + 9 * (0 + 9)
    assert torch.equal(
        full, du.compile_tree(tree, torch.tensor([1, 2]), seq).custom_mask
    )
    with pytest.raises(ValueError, match="seq_lens"):
        du.tree_custom_mask(ct.tree_mask, [1, 2, 3])


def test_empty_batch_compiles():
    lp, ids = du.draft_topk_logprobs(torch.zeros(0, 4, 9), 4)
    tree = du.build_tree(lp, ids, 4)
    ct = du.compile_tree(
        tree, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert ct.draft_tokens.shape == (0,) and ct.custom_mask.shape == (0,)
    assert ct.tree_mask.shape == (0, 5, 5)
