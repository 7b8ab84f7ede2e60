"""Reference verification (greedy, sampling), target filters, accept plan and metrics."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import ddtree_reference as dr
import ddtree_utils as du


def path_tokens(ct: du.CompiledTree, b: int, i: int) -> list[int]:
    """Tokens from the root to node i (both included)."""
    n = ct.parents.shape[1]
    toks = ct.draft_tokens.view(-1, n)[b]
    out = []
    while i >= 0:
        out.append(int(toks[i]))
        i = int(ct.parents[b, i])
    return out[::-1]


def toy_target(seq: list[int], vocab: int) -> int:
    """A deterministic 'target model': next token from the whole sequence."""
    return (sum(seq) * 7 + len(seq) * 3 + seq[-1] * 5) % vocab


def draft_towards_target(ctx, root, depth, vocab, gen, hit):
    """Draft logits that favour the target's greedy continuation with probability ``hit``."""
    seq, logits = ctx + [root], torch.randn(depth, vocab, generator=gen)
    for d in range(depth):
        nxt = toy_target(seq, vocab)
        if float(torch.rand((), generator=gen)) < hit:
            logits[d, nxt] += 3.0
        seq.append(nxt)
    return logits


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    depth=st.integers(1, 6),
    vocab=st.integers(2, 7),
    budget=st.integers(1, 30),
    hit=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
def test_greedy_walk_equals_sequential_decode(seed, depth, vocab, budget, hit):
    gen = torch.Generator().manual_seed(seed)
    bs = 4
    ctxs = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in range(bs)]
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    logits = torch.stack(
        [
            draft_towards_target(ctxs[b], int(roots[b]), depth, vocab, gen, hit)
            for b in range(bs)
        ]
    )
    lp, ids = du.draft_topk_logprobs(logits, budget)
    tree = du.build_tree(lp, ids, budget)
    ct = du.compile_tree(tree, roots, torch.full((bs,), 3), build_custom_mask=False)
    n = budget + 1
    target_predict = torch.tensor(
        [
            [toy_target(ctxs[b] + path_tokens(ct, b, i), vocab) for i in range(n)]
            for b in range(bs)
        ]
    )
    cand = ct.draft_tokens.view(bs, n)
    acc, acc_len, bonus = du.verify_greedy_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, target_predict, depth
    )
    assert acc.shape == (bs, depth + 1)
    for b in range(bs):
        k = int(acc_len[b])
        seq, decoded = ctxs[b] + [int(roots[b])], []
        for _ in range(k + 1):
            decoded.append(toy_target(seq, vocab))
            seq.append(decoded[-1])
        path = acc[b, : k + 1].tolist()
        assert path[0] == 0 and acc[b, k + 1 :].eq(-1).all()
        assert [int(cand[b, i]) for i in path[1:]] + [int(bonus[b])] == decoded
        for parent, child in itertools.pairwise(path):
            assert int(ct.parents[b, child]) == parent
        # maximal: the target's next token is not a child of the last accepted node
        last = path[-1]
        kids = [
            c
            for c in range(1, n)
            if tree.node_valid[b, c - 1] and ct.parents[b, c] == last
        ]
        assert k == depth or all(int(cand[b, c]) != int(bonus[b]) for c in kids)


def run_round(roots: torch.Tensor, lp, ids, budget, trans, gen):
    """One DDTree round for every request: tree from a fixed drafter, Markov target ``trans``."""
    bs = roots.shape[0]
    tree = du.build_tree(lp.expand(bs, -1, -1), ids.expand(bs, -1, -1), budget)
    ct = du.compile_tree(
        tree, roots, torch.zeros(bs, dtype=torch.int64), build_custom_mask=False
    )
    cand = ct.draft_tokens.view(bs, budget + 1)
    probs = trans[
        cand
    ]  # the target's conditional at every node depends on the node's token
    acc, acc_len, bonus = dr.verify_sampling_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, probs, lp.shape[1], gen
    )
    return cand, acc, acc_len, bonus


