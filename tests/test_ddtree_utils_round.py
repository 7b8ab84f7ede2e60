"""ddtree_utils' sync-free round pieces (tree_custom_mask_index, tree_commit_layout) against the
references: tree_custom_mask (FULL mask built from host lengths) and verify_greedy_reference
(the accepted path walked on the host)."""

from __future__ import annotations

import torch

import ddtree_reference as dr
import ddtree_utils as du


def _random_round(seed: int, bs: int = 5, depth: int = 6, k: int = 3, budget: int = 11):
    """A tree per request from random draft log-probs, and target predictions that follow a
    random child most of the time (so paths of every length occur)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, depth, 40, generator=g)
    logp, ids = du.draft_topk_logprobs(logits, k, backend="torch")
    tree = dr.build_tree_reference(logp, ids, budget)
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


def _kv_move_case(seed: int, bs: int = 4, depth: int = 6, n: int = 12):
    """Per-layer caches (K, V and a per-slot scale buffer, different row sizes) and the DDTREE
    move of a round: the accepted path's KV onto the committed slots slots[:, :depth + 1], whose
    sources are other verify slots of the same request (sources and targets overlap)."""
    g = torch.Generator().manual_seed(seed)
    slots_total = 8 + bs * (n + depth + 1)
    buffers = [torch.randn(slots_total, 2, 8, generator=g).to(torch.bfloat16) for _ in range(4)]
    buffers.append(torch.randn(slots_total, 3, generator=g))
    perm = torch.randperm(slots_total - 8, generator=g)[: bs * n] + 8  # requests own their slots
    slots = perm.view(bs, n)
    path = torch.zeros(bs, depth + 1, dtype=torch.int64)
    for b in range(bs):  # a root-to-node path: strictly increasing verify indices, root first
        a = int(torch.randint(0, depth + 1, (), generator=g))
        path[b, 1 : a + 1] = torch.sort(torch.randperm(n - 1, generator=g)[:a] + 1).values
    return buffers, slots[:, : depth + 1], slots.gather(1, path)


def test_move_kv_rows_moves_the_path_onto_the_committed_slots():
    for seed in range(6):
        for backend in ("triton", "torch"):
            buffers, tgt, src = _kv_move_case(seed)
            want = [b.clone() for b in buffers]
            for w, b in zip(want, buffers):  # what every committed slot must hold afterwards
                w[tgt.reshape(-1)] = b[src.reshape(-1)]
            rows = du.kv_rows(buffers)
            assert rows.row_bytes.tolist() == [32, 32, 32, 32, 12] and rows.max_row_bytes == 32
            du.move_kv_rows(rows, tgt, src, backend=backend)
            for w, b in zip(want, buffers):
                assert torch.equal(w, b), (seed, backend)


def test_move_kv_rows_overlapping_path_reads_before_writes():
    # request 0 moves node 2 -> slot 1 and node 1 -> slot 3 (slot 1 is a target and a source)
    buf = torch.arange(16 * 4, dtype=torch.float32).view(16, 4)
    before = buf.clone()
    tgt = torch.tensor([[0, 1, 2, 3]])
    src = torch.tensor([[0, 2, 5, 1]])
    du.move_kv_rows(du.kv_rows([buf]), tgt, src, backend="triton")
    assert buf[1].tolist() == before[2].tolist() and buf[3].tolist() == before[1].tolist()
    assert buf[2].tolist() == before[5].tolist() and torch.equal(buf[4:], before[4:])


def test_kv_rows_refuses_rows_that_are_not_contiguous_and_bad_shapes():
    assert du.kv_rows([torch.zeros(8, 4, 2).transpose(1, 2)]) is None
    assert du.kv_rows([torch.zeros(8, 4)[:, :2]]) is None
    assert du.kv_rows([]) is None
    rows = du.kv_rows([torch.zeros(8, 4)])
    try:
        du.move_kv_rows(rows, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64))
    except ValueError as e:
        assert "must be [bs, K]" in str(e)
    else:
        raise AssertionError("mismatched shapes were accepted")


def test_verify_slots_accept_and_kv_locations_of_a_round():
    """The round pieces in the worker's order on random trees: verify_slots reads each request's
    req_to_token row from its prefix; accept_tree_greedy without a kernel is the reference walk;
    kv_path_locs moves the path's slots onto the committed ones, and kv_move_locs does the same
    in two copies through the staging slots, each copy with disjoint targets and sources."""
    for seed in range(6):
        _, ct, cand, predict, seq_lens, depth = _random_round(seed)
        bs, n = cand.shape
        width = n + depth + 1
        g = torch.Generator().manual_seed(100 + seed)
        req_to_token = torch.randperm(64 * 128, generator=g).view(64, 128).to(torch.int32)
        rows = torch.randperm(64, generator=g)[:bs]
        slots = du.verify_slots(req_to_token, rows, seq_lens, width)
        for b in range(bs):
            p = int(seq_lens[b])
            assert slots[b].tolist() == req_to_token[rows[b], p : p + width].tolist()
        index = torch.arange(bs * n).view(bs, n)
        got = du.accept_tree_greedy(cand, predict, index, ct.retrieve_next_token, ct.retrieve_next_sibling, depth)
        want = du.verify_greedy_reference(cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth)
        assert all(torch.equal(a, w) for a, w in zip(got, want))
        _, commit, path = du.tree_commit_layout(*got, cand, depth + 1)
        kv = torch.full((64 * 128,), -1, dtype=torch.int64)
        for b in range(bs):
            kv[slots[b, :n]] = b * 1000 + torch.arange(n)
        one = kv.clone()
        tgt, src = du.kv_path_locs(slots, path, n, depth)
        one[tgt.reshape(-1)] = kv[src.reshape(-1)]  # all reads before the writes (move_kv_rows)
        two = kv.clone()
        for tgt2, src2 in du.kv_move_locs(slots, path, n, depth):
            assert not set(tgt2.tolist()) & set(src2.tolist())
            two[tgt2] = two[src2].clone()
        for b in range(bs):
            c = int(commit[b])
            expect = [b * 1000 + int(j) for j in got[0][b, :c]]
            assert one[slots[b, :c]].tolist() == expect and two[slots[b, :c]].tolist() == expect
