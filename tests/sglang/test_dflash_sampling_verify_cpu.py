"""Patches 0008 and 0009 on the real sglang 0.5.13.post1 package (CPU).

sgl_kernel's renorm and chain-sampling kernels are CUDA-only, so here they are replaced by
torch stand-ins with the same contracts (test doubles: the real kernels run in the GPU
matrix, tests/gpu/ddtree_e2e.py, mixed batch of DFLASH). What is tested is the patched
sglang code around them: which rows reach the kernels with which k, what greedy rows of a
mixed batch get, and that the warm-up calls both kernels once.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

TOP_K_ALL = 1 << 30


@pytest.fixture(scope="module")
def du(sglang_overlay):
    from sglang.srt.speculative import dflash_utils

    return dflash_utils


def _top_k_renorm(probs, top_k):  # stand-in: keep the k largest (k >= V keeps all), renormalise
    k = top_k.to(torch.int64).clamp(max=probs.shape[-1])
    order = probs.sort(dim=-1, descending=True)
    kth = order.values.gather(1, (k - 1).unsqueeze(1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def _top_p_renorm(probs, top_p):  # stand-in: smallest prefix of the sorted mass >= p
    vals, idx = probs.sort(dim=-1, descending=True)
    before = vals.cumsum(-1) - vals
    keep_sorted = before < top_p.unsqueeze(1)
    kept = torch.zeros_like(probs).scatter(1, idx, vals * keep_sorted)
    return kept / kept.sum(-1, keepdim=True)


def _chain_kernel(*, predicts, accept_index, accept_token_num, target_probs, **_):
    """Stand-in for tree_speculative_sampling_target_only: every draft rejected at depth 0,
    bonus = the most likely token of the first row's target distribution (enough here:
    the tests read the target probabilities the verify built)."""
    bs = target_probs.shape[0]
    accept_token_num.zero_()
    accept_index.fill_(-1)
    accept_index[:, 0] = torch.arange(bs) * target_probs.shape[1]
    predicts.zero_()
    predicts[accept_index[:, 0]] = target_probs[:, 0].argmax(-1).to(predicts.dtype)


@pytest.fixture
def kernels(du, monkeypatch):
    calls = []

    def rec(name, fn):
        def wrapped(probs, arg):
            calls.append((name, arg.clone()))
            return fn(probs, arg)

        return wrapped

    monkeypatch.setattr(du, "_DFLASH_SAMPLING_VERIFY_AVAILABLE", True)
    monkeypatch.setattr(du, "top_k_renorm_prob", rec("top_k", _top_k_renorm))
    monkeypatch.setattr(du, "top_p_renorm_prob", rec("top_p", _top_p_renorm))
    monkeypatch.setattr(du, "tree_speculative_sampling_target_only", _chain_kernel)
    return SimpleNamespace(calls=calls)


def _mixed_batch(vocab, draft, seed=0):
    """Rows 0, 2: greedy (top_k 1, T 1); rows 1, 3: T 0.7, top-p 0.9, no top_k. Logits with
    a tied maximum at two places in every row (tokens 3 and 7)."""
    g = torch.Generator().manual_seed(seed)
    bs = 4
    logits = torch.randn(bs * draft, vocab, generator=g)
    logits[:, 3] = logits[:, 7] = logits.max(-1).values + 1.0
    info = SimpleNamespace(
        temperatures=torch.tensor([1.0, 0.7, 1.0, 0.7]).unsqueeze(1),
        top_ks=torch.tensor([1, TOP_K_ALL, 1, TOP_K_ALL], dtype=torch.int32),
        top_ps=torch.tensor([1.0, 0.9, 1.0, 0.9]),
        need_top_k_sampling=True,
        need_top_p_sampling=True,
    )
    return logits, info, bs


def test_greedy_rows_of_a_mixed_batch_are_one_hot_first_argmax(du, kernels, monkeypatch):
    vocab, draft = 32, 4
    logits, info, bs = _mixed_batch(vocab, draft)
    built = {}
    real_zeros_like = torch.zeros_like

    def spy_zeros_like(t, *a, **k):  # draft_probs = zeros_like(target_probs): capture the latter
        if t.dim() == 3 and t.shape == (bs, draft, vocab):
            built["target_probs"] = t.clone()
        return real_zeros_like(t, *a, **k)

    monkeypatch.setattr(du.torch, "zeros_like", spy_zeros_like)
    du.compute_dflash_sampling_correct_drafts_and_bonus(
        candidates=torch.zeros(bs, draft, dtype=torch.int64),
        next_token_logits=logits,
        sampling_info=info,
        threshold_single=1.0,
        threshold_acc=1.0,
    )
    probs = built["target_probs"]
    # The dense path ran (max top_k = vocab): greedy rows reached top_k renorm with k = V, not 1.
    (name, ks), = [c for c in kernels.calls if c[0] == "top_k"]
    row_k = ks.view(bs, draft)
    assert (row_k[[0, 2]] == vocab).all() and (row_k[[1, 3]] == TOP_K_ALL).all()
    first_argmax = logits.view(bs, draft, vocab).argmax(-1)
    for r in (0, 2):  # greedy: exactly one token, the first of the tied maximum (index 3)
        assert torch.equal(probs[r], torch.nn.functional.one_hot(first_argmax[r], vocab).float())
        assert (first_argmax[r] == 3).all()
    for r in (1, 3):  # sampled: the reference top-p 0.9 distribution at T 0.7, unchanged
        ref = torch.softmax(logits.view(bs, draft, vocab)[r] / 0.7, -1)
        ref = _top_p_renorm(ref, torch.full((draft,), 0.9))
        torch.testing.assert_close(probs[r], ref)
        assert (probs[r] > 0).sum(-1).min() >= 2  # both tied maxima kept


def test_greedy_rows_left_in_a_sampled_batch_are_verified_greedily(du, kernels):
    """A mixed batch whose sampled requests finished keeps need_top_p_sampling and
    is_all_greedy = False (filter_batch does not recompute them), so its greedy rows alone
    reach the sampling verify. They get the greedy verify's accept lengths and bonus
    tokens, and no renorm kernel is called (the sparse path's one-column top-p renorm is
    the case that did not return on the device)."""
    vocab, draft, bs = 32, 5, 3
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(bs * draft, vocab, generator=g)
    target = logits.argmax(-1).view(bs, draft)
    candidates = torch.randint(0, vocab, (bs, draft), generator=g)
    candidates[0, 1:] = target[0, :-1]  # row 0: every draft right
    candidates[1, 1:3] = target[1, :2]  # row 1: two right, then (likely) wrong
    candidates[1, 3] = (target[1, 2] + 1) % vocab
    info = SimpleNamespace(
        temperatures=torch.ones(bs, 1),
        top_ks=torch.ones(bs, dtype=torch.int32),
        top_ps=torch.ones(bs),
        is_all_greedy=False,
        need_top_k_sampling=True,
        need_top_p_sampling=True,
    )
    got = du.compute_dflash_sampling_correct_drafts_and_bonus(
        candidates=candidates,
        next_token_logits=logits,
        sampling_info=info,
        threshold_single=1.0,
        threshold_acc=1.0,
    )
    want = du.compute_dflash_correct_drafts_and_bonus(
        candidates=candidates, target_predict=target
    )
    assert kernels.calls == []
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].tolist()[:2] == [draft - 1, 2]
    assert got[1][0] == target[0, -1] and got[1][1] == target[1, 2]


def test_warm_up_runs_both_renorm_kernels_once(du, kernels):
    seconds = du.warm_up_dflash_sampling_kernels(torch.device("cpu"))
    assert seconds is not None and seconds >= 0
    assert [name for name, _ in kernels.calls] == ["top_k", "top_p"]
    assert kernels.calls[0][1].tolist() == [2]  # k = 2 of 2: no k = 1 pivot search on a tie


def test_warm_up_is_a_no_op_without_the_sampling_verify(du, monkeypatch):
    monkeypatch.setattr(du, "_DFLASH_SAMPLING_VERIFY_AVAILABLE", False)
    monkeypatch.setattr(du, "top_k_renorm_prob", None)
    assert du.warm_up_dflash_sampling_kernels(torch.device("cpu")) is None


@pytest.mark.parametrize(
    "algorithm, backend, warmed",
    [("DFLASH", "pytorch", True), ("DFLASH", "flashinfer", True),
     ("DDTREE", "flashinfer", True), ("DDTREE", "pytorch", False)],
)
def test_worker_warms_up_where_a_flashinfer_sampling_call_can_come(
    sglang_overlay, monkeypatch, algorithm, backend, warmed
):
    """DFlashWorker.__init__ (DDTreeWorker inherits it) calls the warm-up for DFLASH, whose
    verify calls the kernels whatever the sampling backend, and for any algorithm when the
    sampler itself is flashinfer's; stopped right after that point."""
    from sglang.srt.speculative import dflash_worker

    seen = []

    class Stop(Exception):
        pass

    def fake_warm(device):
        seen.append(device)
        return 0.0

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(dflash_worker, "warm_up_dflash_sampling_kernels", fake_warm)
    monkeypatch.setattr(dflash_worker.DFlashWorker, "_maybe_warn_sampling_fallback", stop, raising=False)
    server_args = SimpleNamespace(
        speculative_algorithm=algorithm,
        sampling_backend=backend,
        page_size=1,
        speculative_draft_window_size=None,
    )
    target = SimpleNamespace(model_runner=SimpleNamespace(), device="cpu")
    worker = dflash_worker.DFlashWorker.__new__(dflash_worker.DFlashWorker)
    # Run __init__ until its first use of an attribute the namespace lacks (after the warm-up).
    with pytest.raises((AttributeError, Stop, TypeError)):
        dflash_worker.DFlashWorker.__init__(worker, server_args, 0, 0, None, 0, 0, 0, 0, target)
    assert worker.device == "cpu"  # __init__ got past the warm-up's place
    assert seen == (["cpu"] if warmed else [])
