"""Draft top-k with full-vocabulary log-probabilities, single device and vocabulary-sharded."""

from __future__ import annotations

import math

import pytest
import torch

import ddtree_utils as du


def reference_topk(logits: torch.Tensor, k: int):
    """Plain float64 log_softmax + topk: the definition."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    vals, ids = torch.topk(logp, min(k, logits.shape[-1]), dim=-1)
    return vals, ids


@pytest.mark.parametrize("chunk", [3, 7, 64, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_log_softmax(chunk, dtype):
    logits = (
        torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(chunk)) * 4
    ).to(dtype)
    lp, ids = du.draft_topk_logprobs(logits, 6, chunk_size=chunk)
    want_lp, want_ids = reference_topk(logits, 6)
    assert (
        lp.dtype == torch.float32 and ids.dtype == torch.int64 and lp.shape == (3, 4, 6)
    )
    assert torch.equal(ids, want_ids)
    assert torch.allclose(lp.double(), want_lp, atol=1e-5)
    assert (lp[..., 1:] <= lp[..., :-1]).all() and (lp <= 0).all()


def test_k_larger_than_vocab_and_probability_one():
    lp, _ = du.draft_topk_logprobs(torch.tensor([[[2.0, -1.0, 0.5]]]), 10)
    assert lp.shape == (1, 1, 3)
    assert torch.allclose(lp.exp().sum(), torch.tensor(1.0))
    one, _ = du.draft_topk_logprobs(torch.full((1, 2, 1), 3.0), 4)
    assert torch.equal(
        one, torch.zeros(1, 2, 1)
    )  # exactly 0, not -0.0 or a rounding residue


def test_negative_infinity_logits():
    logits = torch.tensor([[[0.0, float("-inf"), 1.0], [float("-inf")] * 3]])
    lp, ids = du.draft_topk_logprobs(logits, 3, chunk_size=2)
    want, _ = reference_topk(logits[:, :1], 3)
    assert torch.allclose(lp[0, 0].double(), want[0, 0])
    assert math.isinf(lp[0, 0, 2]) and torch.isneginf(lp[0, 1]).all()
    tree = du.build_tree(lp, ids, 5)
    assert tree.node_valid[0].sum() == 2  # depth 2 has no token with probability > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_pos_inf_are_clear_errors(bad):
    logits = torch.randn(2, 3, 9)
    logits[1, 2, 4] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        du.draft_topk_logprobs(logits, 4)
    assert torch.isnan(logits).any() or torch.isinf(logits).any()  # input untouched


def test_empty_batch_and_bad_shapes():
    lp, ids = du.draft_topk_logprobs(torch.zeros(0, 15, 100), 8)
    assert lp.shape == ids.shape == (0, 15, 8)
    with pytest.raises(ValueError, match=r"\[bs, L, V\]"):
        du.draft_topk_logprobs(torch.zeros(15, 100), 8)
    with pytest.raises(ValueError, match="k must be"):
        du.draft_topk_logprobs(torch.zeros(1, 15, 100), 0)


@pytest.mark.parametrize("splits", [[50], [20, 30], [7, 13, 30], [2, 2, 46]])
@pytest.mark.parametrize("k", [1, 5, 12])
def test_shard_merge_equals_full_vocab(splits, k):
    gen = torch.Generator().manual_seed(sum(splits) * k + len(splits))
    logits = torch.randn(2, 3, sum(splits), generator=gen) * 3
    logits[0, 1, :25] = float("-inf")
    stats, offset = [], 0
    for width in splits:
        stats.append(
            du.shard_topk_stats(logits[..., offset : offset + width], k, offset)
        )
        offset += width
    ks = max(v.shape[-1] for v, _, _ in stats)
    pad = [  # shards narrower than k are padded to a common K, as an all_gather needs
        (
            torch.nn.functional.pad(v, (0, ks - v.shape[-1]), value=float("-inf")),
            torch.nn.functional.pad(i, (0, ks - i.shape[-1]), value=0),
            lse,
        )
        for v, i, lse in stats
    ]
    vals = torch.stack([p[0] for p in pad])
    ids = torch.stack([p[1] for p in pad])
    lse = torch.stack([p[2] for p in pad])
    lp, got_ids = du.merge_shard_topk(vals, ids, lse, k)
    want_lp, want_ids = du.draft_topk_logprobs(logits, k)
    assert torch.equal(got_ids, want_ids)
    assert torch.allclose(lp, want_lp, atol=1e-5)


def test_merge_rejects_nan():
    vals = torch.zeros(2, 1, 1, 3)
    ids = torch.zeros(2, 1, 1, 3, dtype=torch.int64)
    lse = torch.tensor([[[0.0]], [[float("nan")]]])
    with pytest.raises(ValueError, match="NaN"):
        du.merge_shard_topk(vals, ids, lse, 3)
