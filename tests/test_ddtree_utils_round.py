"""ddtree_utils' sync-free round pieces (tree_custom_mask_index, tree_commit_layout) against the
references: tree_custom_mask (FULL mask built from host lengths) and verify_greedy_reference
(the accepted path walked on the host)."""

from __future__ import annotations

import torch

import ddtree_utils as du


def _random_round(seed: int, bs: int = 5, depth: int = 6, k: int = 3, budget: int = 11):
    """A tree per request from random draft log-probs, and target predictions that follow a
    random child most of the time (so paths of every length occur)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, 40, generator=g)
    logp, ids = du.draft_topk_logprobs(logits, k, backend="torch")
    tree = du.build_tree_reference(logp, ids, budget)
    bonus = torch.randint(0, 40, (bs,), generator=g)
    seq_lens = torch.randint(0, 30, (bs,), generator=g)
    ct = du.compile_tree(tree, bonus, seq_lens, build_custom_mask=False, max_depth=depth, backend="torch")
    n = budget + 1
    cand = ct.draft_tokens.view(bs, n)
    predict = torch.randint(0, 40, (bs, n), generator=g)
    for b in range(bs):
        for i in range(n):
            child = int(ct.retrieve_next_token[b, i])
            if child >= 0 and torch.rand((), generator=g) < 0.8:
                predict[b, i] = cand[b, child]
    return tree, ct, cand, predict, seq_lens, depth


def test_tree_custom_mask_index_matches_the_full_mask():
    for seed in range(6):
        _, ct, _, _, seq_lens, _ = _random_round(seed)
        n = ct.tree_mask.shape[1]
        want = du.tree_custom_mask(ct.tree_mask, seq_lens.tolist())
        index = du.tree_custom_mask_index(seq_lens, n)
        buf = torch.ones(want.numel() + 17, dtype=torch.bool)  # longer than needed, as in serving
        buf[index.reshape(-1)] = ct.tree_mask.reshape(-1)
        assert torch.equal(buf[: want.numel()], want)
        assert bool(buf[want.numel():].all())
        du.restore_true_mask(buf, index)  # restoring the all-True invariant
        assert bool(buf.all())


def test_tree_commit_layout_follows_the_accepted_path():
    width = 8
    for seed in range(10):
        _, ct, cand, predict, _, depth = _random_round(seed)
        acc_idx, acc_len, bonus = du.verify_greedy_reference(
            cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth
        )
        out, commit, path = du.tree_commit_layout(acc_idx, acc_len, bonus, cand, width)
        assert out.shape == (cand.shape[0], width) and path.shape == out.shape
        for b in range(cand.shape[0]):
            nodes = [int(x) for x in acc_idx[b] if int(x) >= 0]
            a = int(acc_len[b])
            assert len(nodes) == a + 1 and nodes[0] == 0
            # the tokens a target-only decode would emit: the accepted drafts, then the bonus
            emitted = [int(cand[b, j]) for j in nodes[1:]] + [int(bonus[b])]
            assert out[b, : a + 1].tolist() == emitted
            assert out[b, a + 1 :].tolist() == [0] * (width - a - 1)
            assert int(commit[b]) == a + 1 and commit.dtype == torch.int32
            assert path[b, : a + 1].tolist() == nodes
            assert path[b, a + 1 :].tolist() == [0] * (width - a - 1)
            # every emitted token is the target's choice after the previous one
            assert all(int(predict[b, p]) == t for p, t in zip(nodes, emitted))


def test_tree_commit_layout_refuses_a_too_narrow_row():
    _, ct, cand, predict, _, depth = _random_round(0)
    acc_idx, acc_len, bonus = du.verify_greedy_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth
    )
    try:
        du.tree_commit_layout(acc_idx, acc_len, bonus, cand, depth)
    except ValueError as e:
        assert "columns for rows of width" in str(e)
    else:
        raise AssertionError("a row narrower than the accepted path was accepted")
