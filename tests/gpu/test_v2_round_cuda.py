"""The 0.5.16 worker's round pieces on CUDA (patched sglang 0.5.16 on PYTHONPATH).

- ddtree_utils.accept_tree_greedy (sgl_kernel verify_tree_greedy) == ddtree_utils.verify_greedy_reference
  on GPU-built trees, budgets 1..255;
- the draft-graph proposer replayed from a CUDA graph == eager (also with budget auto's batch
  ranges: one graph per batch size, each at its own tree budget), and the proposer, the mask
  scatter, the accept and the commit layout run under torch.cuda sync debug mode "error"
  (any host synchronisation raises);
- none of the round pieces after the verify makes the host wait for queued GPU work (a wait
  that sync debug mode does not see: `buf[index] = True` on CUDA was one, 86 ms per round on
  the H200 behind a queued matmul, until restore_true_mask replaced it);
- budget auto's start-up cost table: real CUDA graphs of growing work per (batch size, width)
  in SGLang's FullCudaGraphBackend under the real runner's keys, replayed and timed with CUDA
  events by ddtree_auto_v2.seed_startup_costs: every cell filled and positive, the graphs'
  outputs unchanged by the replays;
- the one-launch KV path move (ddtree_utils.move_kv_rows, compiled for real) at the Qwen3-8B
  cache shape (72 buffers of 8 x 128 bf16 rows), bs 1..64, equals the pool's own move in two
  copies through the staging slots (on the verify slots) and the gather reference; its GPU time vs the two copies.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
info = pytest.importorskip("sglang.srt.speculative.ddtree_info_v2")
from sglang.srt.speculative import ddtree_utils  # noqa: E402
from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer  # noqa: E402
from sglang.srt.speculative.ddtree_worker_v2 import verify_tree_greedy  # noqa: E402

if verify_tree_greedy is None:  # the worker's accept kernel: what these tests measure
    pytest.skip("sgl_kernel.verify_tree_greedy is not importable", allow_module_level=True)

import ddtree_reference as dr  # noqa: E402

VOCAB, BLOCK = 512, 16


def _round(budget: int, bs: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    depth = min(budget, BLOCK - 1)
    logits = torch.randn(bs, depth, VOCAB, device="cuda", generator=gen) * 3
    logp, ids = ddtree_utils.draft_topk_logprobs(logits, min(budget, 16))
    tree = ddtree_utils.build_tree(logp, ids, budget)
    seq_lens = torch.randint(1, 300, (bs,), device="cuda", generator=gen)
    bonus = torch.randint(0, VOCAB, (bs,), device="cuda", generator=gen)
    ct = ddtree_utils.compile_tree(tree, bonus, seq_lens, build_custom_mask=False, max_depth=depth)
    n = budget + 1
    cand = ct.draft_tokens.view(bs, n)
    predict = torch.randint(0, VOCAB, (bs, n), device="cuda", generator=gen)
    # follow the first child most of the time so deep paths occur
    first = ct.retrieve_next_token
    follow = (torch.rand((bs, n), device="cuda", generator=gen) < 0.8) & (first >= 0)
    predict = torch.where(follow, cand.gather(1, first.clamp_min(0)), predict)
    return ct, cand, predict, seq_lens, depth


@pytest.mark.parametrize("budget", [1, 15, 63, 255])
def test_accept_kernel_matches_the_reference(budget):
    bs = 8
    ct, cand, predict, _, depth = _round(budget, bs, budget)
    index = torch.arange(bs * (budget + 1), device="cuda").view(bs, budget + 1)
    got = ddtree_utils.accept_tree_greedy(cand, predict, index, ct.retrieve_next_token,
                                          ct.retrieve_next_sibling, depth, kernel=verify_tree_greedy)
    want = ddtree_utils.verify_greedy_reference(
        cand.cpu(), ct.retrieve_next_token.cpu(), ct.retrieve_next_sibling.cpu(), predict.cpu(), depth)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)


def test_proposer_graph_and_no_host_sync():
    bs, budget, depth, k, hidden = 4, 63, 15, 16, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(VOCAB, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    widths = [8, 16, 32, 64]  # budget auto: the graph also prices every width
    prop = DDTreeProposer(weight=weight, num_org=VOCAB, org_vocab_start=0, block_size=BLOCK,
                          budget=budget, topk=k, max_depth=depth, max_bs=bs, widths=widths)
    hs = torch.randn(bs * BLOCK, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    eager = prop.compute(hs)  # first call builds the kernels' tables
    static = hs.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prop(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prop(static)
    static.copy_(hs)
    graph.replay()
    torch.cuda.synchronize()
    assert eager[5].shape == (bs, len(widths))
    for a, b in zip(prop.captured(bs), eager):
        assert torch.equal(a, b)

    # one round of budget auto at width 16: the tree cut to the width, the estimate's D2H into
    # the pinned ring (ddtree_budget.AutoRounds), all without a host sync
    from sglang.srt.speculative.ddtree_budget import AutoRounds, truncate_tree

    rounds = AutoRounds(widths, budget, [1, bs], device="cuda")
    assert rounds.ring.is_pinned()
    n = 16
    kv = [torch.zeros(bs * (n + depth + 1) + 1, 8, 16, device="cuda", dtype=torch.bfloat16)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        kv_rows = ddtree_utils.kv_rows(kv)  # built inside the first round: no host wait either
        tokens, tdepth, nxt, sib, tree_mask, expected = prop.compute(hs)
        tokens, tdepth, nxt, sib, tree_mask = truncate_tree(tokens, tdepth, nxt, sib, tree_mask, n)
        tokens, tdepth = tokens.contiguous(), tdepth.contiguous()  # as the worker does
        seq_lens = torch.randint(1, 200, (bs,), device="cuda", generator=gen)
        buf = torch.ones(n * (int(200 + n) * bs), dtype=torch.bool, device="cuda")
        index = ddtree_utils.tree_custom_mask_index(seq_lens, n).view(-1)
        buf[index] = tree_mask.reshape(-1)
        predict = torch.randint(0, VOCAB, (bs, n), device="cuda", generator=gen)
        rows = torch.arange(bs * n, device="cuda").view(bs, n)
        acc, acc_len, bonus = ddtree_utils.accept_tree_greedy(tokens, predict, rows, nxt, sib, depth,
                                                            kernel=verify_tree_greedy)
        out, commit, path = ddtree_utils.tree_commit_layout(acc, acc_len, bonus, tokens, BLOCK)
        slots = torch.arange(bs * (n + depth + 1), device="cuda").view(bs, -1)
        ddtree_utils.kv_move_locs(slots, path, n, depth)
        ddtree_utils.move_kv_rows(kv_rows, *ddtree_utils.kv_path_locs(slots, path, n, depth))
        ddtree_utils.restore_true_mask(buf, index)
        rounds.record(n, expected, None, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert bool(buf.all())
    assert torch.allclose(rounds.ring[0], expected.sum(0).cpu())
    # the kernel's walk of the cut tree = the reference walk
    want = ddtree_utils.verify_greedy_reference(tokens.cpu(), nxt.cpu(), sib.cpu(), predict.cpu(), depth)
    for a, b in zip((acc, acc_len, bonus), want):
        assert torch.equal(a.cpu(), b)


def test_proposer_graphs_build_each_batch_size_its_own_budget():
    """Budget auto's batch ranges (0.5.16's default graph list to 256; width 256 to batch 16, 64
    to 64, 8 every batch): warm() once, then one CUDA graph per captured batch size, as the
    draft runner captures them (no tree-kernel table may be created inside a capture), each
    building the tree of its batch's widest width; every replay equals the eager compute at that
    batch in the first budget + 1 columns."""
    from sglang.srt.speculative.ddtree_serving import auto_width_limits

    depth, k, hidden = 15, 16, 256
    widths = [8, 16, 32, 64, 128, 256]
    limits = auto_width_limits(widths, [1, 2, 4, 8, 16, 24, 32, 64, 128, 256])
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(VOCAB, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    prop = DDTreeProposer(weight=weight, num_org=VOCAB, org_vocab_start=0, block_size=BLOCK, budget=255,
                          topk=k, max_depth=depth, max_bs=256, widths=widths, limits=limits)
    prop.warm(hidden, torch.bfloat16)
    tables = dict(ddtree_utils._PRUNED_GRID)  # what warm() made: every budget's table
    for bs in (1, 16, 24, 64, 256):
        n = prop.budget_at(bs) + 1
        assert n == max(w for w in widths if limits[w] is None or bs <= limits[w])
        hs = torch.randn(bs * BLOCK, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
        eager = prop.compute(hs)
        static = hs.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prop(static)
        for buf in prop.out:
            buf.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = prop.captured(bs)
        assert tuple(eager[0].shape) == (bs, n)
        for a, b in zip(got[:4], eager[:4]):
            assert torch.equal(a[:, :n], b)
        assert torch.equal(got[4][:, :n, :n], eager[4])
        assert torch.equal(got[5], eager[5])
    assert ddtree_utils._PRUNED_GRID == tables  # no batch size needed a table warm() had not made


def test_startup_cost_table_replays_real_graphs():
    """seed_startup_costs on real CUDA graphs: per width, a DecodeCudaGraphRunner (real class,
    built without a model: its capture needs one) whose real FullCudaGraphBackend holds one
    captured graph per batch size, each a matmul of bs * width rows; timed with the real CUDA
    event timer. Checks only what must hold: every (size, width) cell measured, finite and
    positive, seeded into the table and in the snapshot (monotone in the width is not
    guaranteed), and a replay recomputes the same output (it is the captured work)."""
    import math

    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
    )
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )
    from sglang.srt.speculative.ddtree_auto_v2 import (
        VerifyWidthState,
        seed_startup_costs,
    )
    from sglang.srt.speculative.ddtree_budget import AutoRounds

    widths, sizes, hidden = [8, 16, 32], [1, 4, 16], 1024
    weight = torch.randn(hidden, hidden, device="cuda")
    states, outputs = {}, []
    for w in widths:
        runner = object.__new__(DecodeCudaGraphRunner)
        runner.capture_bs, runner.captured_req_width, runner.ragged_verify_mode = sizes, w, False
        runner.device_module = torch.cuda
        runner.model_runner = SimpleNamespace(tp_group=None)
        runner.backend = FullCudaGraphBackend(runner)
        for bs in sizes:
            x = torch.randn(bs * w, hidden, device="cuda")
            y = x @ weight  # warm-up outside the graph (cuBLAS set-up)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x @ weight
            key = runner._make_graph_key(runner._capture_graph_size(bs=bs, num_tokens=bs * w))
            runner.backend._graphs[key], runner.backend._outputs[key] = graph, y  # as capture_one
            outputs.append((graph, x, y))
        states[w] = VerifyWidthState(w, None, runner)
    auto = AutoRounds(widths, max(widths) - 1, sizes + [64], graph_sizes=sizes, device="cuda")
    status = seed_startup_costs(auto, states)
    assert status["status"] == "measured" and status["cells"] == status["seeded"] == len(widths) * len(sizes)
    snap = auto.snapshot()
    assert snap["startup"] == status
    rows = snap["cost_table"]["verify_ms"]
    for i, b in enumerate(snap["cost_table"]["buckets"]):
        for ms in rows[i]:
            if b in sizes:
                assert ms is not None and math.isfinite(ms) and ms > 0, rows
            else:
                assert ms is None  # the running cap above the graphs: no seed
    print("\nstart-up verify table (ms):\n" + auto.controller.table.format_ms("verify"))
    for graph, x, y in outputs[:2]:
        want = x @ weight
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y, want, rtol=1e-3, atol=1e-3)


def _gpu_ms(fn, reps: int = 20) -> float:
    """Mean CUDA-event time of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _host_ms_behind_queued_work(op, queued) -> float:
    """Host time of ``op()`` issued right behind ``queued()`` GPU work (worst of 3)."""
    import time

    op()  # warm-up (kernel builds, allocator)
    worst = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        queued()
        start = time.perf_counter()
        op()
        worst = max(worst, 1e3 * (time.perf_counter() - start))
    torch.cuda.synchronize()
    return worst


