"""The DDTree worker's CUDA-graph tree build (SGLANG_DDTREE_GRAPH_TREE_BUILD=1) == eager.

Needs CUDA and the patched sglang first on PYTHONPATH; skipped otherwise. Replays each
captured graph with fresh inputs (several rounds, several batch sizes) and compares every
output with the eager build_tree + compile_tree; prints the per-round time of both.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ddtree_worker = pytest.importorskip("sglang.srt.speculative.ddtree_worker",
                                    reason="the patched sglang 0.5.13.post1 build is not on the path")
from sglang.srt.speculative import ddtree_utils

VOCAB = 4096


def _inputs(bs, depth, k, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(bs, depth, VOCAB, device="cuda", generator=gen) * 2
    logp, ids = ddtree_utils.draft_topk_logprobs(logits, k, validate=False)
    bonus = torch.randint(0, VOCAB, (bs,), device="cuda", generator=gen)
    seq_lens = torch.randint(
        1, 500, (bs,), device="cuda", generator=gen, dtype=torch.int32
    )
    return logp, ids, bonus, seq_lens


def _time(fn, args, reps=20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


@pytest.mark.parametrize("budget", [15, 63, 255])
def test_graphed_tree_build_equals_eager(budget):
    depth, k = 15, min(budget, 16)
    graphed = ddtree_worker._TreeBuilder(budget, k, depth, use_cuda_graph=True)
    eager = ddtree_worker._TreeBuilder(budget, k, depth, use_cuda_graph=False)
    for seed, bs in enumerate([1, 4, 4, 9, 1, 4]):
        args = _inputs(bs, depth, k, seed)
        valid_g, got = graphed(*args)
        valid_e, want = eager(*args)
        assert torch.equal(valid_g, valid_e)
        for name in want._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, seed)
    args = _inputs(8, depth, k, 99)
    print(
        f"budget {budget} bs 8: eager {_time(eager, args):.2f} ms, "
        f"graph {_time(graphed, args):.2f} ms per round"
    )
