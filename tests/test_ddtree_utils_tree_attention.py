"""ddtree_utils.tree_verify_attention (split-KV prefix + masked tree block + log-sum-exp merge) in
Triton's interpreter against tree_verify_attention_reference (float32, request by request).

The interpreter's tl.dot is wrong for bfloat16 operands (checked with Triton 3.8: errors of 1e10
on a plain 16 x 16 product), so the CPU runs use float32 and float16; bfloat16, the serving
dtype, is checked on the GPU (tests/gpu/test_v2_round_cuda.py)."""

from __future__ import annotations

import pytest
import torch

import ddtree_reference as dr
import ddtree_utils as du


def _case(seed, *, plens, n, hq, hkv, d, dtype, tree_from_ddtree=True):
    g = torch.Generator().manual_seed(seed)
    bs, slots = len(plens), 8 + sum(plens) + 64
    kb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    vb = torch.randn(slots, hkv, d, generator=g).to(dtype)
    indptr = torch.tensor([0, *torch.tensor(plens).cumsum(0).tolist()], dtype=torch.int32)
    indices = (torch.randperm(slots - 8, generator=g)[: int(indptr[-1])] + 8).to(torch.int64)
    q = (torch.randn(bs * n, hq, d, generator=g) * 2).to(dtype)
    kt = torch.randn(bs * n, hkv, d, generator=g).to(dtype)
    vt = torch.randn(bs * n, hkv, d, generator=g).to(dtype)
    if tree_from_ddtree and n > 1:  # a real ancestor mask: a DDTree from random draft logits
        logits = torch.randn(bs, min(n - 1, 6), 9, generator=g) * 3
        lp, ids = du.draft_topk_logprobs(logits, 4, backend="torch")
        tree = dr.build_tree_reference(lp, ids, n - 1)
        zeros = torch.zeros(bs, dtype=torch.int64)
        tree_mask = du.compile_tree(tree, zeros, zeros, backend="torch").tree_mask
    else:
        tree_mask = torch.ones(bs, n, n, dtype=torch.bool).tril()
    full = du.tree_custom_mask(tree_mask, plens)
    sizes = [(p + n) * n for p in plens]
    mask_indptr = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    return q, kb, vb, indptr, indices, kt, vt, full, mask_indptr


