"""The sampling cases and helpers that tests/test_ddtree_utils_sampling.py and
tests/sglang/test_sampler_vs_sglang.py share: per-request filter settings, a logits row, our
sampler's draws for one row, and the chi-square fit of counts against a distribution."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

import ddtree_utils as du

TOP_K_ALL = 1 << 30  # SGLang's stored "no top_k"

# (temperature, top_k, top_p, min_p): each filter alone, combinations, and the defaults
CASES = [
    (0.7, TOP_K_ALL, 1.0, 0.0),
    (1.0, 4, 1.0, 0.0),
    (0.8, TOP_K_ALL, 0.7, 0.0),
    (1.2, TOP_K_ALL, 1.0, 0.15),
    (0.9, 5, 0.8, 0.0),
    (0.6, 6, 0.9, 0.05),
    (1.5, TOP_K_ALL, 0.5, 0.0),
]


def row_logits(seed: int, vocab: int = 12) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5


def ours(logits_row, temp, top_k, top_p, min_p, n, seed, backend):
    """n draws of du.sample_from_logits for one row (every row the same parameters)."""
    logits = logits_row.unsqueeze(0).expand(n, -1)
    return du.sample_from_logits(
        logits,
        torch.full((n,), float(temp)),
        torch.full((n,), top_k, dtype=torch.int32),
        torch.full((n,), float(top_p)),
        torch.full((n,), float(min_p)),
        generator=torch.Generator().manual_seed(seed),
        backend=backend,
    )


def fits(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of counts against probs on the support (and no draw outside it)."""
    n = int(counts.sum())
    support = probs > 0
    assert counts[~support].sum() == 0, "a draw outside the kept set"
    want = probs[support].double()
    return chisquare(counts[support].double().numpy(), (want / want.sum() * n).numpy()).pvalue