@pytest.mark.parametrize("bs", [1, 32])
def test_round_pieces_do_not_wait_for_the_gpu(bs):
    budget = 15
    n, depth = budget + 1, min(budget, BLOCK - 1)
    big = torch.randn(4096, 4096, device="cuda")

    def queued():
        for _ in range(8):
            big @ big

    queued()  # warm-up: cuBLAS set-up on first use would count as queued GPU work
    torch.cuda.synchronize()
    import time

    start = time.perf_counter()
    queued()
    torch.cuda.synchronize()
    queued_ms = 1e3 * (time.perf_counter() - start)
    limit = 0.2 * queued_ms
    ct, cand, predict, seq_lens, _ = _round(budget, bs, 3)
    index = ddtree_utils.tree_custom_mask_index(seq_lens, n).view(-1)
    buf = torch.ones(int(index.max()) + 1 + 64, dtype=torch.bool, device="cuda")
    rows = torch.arange(bs * n, device="cuda").view(bs, n)
    logits = torch.randn(bs * n, VOCAB, device="cuda")
    slots = torch.arange(bs * (n + depth + 1), device="cuda").view(bs, -1)
    acc = ddtree_utils.accept_tree_greedy(
        cand, predict, rows, ct.retrieve_next_token, ct.retrieve_next_sibling, depth,
        kernel=verify_tree_greedy,
    )
    layout = ddtree_utils.tree_commit_layout(*acc, cand, BLOCK)
    kv_rows = ddtree_utils.kv_rows(
        [torch.zeros(slots.numel() + 1, 8, 128, device="cuda", dtype=torch.bfloat16)] * 4
    )
    pieces = {
        "mask scatter": lambda: buf.__setitem__(index, ct.tree_mask.reshape(-1)),
        "restore_true_mask": lambda: ddtree_utils.restore_true_mask(buf, index),
        "argmax": lambda: torch.argmax(logits, dim=-1),
        "accept_tree_greedy": lambda: ddtree_utils.accept_tree_greedy(
            cand, predict, rows, ct.retrieve_next_token, ct.retrieve_next_sibling, depth,
            kernel=verify_tree_greedy,
        ),
        "tree_commit_layout": lambda: ddtree_utils.tree_commit_layout(*acc, cand, BLOCK),
        "kv_move_locs": lambda: ddtree_utils.kv_move_locs(slots, layout[2], n, depth),
        "move_kv_rows": lambda: ddtree_utils.move_kv_rows(
            kv_rows, *ddtree_utils.kv_path_locs(slots, layout[2], n, depth)
        ),
    }
    waited = {
        name: ms
        for name, op in pieces.items()
        if (ms := _host_ms_behind_queued_work(op, queued)) > limit
    }
    # the detector must see a known wait, or a pass above means nothing: a device-to-host read
    # waits for all queued work
    blocking_ms = _host_ms_behind_queued_work(lambda: buf[0].item(), queued)
    assert blocking_ms > limit, (
        f"a device-to-host read did not wait ({blocking_ms:.2f} ms of {queued_ms:.1f} queued)"
    )
    assert not waited, f"host waited for the GPU (queued {queued_ms:.1f} ms): {waited}"


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_move_kv_rows_equals_the_two_copy_move(bs):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    budget, depth = 63, BLOCK - 1
    n, k = budget + 1, depth + 1
    gen = torch.Generator(device="cuda").manual_seed(bs)
    size = bs * (n + k) + 8
    pools = [
        MHATokenToKVPool(size, 1, torch.bfloat16, 8, 128, 36, "cuda", False, enable_kv_cache_copy=True)
        for _ in range(2)
    ]
    for a, b in zip(pools[0].k_buffer + pools[0].v_buffer, pools[1].k_buffer + pools[1].v_buffer):
        a.copy_(torch.randn(a.shape, device="cuda", generator=gen).to(a.dtype))
        b.copy_(a)
    slots = (torch.randperm(size - 8, device="cuda", generator=gen)[: bs * (n + k)] + 8).view(bs, n + k)
    ct, cand, predict, _, _ = _round(budget, bs, bs)
    rows_idx = torch.arange(bs * n, device="cuda").view(bs, n)
    acc = ddtree_utils.accept_tree_greedy(cand, predict, rows_idx, ct.retrieve_next_token,
                                          ct.retrieve_next_sibling, depth, kernel=verify_tree_greedy)
    path = ddtree_utils.tree_commit_layout(*acc, cand, BLOCK)[2]
    tgt, src = ddtree_utils.kv_path_locs(slots, path, n, depth)
    want = [buf[src.reshape(-1)].clone() for buf in pools[0].k_buffer + pools[0].v_buffer]
    rows = ddtree_utils.kv_rows(pools[0].k_buffer + pools[0].v_buffer)

    ddtree_utils.move_kv_rows(rows, tgt, src)

    def two_copies():
        for t, s_ in ddtree_utils.kv_move_locs(slots, path, n, depth):
            pools[1].move_kv_cache(t, s_)

    two_copies()
    torch.cuda.synchronize()
    for w, a, b in zip(want, pools[0].k_buffer + pools[0].v_buffer, pools[1].k_buffer + pools[1].v_buffer):
        assert torch.equal(a[tgt.reshape(-1)], w)  # every committed slot holds its path node's KV
        verify = slots[:, :n].reshape(-1)  # the two-copy move also writes the staging slots
        assert torch.equal(a[verify], b[verify])
    # timings of both after the check (repeating a move changes nothing checked), not asserted
    one, two = _gpu_ms(lambda: ddtree_utils.move_kv_rows(rows, tgt, src)), _gpu_ms(two_copies)
    print(f"\nKV path move bs {bs}: move_kv_rows {one:.3f} ms, two move_kv_cache copies {two:.3f} ms")


