"""Patch 0007 of the 0.5.16 series on the real sglang 0.5.16 modules (CPU, child Python of
test_v2_pin.py): DFLASH's sampling verify on a mixed greedy + sampled batch, and the start-up
build of the renorm kernels.

sgl_kernel's renorm kernels are CUDA-only; torch stand-ins with the same contract replace them
here (test doubles; the real kernels run in the GPU matrix's DFLASH mixed batch,
tests/gpu/ddtree_e2e.py). What is tested is the patched sglang code around them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

TOP_K_ALL = 1 << 30


def _top_k_renorm(probs, top_k):  # keep the k largest (k >= V keeps all), renormalise
    k = top_k.to(torch.int64).clamp(max=probs.shape[-1])
    kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def _top_p_renorm(probs, top_p):  # smallest prefix of the sorted mass reaching p
    vals, idx = probs.sort(dim=-1, descending=True)
    keep = (vals.cumsum(-1) - vals) < top_p.unsqueeze(1)
    kept = torch.zeros_like(probs).scatter(1, idx, vals * keep)
    return kept / kept.sum(-1, keepdim=True)


@pytest.fixture
def du(monkeypatch):
    from sglang.srt.speculative import dflash_utils

    calls = []

    def rec(name, fn):
        def wrapped(probs, arg):
            calls.append((name, arg.clone()))
            return fn(probs, arg)

        return wrapped

    monkeypatch.setattr(dflash_utils, "_DFLASH_SAMPLING_VERIFY_AVAILABLE", True)
    monkeypatch.setattr(dflash_utils, "top_k_renorm_prob", rec("top_k", _top_k_renorm))
    monkeypatch.setattr(dflash_utils, "top_p_renorm_prob", rec("top_p", _top_p_renorm))
    return SimpleNamespace(m=dflash_utils, calls=calls)


def test_greedy_rows_of_a_mixed_batch_are_one_hot_first_argmax(du):
    vocab, draft, bs = 32, 4, 4
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(bs * draft, vocab, generator=g)
    logits[:, 3] = logits[:, 7] = logits.max(-1).values + 1.0  # a tied maximum in every row
    info = SimpleNamespace(  # rows 0, 2 greedy (top_k 1, T 1); rows 1, 3 T 0.7 / top-p 0.9
        temperatures=torch.tensor([1.0, 0.7, 1.0, 0.7]).unsqueeze(1),
        top_ks=torch.tensor([1, TOP_K_ALL, 1, TOP_K_ALL], dtype=torch.int32),
        top_ps=torch.tensor([1.0, 0.9, 1.0, 0.9]),
        need_top_k_sampling=True,
        need_top_p_sampling=True,
    )
    probs = du.m.build_dflash_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=draft, bs=bs
    )
    (name, ks), = [c for c in du.calls if c[0] == "top_k"]  # the dense path ran
    row_k = ks.view(bs, draft)
    assert (row_k[[0, 2]] == vocab).all() and (row_k[[1, 3]] == TOP_K_ALL).all()
    for r in (0, 2):
        first = logits.view(bs, draft, vocab)[r].argmax(-1)
        assert (first == 3).all()
        assert torch.equal(probs[r], torch.nn.functional.one_hot(first, vocab).float())
    for r in (1, 3):
        ref = _top_p_renorm(torch.softmax(logits.view(bs, draft, vocab)[r] / 0.7, -1),
                            torch.full((draft,), 0.9))
        torch.testing.assert_close(probs[r], ref)


def test_warm_up_runs_both_renorm_kernels_once(du):
    assert du.m.warm_up_dflash_sampling_kernels(torch.device("cpu")) >= 0
    assert [n for n, _ in du.calls] == ["top_k", "top_p"]
    assert du.calls[0][1].tolist() == [2]


@pytest.mark.parametrize(
    "algorithm, backend, warmed",
    [("DFLASH", "pytorch", True), ("DDTREE", "flashinfer", True), ("DDTREE", "pytorch", False)],
)
def test_v2_worker_warms_up_where_a_flashinfer_sampling_call_can_come(
    monkeypatch, algorithm, backend, warmed
):
    """DFlashWorkerV2.__init__ (DDTreeWorkerV2 inherits it), run until it first needs what the
    stand-in arguments lack, which is after the warm-up's place."""
    from sglang.srt.speculative import dflash_worker_v2 as w

    seen = []
    monkeypatch.setattr(w, "warm_up_dflash_sampling_kernels", lambda d: seen.append(d) or 0.0)
    server_args = SimpleNamespace(
        speculative_algorithm=algorithm,
        sampling_backend=backend,
        page_size=1,
        speculative_draft_window_size=None,
    )
    target = SimpleNamespace(model_runner=SimpleNamespace(), device="cpu")
    worker = w.DFlashWorkerV2.__new__(w.DFlashWorkerV2)
    with pytest.raises((AttributeError, TypeError)):
        w.DFlashWorkerV2.__init__(worker, server_args, 0, None, 0, target)
    assert worker.device == "cpu"
    assert seen == (["cpu"] if warmed else [])
