"""Our sampling rule against SGLang's own plain sampler, ``top_k_top_p_min_p_sampling_from_probs_torch``
(its pytorch backend; the flashinfer backend applies the same joint rule, docs/DDTREE.md), fed
with probabilities computed the way ``Sampler.forward`` does (``logits / temperature``, then
softmax). Here, not in tests/test_ddtree_utils_sampling.py, because the sampler is imported from
sglang in-process: that must go through the sglang_overlay fixture (neither pin's series changes
layers/sampler.py, so the overlay's sampler is the installed one)."""

from __future__ import annotations

import pytest
import torch
from sampling_cases import CASES, fits, ours, row_logits

import ddtree_reference as dr


@pytest.fixture(scope="module")
def sglang_sampler(sglang_overlay):
    from sglang.srt.layers import sampler

    return sampler.top_k_top_p_min_p_sampling_from_probs_torch


def sglang_draws(fn, logits_row, temp, top_k, top_p, min_p, n, seed):
    """n draws from SGLang's real pytorch-backend sampler `fn` for one row of logits."""
    logits = logits_row.float().unsqueeze(0).repeat(n, 1)
    temps = torch.full((n, 1), float(temp))
    probs = torch.softmax(logits / temps, dim=-1)  # Sampler.forward: div_, then softmax
    torch.manual_seed(seed)  # the function draws with torch.multinomial's global generator
    ids = fn(
        probs,
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), float(top_p)),
        torch.full((n,), float(min_p)),
        min_p > 0,
        None,
        torch.zeros(n, dtype=torch.int64),
    )
    return ids.long()


@pytest.mark.stat
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_sglang_sampler(case, sglang_sampler):
    """The dense reference is SGLang's plain sampler's distribution (chi-square, 30k draws)."""
    temp, top_k, top_p, min_p = case
    x = row_logits(hash(case) % 1000)
    want = dr.target_probs_from_logits(x.unsqueeze(0), temp, top_k, top_p, min_p)[0]
    draws = sglang_draws(sglang_sampler, x, temp, top_k, top_p, min_p, 30000, seed=1)
    counts = torch.bincount(draws, minlength=x.numel())
    assert fits(counts, want) > 1e-3
    # SGLang draws every token that the reference keeps with a sizeable expected count
    assert bool((counts > 0)[want * 30000 >= 20].all())


@pytest.mark.stat
def test_sampler_against_sglang_directly(sglang_sampler):
    """Two-sample chi-square: our draws and SGLang's for the same row and parameters."""
    from scipy.stats import chi2

    x = row_logits(7, vocab=20)
    for temp, top_k, top_p, min_p in CASES:
        a = torch.bincount(sglang_draws(sglang_sampler, x, temp, top_k, top_p, min_p, 20000, 3), minlength=20)
        b = torch.bincount(ours(x, temp, top_k, top_p, min_p, 20000, 4, "torch"), minlength=20)
        used = (a + b) > 0
        table = torch.stack([a[used], b[used]]).double()
        expect = table.sum(0, keepdim=True) * table.sum(1, keepdim=True) / table.sum()
        stat = ((table - expect) ** 2 / expect).sum()
        assert chi2.sf(float(stat), int(used.sum()) - 1) > 1e-3, (temp, top_k, top_p, min_p)


def test_joint_rule_is_not_top_k_then_top_p(sglang_sampler):
    """top-p counts the mass on the original distribution (joint), not after top-k renormalising:
    the two orders keep different sets here, and SGLang's sampler keeps the joint one."""
    x = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    joint = dr.target_probs_from_logits(x.unsqueeze(0), 1.0, 2, 0.5)[0]
    # sequential would renormalise the top-2 (0.4/0.7 = 0.57 >= 0.5) and keep only token 0
    assert (joint > 0).tolist() == [True, True, False, False]
    draws = sglang_draws(sglang_sampler, x, 1.0, 2, 0.5, 0.0, 4000, seed=5)
    assert set(draws.tolist()) == {0, 1}
