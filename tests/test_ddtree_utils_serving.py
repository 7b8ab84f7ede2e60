"""ddtree_serving (shipped next to ddtree_utils): the serving limits the patches derive from the
budget and memory, the tree capacity rule, the verify CUDA-graph sizes and the debug metrics.

Each expectation is recomputed from the rule it documents (a round replayed step by step, the
bytes a verify forward holds), never pasted from a run.
"""

from __future__ import annotations

import pytest

import ddtree_serving as ds

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
    steps, topk = ds.spec_steps_and_topk(budget, block)
    assert topk > 1  # fa3 / Mamba tree paths
    # SGLang's v1 per-request reservation at page size 1.
    assert max(steps * topk, budget + 1) == _round_peak(block, budget)
    assert ds.decode_kv_reservation(budget, block) == _round_peak(block, budget)


def test_old_rule_reserved_about_twice_at_budget_15():
    # The previous derivation max(2, ceil(max(block, N) / num_steps)) with num_steps = 15
    # reserved 30 slots at budget 15 for a peak of 16; the new one reserves the peak.
    steps, topk = ds.spec_steps_and_topk(15, BLOCK)
    assert max(steps * topk, 16) == 16 == _round_peak(BLOCK, 15)


@pytest.mark.parametrize("budget", [1, 15, 63, 255, 1023])
def test_accept_depth_is_capped_by_the_block(budget):
    assert ds.max_accept_depth(budget, BLOCK) == min(budget, BLOCK - 1)


@pytest.mark.parametrize("free_gib", [0.5, 4, 15, 80])
@pytest.mark.parametrize("budget", [15, 63, 255, 1023])
def test_verify_limit_keeps_every_forward_within_memory(free_gib, budget):
    free = int(free_gib * (1 << 30))
    extra = 2 * 4096 * 5  # bf16 hidden rows of 5 target layers (Qwen3-8B shape)
    chunk = 8192
    limit = ds.verify_token_limit(free, QWEN3_8B_VOCAB, chunk, extra)
    per_token = 4 * QWEN3_8B_VOCAB * (1 + ds.VERIFY_SAMPLING_WORKSPACE_ROWS) + extra
    # The logits, the sampler workspace and the hidden rows of `limit` tokens fit the share.
    assert 1 <= limit <= chunk
    assert limit == 1 or limit * per_token <= free * ds.VERIFY_LOGITS_MEMORY_SHARE
    # ...and the limit is the largest such count (unless the chunk size bounds it).
    assert limit == chunk or (limit + 1) * per_token > free * ds.VERIFY_LOGITS_MEMORY_SHARE
    for requested in (1, 16, 48, 256):
        cap = ds.verify_max_running_requests(limit, budget, BLOCK, requested)
        width = max(BLOCK, budget + 1)
        assert 1 <= cap <= requested
        assert cap == 1 or cap * width <= limit  # the largest forward of a round fits
        assert cap == requested or (cap + 1) * width > limit  # nothing is given away


def test_issue_shape_numbers():
    """At the issue's shape (H200, mem-fraction 0.85: ~15 GiB left after startup) the rule
    keeps 32 x 64 verify tokens (budget 63) and caps budget 255 below 48 requests."""
    free = 15 << 30
    limit = ds.verify_token_limit(free, QWEN3_8B_VOCAB, 8192, 2 * 4096 * 5)
    assert ds.verify_max_running_requests(limit, 63, BLOCK, 48) * 64 <= limit
    assert ds.verify_max_running_requests(limit, 63, BLOCK, 32) == 32
    assert ds.verify_max_running_requests(limit, 255, BLOCK, 48) < 48


@pytest.mark.parametrize(("bs", "want"), [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (16, 16), (17, None)])
def test_graph_batch_size(bs, want):
    assert ds.graph_batch_size(bs, [1, 2, 4, 8, 16]) == want
    assert ds.graph_batch_size(bs, []) is None


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
    assert ds.unsupported_sampling_param(**params) == name


def test_defaults_are_supported():
    assert ds.unsupported_sampling_param() is None
    assert ds.unsupported_sampling_param(
        repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
        min_new_tokens=0, sampling_seed=None, custom_logit_processor=None,
    ) is None


@pytest.mark.parametrize("cap", [1, 2, 3, 16])
@pytest.mark.parametrize("depth", [1, 2, 5, 15])
def test_tree_capacity_counts_the_prefixes(cap, depth):
    """K + K^2 + ... + K^D, counted until it reaches the budget (so a huge K^D is never built)."""
    full = sum(cap**d for d in range(1, depth + 1))
    for budget in (1, 15, 63, 1023):
        got = ds.tree_capacity(cap, depth, budget)
        assert (got >= budget) == (full >= budget)
        assert got <= full and (got == full or got >= budget)


@pytest.mark.parametrize("width", [16, 64, 256, 1024])
def test_verify_cuda_graph_bs(width):
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256]
    got = ds.verify_cuda_graph_bs(sizes, width)
    fits = [bs for bs in sizes if bs * width <= ds.DDTREE_MAX_CUDA_GRAPH_TOKENS]
    assert got == (None if fits == sizes else fits)
    assert ds.verify_cuda_graph_bs(None, width) is None
    assert ds.verify_cuda_graph_bs([8192], 4096) == [1]  # nothing fits: one graph of batch 1


def test_debug_metrics_histogram_and_means():
    m = ds.DDTreeDebugMetrics(max_depth=3, budget=7, log_interval=2)
    rounds = [[0, 3], [5, 1, -1]]  # out-of-range depths are clamped to 0..max_depth
    due = [m.record(acc) for acc in rounds]
    assert due == [False, True]
    flat = [min(max(d, 0), 3) for acc in rounds for d in acc]
    snap = m.snapshot()
    assert snap["accepted_depth_hist"] == [flat.count(d) for d in range(4)]
    assert snap["avg_accepted_depth"] == sum(flat) / len(flat)
    assert snap["rounds"] == 2 and snap["tree_size"] == 7 and "avg_tree_size" not in snap
    m.record([2], tree_nodes=7, build_ms=0.5)
    snap = m.snapshot()
    assert snap["avg_tree_size"] == 7 / 6 and snap["avg_tree_build_ms"] == 0.5