@pytest.mark.parametrize(
    "plens,n,hq,hkv,d,splits",
    [
        ((0, 7, 70), 5, 4, 2, 16, 3),  # an empty prefix; splits longer and shorter than a step
        ((130, 3), 16, 8, 2, 32, 4),  # N x G = 64 rows: one full row block
        ((65, 200), 24, 4, 1, 16, 2),  # 96 rows: two row blocks, the second half empty
        ((9,), 1, 2, 2, 8, 1),  # budget 0: the root only
        ((33, 1, 140), 6, 6, 3, 24, 5),  # head dim 24 (padded to 32), 5 splits
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [None, 16])  # the shipped choice; 16-row programs everywhere
def test_tree_verify_attention_equals_the_reference(plens, n, hq, hkv, d, splits, dtype, rows, monkeypatch):
    if rows is not None:
        monkeypatch.setattr(du, "_TREE_ATTN_ROWS", rows)
        monkeypatch.setattr(du, "_TREE_ATTN_ROWS_SMALL", rows)
    args = _case(sum(plens) + n, plens=plens, n=n, hq=hq, hkv=hkv, d=d, dtype=dtype)
    want = dr.tree_verify_attention_reference(*args, n, 0.37)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    # every split used (1 key a split at least), then splits of at least 32 keys: the short
    # prefixes use fewer than `splits`, the idle programs return and the merge skips their slots
    for min_keys in (1, 32):
        got = du.tree_verify_attention(*args, n, 0.37, splits=splits, min_split_keys=min_keys)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the default split count, and writing into a given output
    out = torch.full_like(want, float("nan"))
    du.tree_verify_attention(*args, n, 0.37, out=out)
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


def test_the_mask_decides_and_its_prefix_part_is_not_read():
    plens, n = (40, 12), 8
    q, kb, vb, indptr, indices, kt, vt, full, mask_indptr = _case(
        3, plens=plens, n=n, hq=4, hkv=2, d=16, dtype=torch.float32
    )
    base = du.tree_verify_attention(q, kb, vb, indptr, indices, kt, vt, full, mask_indptr, n, 0.5)
    # every node sees the whole prefix: False written over the prefix entries changes nothing
    holes = full.clone()
    for b, p in enumerate(plens):
        for i in range(n):
            start = int(mask_indptr[b]) + i * (p + n)
            holes[start : start + p] = False
    same = du.tree_verify_attention(q, kb, vb, indptr, indices, kt, vt, holes, mask_indptr, n, 0.5)
    assert torch.equal(base, same)
    # a node that sees one more tree token gets a different output (the tree part is read)
    more = full.clone()
    p = plens[1]
    row = int(mask_indptr[1]) + 2 * (p + n) + p  # request 1, node 2
    blocked = [j for j in range(n) if not bool(full[row + j])]
    assert blocked, "node 2 of request 1 sees every tree token; pick another node"
    more[row + blocked[0]] = True
    diff = du.tree_verify_attention(q, kb, vb, indptr, indices, kt, vt, more, mask_indptr, n, 0.5)
    changed = (diff != base).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [n + 2]


def test_a_short_prefix_uses_fewer_splits_and_leaves_the_others_unwritten(monkeypatch):
    """The prefix kernel writes only the splits the prefix needs (min_split_keys each): the
    workspace slots of the others keep what was there, and the result still equals the
    reference (the merge reads only the written ones)."""
    plens, n, splits = (0, 40, 100), 3, 4
    args = _case(11, plens=plens, n=n, hq=2, hkv=1, d=16, dtype=torch.float32)
    want = dr.tree_verify_attention_reference(*args, n, 0.5)
    made = []
    real_empty = torch.empty

    def poisoned(*shape, **kw):  # the workspaces start as NaN, so a stale slot read would show
        t = real_empty(*shape, **kw)
        if t.dtype == torch.float32 and len(t.shape) >= 5:
            t.fill_(float("nan"))
            made.append(t)
        return t

    monkeypatch.setattr(du.torch, "empty", poisoned)
    got = du.tree_verify_attention(*args, n, 0.5, splits=splits, min_split_keys=32)
    monkeypatch.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ws_lse = made[1]  # [bs, Hkv, RB, S, rows]
    written = ~torch.isnan(ws_lse[:, 0, 0, :, 0])
    # 0 keys: no split; 40 keys: ceil(40 / 32) = 2 splits of 32 + 8; 100: 4 splits of 32 + 4
    assert written.tolist() == [[False] * 4, [True, True, False, False], [True] * 4]
    untouched = torch.full_like(want, 7.0)
    with pytest.raises(ValueError, match="min_split_keys=0: give 1 or more"):
        du.tree_verify_attention(*args, n, 0.5, out=untouched, min_split_keys=0)
    assert torch.equal(untouched, torch.full_like(want, 7.0))


def test_splits_fill_the_device_and_refusals():
    assert du.tree_verify_splits(1, 8, 1, torch.device("cpu")) == 2  # 16 programs for 8 "SMs"
    assert du.tree_verify_splits(64, 8, 4, torch.device("cpu")) == 1
    # rows per program: the small blocks while the programs are at most half the 8 "SMs"
    cpu = torch.device("cpu")
    assert du.tree_verify_rows(1, 2, 64, cpu) == du._TREE_ATTN_ROWS_SMALL  # 2 programs
    assert du.tree_verify_rows(1, 2, 256, cpu) == du._TREE_ATTN_ROWS  # 8 programs
    assert du.tree_verify_rows(4, 1, 64, cpu) == du._TREE_ATTN_ROWS_SMALL
    assert du.tree_verify_rows(5, 1, 64, cpu) == du._TREE_ATTN_ROWS
    q, kb, vb, indptr, indices, kt, vt, full, mask_indptr = _case(
        1, plens=(5, 6), n=4, hq=4, hkv=2, d=8, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="do not fit"):
        du.tree_verify_attention(q[:-1], kb, vb, indptr, indices, kt, vt, full, mask_indptr, 4, 1.0)
