"""ddtree_utils' serving limits: the numbers the patches derive from the budget and memory.

Each expectation is recomputed from the rule it documents (a round replayed step by step, the
bytes a verify forward holds), never pasted from a run.
"""

from __future__ import annotations

import pytest

import ddtree_utils as du

BLOCK = 16
QWEN3_8B_VOCAB = 151936


def _round_peak(block: int, budget: int) -> int:
    """Slots held at the peak of a v1 round: draft block in, draft block out, tree in."""
    held = peak = 0
    for step in (+block, -block, +(budget + 1)):
        held += step
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("budget", [1, 15, 63, 255, 1023])
@pytest.mark.parametrize("block", [2, 8, 16])
def test_reservation_is_the_round_peak(budget, block):
    steps, topk = du.spec_steps_and_topk(budget, block)
    assert topk > 1  # fa3 / Mamba tree paths
    # SGLang's v1 per-request reservation at page size 1.
    assert max(steps * topk, budget + 1) == _round_peak(block, budget)
    assert du.decode_kv_reservation(budget, block) == _round_peak(block, budget)


def test_old_rule_reserved_about_twice_at_budget_15():
    # The previous derivation max(2, ceil(max(block, N) / num_steps)) with num_steps = 15
    # reserved 30 slots at budget 15 for a peak of 16; the new one reserves the peak.
    steps, topk = du.spec_steps_and_topk(15, BLOCK)
    assert max(steps * topk, 16) == 16 == _round_peak(BLOCK, 15)


@pytest.mark.parametrize("budget", [1, 15, 63, 255, 1023])
def test_accept_depth_is_capped_by_the_block(budget):
    assert du.max_accept_depth(budget, BLOCK) == min(budget, BLOCK - 1)


@pytest.mark.parametrize("free_gib", [0.5, 4, 15, 80])
@pytest.mark.parametrize("budget", [15, 63, 255, 1023])
def test_verify_limit_keeps_every_forward_within_memory(free_gib, budget):
    free = int(free_gib * (1 << 30))
    extra = 2 * 4096 * 5  # bf16 hidden rows of 5 target layers (Qwen3-8B shape)
    chunk = 8192
    limit = du.verify_token_limit(free, QWEN3_8B_VOCAB, chunk, extra)
    per_token = 4 * QWEN3_8B_VOCAB * (1 + du.VERIFY_SAMPLING_WORKSPACE_ROWS) + extra
    # The logits, the sampler workspace and the hidden rows of `limit` tokens fit the share.
    assert 1 <= limit <= chunk
    assert limit == 1 or limit * per_token <= free * du.VERIFY_LOGITS_MEMORY_SHARE
    # ...and the limit is the largest such count (unless the chunk size bounds it).
    assert limit == chunk or (limit + 1) * per_token > free * du.VERIFY_LOGITS_MEMORY_SHARE
    for requested in (1, 16, 48, 256):
        cap = du.verify_max_running_requests(limit, budget, BLOCK, requested)
        width = max(BLOCK, budget + 1)
        assert 1 <= cap <= requested
        assert cap == 1 or cap * width <= limit  # the largest forward of a round fits
        assert cap == requested or (cap + 1) * width > limit  # nothing is given away


def test_issue_shape_numbers():
    """At the issue's shape (H200, mem-fraction 0.85: ~15 GiB left after startup) the rule
    keeps 32 x 64 verify tokens (budget 63) and caps budget 255 below 48 requests."""
    free = 15 << 30
    limit = du.verify_token_limit(free, QWEN3_8B_VOCAB, 8192, 2 * 4096 * 5)
    assert du.verify_max_running_requests(limit, 63, BLOCK, 48) * 64 <= limit
    assert du.verify_max_running_requests(limit, 63, BLOCK, 32) == 32
    assert du.verify_max_running_requests(limit, 255, BLOCK, 48) < 48


@pytest.mark.parametrize(("bs", "want"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, None)])
def test_graph_batch_size(bs, want):
    assert du.graph_batch_size(bs, [1, 2, 4, 8, 16]) == want
    assert du.graph_batch_size(bs, []) is None


@pytest.mark.parametrize(
    ("params", "name"),
    [
        (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
        (dict(frequency_penalty=0.5), "frequency_penalty=0.5"),
        (dict(presence_penalty=-0.2), "presence_penalty=-0.2"),
        (dict(min_new_tokens=4), "min_new_tokens=4"),
        (dict(sampling_seed=7), "sampling_seed=7"),
        (dict(custom_logit_processor='{"callable": "x"}'), "custom_logit_processor"),
    ],
)
def test_unsupported_sampling_params_are_named(params, name):
    assert du.unsupported_sampling_param(**params) == name


def test_defaults_are_supported():
    assert du.unsupported_sampling_param() is None
    assert du.unsupported_sampling_param(
        repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
        min_new_tokens=0, sampling_seed=None, custom_logit_processor=None,
    ) is None
