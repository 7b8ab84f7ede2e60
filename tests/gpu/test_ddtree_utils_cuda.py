"""ddtree_utils on CUDA: same results as the CPU reference, and capturable in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import ddtree_reference as dr
import ddtree_utils as du

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def quantised(bs, depth, vocab, levels, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    logits = (
        torch.randint(0, levels, (bs, depth, vocab), generator=gen).float() / levels * 6
    )
    return logits.to(device)


@pytest.mark.parametrize("budget", [1, 16, 64, 257])
@pytest.mark.parametrize("levels", [4, 10**6])
def test_cuda_builder_equals_cpu_heap(budget, levels):
    logits = quantised(5, 15, 700, levels, budget + levels)
    lp, ids = du.draft_topk_logprobs(logits, budget)
    valid = torch.tensor([True, False, True, True, True], device="cuda")
    got = du.build_tree(
        lp, ids, budget, valid=valid, topk_cap=48 if budget > 60 else None
    )
    assert got.tokens.device.type == "cuda"
    want = dr.build_tree_reference(
        lp.cpu(),
        ids.cpu(),
        budget,
        valid=valid.cpu(),
        topk_cap=48 if budget > 60 else None,
    )
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_topk_logprobs_match_cpu(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 15, 151936, generator=gen) * 3).to(dtype)
    lp, ids = du.draft_topk_logprobs(logits.cuda(), 64)
    ref = torch.log_softmax(logits.double(), -1).topk(64, dim=-1)
    assert torch.allclose(lp.cpu().double(), ref.values, atol=2e-4)
    # ids may differ from the reference only among exactly equal logits (bf16/fp16 have many)
    picked = logits.float().gather(-1, ids.cpu())
    assert torch.equal(picked, logits.float().topk(64, dim=-1).values)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    nan = logits.cuda().clone()
    nan[2, 3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        du.draft_topk_logprobs(nan, 8)


def test_cuda_compile_matches_cpu():
    lp, ids = du.draft_topk_logprobs(quantised(3, 15, 300, 5, 1), 64)
    tree = du.build_tree(lp, ids, 64)
    seq = torch.tensor([7, 0, 130])
    bonus = torch.tensor([1, 2, 3])
    got = du.compile_tree(
        tree, bonus.cuda(), seq.cuda(), seq_lens_cpu=seq.tolist(), max_depth=15
    )
    want = du.compile_tree(
        du.DDTree(*(t.cpu() for t in tree)), bonus, seq, max_depth=15
    )
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name
    cand = got.draft_tokens.view(3, 65)
    predict = torch.randint(0, 300, (3, 65), device="cuda")
    acc = du.verify_greedy_reference(
        cand, got.retrieve_next_token, got.retrieve_next_sibling, predict, 15
    )
    acc_cpu = du.verify_greedy_reference(
        cand.cpu(),
        want.retrieve_next_token,
        want.retrieve_next_sibling,
        predict.cpu(),
        15,
    )
    assert all(torch.equal(a.cpu(), b) for a, b in zip(acc, acc_cpu))


def test_build_and_compile_replay_in_cuda_graph():
    """Static shapes and no host sync: capture once, replay on new inputs, equal to eager."""
    bs, budget = 8, 64
    first = du.draft_topk_logprobs(quantised(bs, 15, 500, 7, 10), budget)
    static_lp, static_ids = first[0].clone(), first[1].clone()
    bonus = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), 100, device="cuda")

    def step():
        tree = du.build_tree(static_lp, static_ids, budget)
        return tree, du.compile_tree(
            tree, bonus, seq, build_custom_mask=False, max_depth=15
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tree, out_ct = step()
    for seed in (11, 12):
        lp, ids = du.draft_topk_logprobs(quantised(bs, 15, 500, 7, seed), budget)
        static_lp.copy_(lp)
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        want = dr.build_tree_reference(lp, ids, budget)
        for name, a, b in zip(want._fields, want, out_tree):
            assert torch.equal(a.cpu(), b.cpu()), name
        eager = du.compile_tree(want, bonus, seq, build_custom_mask=False, max_depth=15)
        for name, a, b in zip(eager._fields, eager, out_ct):
            assert torch.equal(a.cpu(), b.cpu()), name


def test_greedy_reference_matches_sgl_kernel():
    """The oracle against sgl_kernel.verify_tree_greedy, where that kernel is installed."""
    sgl_kernel = pytest.importorskip("sgl_kernel")
    bs, budget = 6, 32
    lp, ids = du.draft_topk_logprobs(quantised(bs, 15, 40, 1000, 5), budget)
    tree = du.build_tree(lp, ids, budget)
    ct = du.compile_tree(
        tree,
        torch.zeros(bs, dtype=torch.int64, device="cuda"),
        torch.zeros(bs, dtype=torch.int64, device="cuda"),
        build_custom_mask=False,
    )
    n = budget + 1
    cand = ct.draft_tokens.view(bs, n)
    # a target that mostly follows the first child, so paths are long
    first = cand.gather(1, ct.retrieve_next_token.clamp_min(0))
    noise = torch.randint(0, 40, (bs, n), device="cuda")
    predict = torch.where(torch.rand(bs, n, device="cuda") < 0.8, first, noise)
    accept_index = torch.full((bs, 16), -1, dtype=torch.int32, device="cuda")
    accept_num = torch.zeros(bs, dtype=torch.int32, device="cuda")
    predicts = torch.zeros(bs * n + 1, dtype=torch.int32, device="cuda")
    sgl_kernel.verify_tree_greedy(
        predicts, accept_index, accept_num, cand, ct.retrieve_index,
        ct.retrieve_next_token, ct.retrieve_next_sibling, predict,
    )  # fmt: skip
    acc, acc_len, bonus = du.verify_greedy_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, 15
    )
    plan = du.accept_plan(
        accept_index.long(), accept_num.long(), torch.arange(bs * n), flat_index=True
    )
    assert torch.equal(accept_num.long(), acc_len)
    assert torch.equal(plan.last_node, acc.gather(1, acc_len.view(bs, 1)).view(bs))
    last_flat = plan.last_node + torch.arange(bs, device="cuda") * n
    assert torch.equal(predicts.long()[last_flat], bonus)


def test_fused_normaliser_matches_chunked():
    logits = (torch.randn(3, 15, 151936, device="cuda") * 3).bfloat16()
    a_lp, a_ids = du.draft_topk_logprobs(logits, 32, validate=False, fused=True)
    b_lp, b_ids = du.draft_topk_logprobs(logits, 32, validate=False, backend="torch")
    assert torch.equal(a_ids, b_ids)
    assert torch.allclose(a_lp, b_lp, atol=1e-5)


@pytest.mark.parametrize(
    "bs,depth,vocab,budget,cap",
    [
        (1, 1, 50, 1, None),
        (3, 15, 700, 15, 16),
        (33, 15, 700, 63, 16),
        (7, 15, 2000, 64, None),
        (5, 15, 5000, 255, None),
        (4, 15, 5000, 512, None),
        (2, 15, 5000, 1023, 64),
        (6, 4, 3, 40, None),  # fewer prefixes than the budget
    ],
)
@pytest.mark.parametrize("levels", [3, 10**6])
def test_triton_kernels_equal_torch_and_heap(bs, depth, vocab, budget, cap, levels):
    """The fused Triton build/compile kernels against the torch ops and the CPU heap, with
    heavy ties (3 logit levels) and without; every request validity pattern."""
    logits = quantised(bs, depth, vocab, levels, bs * 1000 + budget + levels)
    logits[0, depth // 2, 1:] = float("-inf")  # one position with a single live token
    lp, ids = du.draft_topk_logprobs(logits, min(budget, vocab))
    valid = torch.rand(bs, device="cuda") > 0.2
    got = du.build_tree(lp, ids, budget, valid=valid, topk_cap=cap, backend="triton")
    ops = du.build_tree(lp, ids, budget, valid=valid, topk_cap=cap, backend="torch")
    want = dr.build_tree_reference(
        lp.cpu(), ids.cpu(), budget, valid=valid.cpu(), topk_cap=cap
    )
    for name, a, b, c in zip(want._fields, want, got, ops):
        assert torch.equal(a, b.cpu()), name
        assert torch.equal(a, c.cpu()), name
    bonus = torch.randint(0, vocab, (bs,), device="cuda")
    seq = torch.randint(0, 3000, (bs,), device="cuda")
    c_tri = du.compile_tree(
        got, bonus, seq, build_custom_mask=False, max_depth=depth, backend="triton"
    )
    c_ops = du.compile_tree(
        got, bonus, seq, build_custom_mask=False, max_depth=depth, backend="torch"
    )
    for name, a, b in zip(c_ops._fields, c_ops, c_tri):
        assert torch.equal(a, b), name


def test_triton_build_and_compile_replay_in_cuda_graph():
    bs, budget, depth = 16, 63, 15
    lp, ids = du.draft_topk_logprobs(quantised(bs, depth, 900, 9, 5), 16)
    static_lp, static_ids = lp.clone(), ids.clone()
    bonus = torch.arange(bs, device="cuda")
    seq = torch.full((bs,), 77, device="cuda")

    def step():
        tree = du.build_tree(static_lp, static_ids, budget, backend="triton")
        return tree, du.compile_tree(
            tree, bonus, seq, build_custom_mask=False, max_depth=depth, backend="triton"
        )

    step()  # creates the pruned-grid table outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_tree, out_ct = step()
    for seed in (6, 7, 8):
        lp, ids = du.draft_topk_logprobs(quantised(bs, depth, 900, 9, seed), 16)
        static_lp.copy_(lp)
        static_ids.copy_(ids)
        graph.replay()
        want = dr.build_tree_reference(lp.cpu(), ids.cpu(), budget)
        for name, a, b in zip(want._fields, want, out_tree):
            assert torch.equal(a, b.cpu()), name
        ct = du.compile_tree(
            want, bonus.cpu(), seq.cpu(), build_custom_mask=False, max_depth=depth
        )
        for name, a, b in zip(ct._fields, ct, out_ct):
            assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("k", [1, 16, 64])
def test_triton_normaliser_equals_torch(k):
    """draft_topk_logprobs' default on CUDA (torch.topk + the Triton normaliser) against the
    chunked torch normaliser and a float64 log-softmax; also replayed from a CUDA graph."""
    gen = torch.Generator().manual_seed(k)
    logits = (torch.randn(5, 15, 151936, generator=gen) * 3).bfloat16()
    logits[0, 0] = float("-inf")
    logits[1, 2, 1000:] = float("-inf")
    x = logits.cuda()
    lp, ids = du.draft_topk_logprobs(x, k)
    t_lp, t_ids = du.draft_topk_logprobs(x, k, backend="torch")
    assert torch.equal(ids, t_ids)
    assert torch.equal(lp.isneginf(), t_lp.isneginf())
    assert torch.allclose(lp, t_lp, atol=1e-5)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, ids.cpu())
    live = torch.isfinite(ref)
    assert torch.allclose(lp.cpu().double()[live], ref[live], atol=2e-4)
    static = x.clone()
    du.draft_topk_logprobs(static, k, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_lp, g_ids = du.draft_topk_logprobs(static, k, validate=False)
    static.copy_(x.flip(-1))
    graph.replay()
    want_lp, want_ids = du.draft_topk_logprobs(x.flip(-1), k, validate=False)
    assert torch.equal(g_lp, want_lp) and torch.equal(g_ids, want_ids)
