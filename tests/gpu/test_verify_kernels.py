"""sgl_kernel tree verification inside DDTreeVerifyInput vs ddtree_utils' reference, on CUDA.

Needs a GPU and the patched sglang build first on PYTHONPATH (tests/gpu/run_on_device.sh);
skipped otherwise. Trees are built on the GPU by ddtree_utils.build_tree from random draft
logits; the target's argmax is chosen to follow a random root-to-node path.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ddtree_info = pytest.importorskip("sglang.srt.speculative.ddtree_info",
                                  reason="the patched sglang 0.5.13.post1 build is not on the path")
if not hasattr(ddtree_info, "DDTreeVerifyInput"):
    pytest.skip("the patched sglang build is not on the path", allow_module_level=True)
from sglang.srt.speculative import ddtree_utils

VOCAB, BLOCK = 512, 16


def _case(budget: int, bs: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = random.Random(seed)
    depth = min(budget, BLOCK - 1)
    logits = torch.randn(bs, depth, VOCAB, device="cuda", generator=gen) * 3
    logp, ids = ddtree_utils.draft_topk_logprobs(logits, min(budget, 16))
    tree = ddtree_utils.build_tree(logp, ids, budget)
    seq_lens = torch.randint(1, 300, (bs,), device="cuda", generator=gen)
    bonus = torch.randint(0, VOCAB, (bs,), device="cuda", generator=gen)
    ct = ddtree_utils.compile_tree(tree, bonus, seq_lens, build_custom_mask=False)
    n = budget + 1
    tokens, parents = ct.draft_tokens.view(bs, n).cpu(), ct.parents.cpu()
    predict = torch.randint(
        0, VOCAB, (bs, n), generator=torch.Generator().manual_seed(seed)
    )
    for b in range(bs):
        children = {}
        for j in range(1, n):
            children.setdefault(int(parents[b, j]), []).append(j)
        path, want = [0], rng.randint(0, depth)
        while len(path) - 1 < want and children.get(path[-1]):
            nxt = rng.choice(children[path[-1]])
            predict[b, path[-1]] = tokens[b, nxt]
            path.append(nxt)
        taken = {int(tokens[b, j]) for j in children.get(path[-1], [])}
        predict[b, path[-1]] = next(t for t in range(VOCAB) if t not in taken)
    vi = ddtree_info.DDTreeVerifyInput(
        draft_token=ct.draft_tokens,
        positions=ct.positions,
        draft_token_num=n,
        custom_mask=None,
        retrieve_index=ct.retrieve_index,
        retrieve_next_token=ct.retrieve_next_token,
        retrieve_next_sibling=ct.retrieve_next_sibling,
        max_depth=depth,
    )
    return vi, ct.draft_tokens.view(bs, n), predict.cuda(), depth


@pytest.mark.parametrize("budget", [1, 15, 63, 255])
def test_verify_tree_greedy_kernel_matches_reference(budget):
    assert ddtree_info.verify_tree_greedy is not None, (
        "sgl_kernel verify_tree_greedy missing"
    )
    vi, cand, predict, depth = _case(budget, bs=8, seed=budget)
    got = vi._greedy_accept(cand, predict)
    want = ddtree_utils.verify_greedy_reference(
        cand, vi.retrieve_next_token, vi.retrieve_next_sibling, predict, depth
    )
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize("budget", [15, 255])
def test_sampled_accept_with_one_hot_targets_matches_greedy_reference(budget):
    """top_k = 1 makes every node's target draw its argmax: the sampled path (one
    ddtree_utils.sample_from_logits draw per node + verify_tree_greedy) must accept the
    greedy reference's path."""
    vi, cand, predict, depth = _case(budget, bs=8, seed=1000 + budget)
    bs, n = cand.shape
    logits = torch.randn(bs * n, VOCAB, device="cuda")
    logits.scatter_(1, predict.view(-1, 1), 30.0)
    info = SimpleNamespace(
        temperatures=torch.full((bs, 1), 0.7, device="cuda"),
        top_ks=torch.ones(bs, dtype=torch.int32, device="cuda"),
        top_ps=torch.full((bs,), 0.9, device="cuda"),
        min_ps=torch.zeros(bs, device="cuda"),
        need_min_p_sampling=False,
    )
    got = vi._sampling_accept(cand, logits, info)
    want = ddtree_utils.verify_greedy_reference(
        cand, vi.retrieve_next_token, vi.retrieve_next_sibling, predict, depth
    )
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu())