@pytest.mark.parametrize("bs,budget", [(1, 15), (16, 15), (16, 63), (32, 15), (4, 255)])
def test_tree_verify_attention_equals_the_extend_kernel(bs, budget):
    """ddtree_utils.tree_verify_attention (bf16, Qwen3-8B heads: 32 q / 8 kv, head dim 128,
    prefixes of 300-700 tokens, a DDTree mask) against SGLang's own extend kernel with the same
    FULL mask and the float32 reference; both kernels timed with CUDA events (printed)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    n, hq, hkv, dim = budget + 1, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(bs + budget)
    plens = torch.randint(300, 700, (bs,), device="cuda", generator=gen)
    slots = int(plens.sum()) + 64
    kb = torch.randn(slots, hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
    vb = torch.randn(slots, hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
    indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = plens.cumsum(0)
    indices = torch.randperm(slots - 1, device="cuda", generator=gen)[: int(indptr[-1])] + 1
    q = torch.randn(bs * n, hq, dim, device="cuda", generator=gen).to(torch.bfloat16)
    kt = torch.randn(bs * n, hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
    vt = torch.randn(bs * n, hkv, dim, device="cuda", generator=gen).to(torch.bfloat16)
    ct, *_ = _round(budget, bs, bs)
    mask = ddtree_utils.tree_custom_mask(ct.tree_mask, plens.tolist()).cuda()
    sizes = n * (plens + n)
    mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device="cuda")
    mask_indptr[1:] = sizes.cumsum(0)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    got = ddtree_utils.tree_verify_attention(
        q, kb, vb, indptr, indices, kt, vt, mask, mask_indptr, n, scale)
    ext = torch.empty_like(q)

    def extend():
        extend_attention_fwd(q, kt, vt, ext, kb, vb, qo_indptr, indptr, indices, mask, True,
                             mask_indptr, n, 1.0, 1.0, scale)

    extend()
    want = dr.tree_verify_attention_reference(
        q, kb, vb, indptr, indices, kt, vt, mask, mask_indptr, n, scale)
    err_tree = (got.float() - want.float()).abs().max().item()
    err_ext = (ext.float() - want.float()).abs().max().item()
    assert err_tree <= max(2 * err_ext, 2e-2), (err_tree, err_ext)

    t_tree = _gpu_ms(lambda: ddtree_utils.tree_verify_attention(
        q, kb, vb, indptr, indices, kt, vt, mask, mask_indptr, n, scale, out=got))
    print(f"\ntree attention bs {bs} N {n}: split-KV {t_tree:.3f} ms/layer, extend kernel "
          f"{_gpu_ms(extend):.3f} ms/layer; max error vs float32 {err_tree:.4f} (extend {err_ext:.4f})")