@pytest.mark.stat
def test_sampling_walk_is_lossless():
    """First two emitted tokens ~ p(a | root) p(b | a): chi-square, fixed seed, 60k samples."""
    vocab, samples = 3, 60000
    gen = torch.Generator().manual_seed(20260412)
    trans = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 0.5, dim=-1)
    lp, ids = du.draft_topk_logprobs(torch.randn(1, 3, vocab, generator=gen), 2)
    roots = torch.zeros(samples, dtype=torch.int64)
    cand, acc, acc_len, bonus = run_round(roots, lp, ids, 5, trans, gen)
    first = torch.where(
        acc_len >= 1, cand.gather(1, acc[:, 1:2].clamp_min(0)).squeeze(1), bonus
    )
    second = torch.where(
        acc_len >= 2,
        cand.gather(1, acc[:, 2:3].clamp_min(0)).squeeze(1),
        torch.where(acc_len == 1, bonus, -1),
    )
    redo = (
        second == -1
    )  # one token emitted: the next round (root = bonus) emits the second
    cand2, acc2, len2, bonus2 = run_round(first[redo], lp, ids, 5, trans, gen)
    second[redo] = torch.where(
        len2 >= 1, cand2.gather(1, acc2[:, 1:2].clamp_min(0)).squeeze(1), bonus2
    )
    assert (acc_len >= 1).any() and (acc_len == 0).any()  # both branches were exercised
    counts = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    expected = (trans[0].unsqueeze(1) * trans).reshape(-1).double()
    expected /= expected.sum()
    assert chisquare(counts.numpy(), (expected * samples).numpy()).pvalue > 1e-3
    # power: a 5% relative bias on the likeliest cell would be rejected at this sample size
    biased = expected.clone()
    biased[biased.argmax()] *= 1.05
    biased /= biased.sum()
    assert chisquare(counts.numpy(), (biased * samples).numpy()).pvalue < 1e-3


def test_sampling_walk_deterministic_with_generator():
    gen = torch.Generator().manual_seed(5)
    trans = torch.softmax(torch.randn(4, 4, generator=gen), -1)
    lp, ids = du.draft_topk_logprobs(torch.randn(1, 3, 4, generator=gen), 3)
    roots = torch.zeros(50, dtype=torch.int64)
    a = run_round(roots, lp, ids, 6, trans, torch.Generator().manual_seed(9))
    b = run_round(roots, lp, ids, 6, trans, torch.Generator().manual_seed(9))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def python_filter(
    row: list[float], temp: float, top_k: int, top_p: float
) -> list[float]:
    """SGLang's joint rule token by token: keep i iff fewer than top_k tokens and less than
    top_p of the (unrenormalised) mass lie strictly above it; renormalise."""
    if temp < 1e-6 or top_k == 1:
        best = max(range(len(row)), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(len(row))]
    s = (torch.tensor(row) / temp).tolist()
    probs = torch.softmax(torch.tensor(s, dtype=torch.float64), -1).tolist()
    keep = []
    for i in range(len(row)):
        above = [j for j in range(len(row)) if s[j] > s[i]]
        ok_k = top_k <= 0 or len(above) < top_k
        ok_p = top_p >= 1 or sum(probs[j] for j in above) < top_p
        keep.append(ok_k and ok_p)
    total = sum(p for p, k in zip(probs, keep) if k)
    return [p / total if k else 0.0 for p, k in zip(probs, keep)]


def test_target_probs_from_logits():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3, 10, generator=gen)
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])
    top_k = torch.tensor([0, 3, 0, 5])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.8])
    # row 3 sets both: the joint rule (top-p on the unrenormalised mass)
    probs = dr.target_probs_from_logits(logits, temp, top_k, top_p)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for b in range(4):
        for i in range(3):
            want = python_filter(
                logits[b, i].tolist(), float(temp[b]), int(top_k[b]), float(top_p[b])
            )
            assert torch.allclose(probs[b, i], torch.tensor(want), atol=1e-6)
    flat = dr.target_probs_from_logits(logits[:, 0], 1.0)
    assert torch.allclose(flat, torch.softmax(logits[:, 0], -1))


@pytest.mark.parametrize("flat_index", [False, True])
def test_accept_plan(flat_index):
    gen = torch.Generator().manual_seed(11)
    bs, budget, depth = 5, 12, 4
    lp, ids = du.draft_topk_logprobs(torch.randn(bs, depth, 6, generator=gen), 6)
    tree = du.build_tree(lp, ids, budget)
    ct = du.compile_tree(
        tree, torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    )
    n = budget + 1
    cand = ct.draft_tokens.view(bs, n)
    # a target that agrees with the draft's first child at every node: long accepted paths
    predict = torch.where(
        ct.retrieve_next_token >= 0,
        cand.gather(1, ct.retrieve_next_token.clamp_min(0)),
        0,
    )
    predict[1] = -5  # request 1 accepts nothing
    acc, acc_len, _ = du.verify_greedy_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth
    )
    out_cache_loc = torch.randperm(1000, generator=gen)[: bs * n]
    given = (
        torch.where(acc >= 0, acc + torch.arange(bs).view(bs, 1) * n, -1)
        if flat_index
        else acc
    )
    plan = du.accept_plan(given, acc_len, out_cache_loc, flat_index=flat_index)
    rows = [
        b * n + i for b in range(bs) for i in acc[b, : int(acc_len[b]) + 1].tolist()
    ]
    assert plan.hidden_index.tolist() == rows
    assert plan.keep_slots.tolist() == [int(out_cache_loc[r]) for r in rows]
    assert plan.free_mask.tolist() == [r not in rows for r in range(bs * n)]
    assert plan.commit_lens.tolist() == (acc_len + 1).tolist()
    assert plan.last_node.tolist() == [int(acc[b, acc_len[b]]) for b in range(bs)]
    assert int(acc_len[1]) == 0 and int(acc_len.max()) >= 2


def test_tree_metrics():
    gen = torch.Generator().manual_seed(4)
    lp, ids = du.draft_topk_logprobs(torch.randn(3, 5, 4, generator=gen), 4)
    tree = du.build_tree(lp, ids, 10, valid=torch.tensor([True, False, True]))
    accept_len = torch.tensor([2, 0, 5])
    m = dr.tree_metrics(tree, accept_len)
    assert m["requests"] == 3
    assert m["mean_nodes"] == pytest.approx(tree.node_valid.sum().item() / 3)
    assert (
        m["accept_hist"][2] == 1
        and m["accept_hist"][0] == 1
        and m["accept_hist"][5] == 1
    )
    assert m["mean_accept_len"] == pytest.approx(7 / 3)
    assert m["mean_tokens_per_step"] == pytest.approx(10 / 3)
    widths = [
        float(((tree.depth == d) & tree.node_valid).sum()) / 3 for d in range(1, 6)
    ]
    assert m["width_per_depth"][: len(widths)] == pytest.approx(
        widths[: len(m["width_per_depth"])]
    )
    assert sum(m["width_per_depth"]) == pytest.approx(m["mean_nodes"])


def test_empty_batch_verify_and_plan():
    z = torch.zeros(0, 5, dtype=torch.int64)
    acc, acc_len, bonus = du.verify_greedy_reference(z, z, z, z, 4)
    assert acc.shape == (0, 5) and acc_len.shape == bonus.shape == (0,)
    acc, acc_len, bonus = dr.verify_sampling_reference(z, z, z, torch.zeros(0, 5, 3), 4)
    assert acc.shape == (0, 5)
    plan = du.accept_plan(acc, acc_len, torch.zeros(0, dtype=torch.int64))
    assert plan.keep_slots.numel() == 0 and plan.free_mask.numel() == 0
    assert (
        dr.tree_metrics(
            du.build_tree(
                torch.zeros(0, 2, 2), torch.zeros(0, 2, 2, dtype=torch.int64), 3
            )
        )["requests"]
        == 0
    )


def test_target_probs_top_p_counts_the_unrenormalised_mass():
    # probs 0.4/0.3/0.2/0.1, top_k=2, top_p=0.5: the joint rule keeps token 1 (0.4 < 0.5 lies
    # above it); top-k-then-renormalise (4/7 >= 0.5) would keep token 0 only
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    probs = dr.target_probs_from_logits(logits, 1.0, 2, 0.5)
    want = torch.tensor(python_filter(logits[0].tolist(), 1.0, 2, 0.5)).unsqueeze(0)
    assert torch.allclose(probs, want, atol=1e-6)
    assert (probs[0] > 0).tolist() == [True, True, False, False]
