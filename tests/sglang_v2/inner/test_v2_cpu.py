"""DDTREE on SGLang 0.5.16 (patched), on the CPU, in the child Python of test_v2_pin.py.

Real sglang 0.5.16 modules with the build laid over them. Server args go through the real
prepare_server_args (`--device cuda` parses without touching a GPU); the round's pure pieces
run on real ReqToTokenPool / TokenToKVPoolAllocator objects and are checked against
ddtree_utils' references. What needs a GPU (the forward passes, CUDA graphs, the KV copy
kernel) is covered by tests/gpu; here the KV pool is a plain tensor standing in for one
layer's K buffer (the copy kernel is Triton-on-CUDA only), said where it is used.
"""

from __future__ import annotations

import importlib.util
import math
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ddtree_reference as dr
import ddtree_utils as du

_FIX = Path(__file__).resolve().parents[2] / "sglang" / "fixtures.py"
_spec = importlib.util.spec_from_file_location("ddtree_fixtures_v2", _FIX)
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

BLOCK = fixtures.draft_config()["block_size"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return fixtures.write_model_dirs(tmp_path_factory.mktemp("tiny"), block_size=BLOCK)


@pytest.fixture(scope="module")
def parse(models):
    from sglang.srt.server_args import prepare_server_args

    def _parse(extra: str = "", algorithm: str | None = "DDTREE", draft: bool = True):
        argv = ["--model-path", str(models.target), "--device", "cuda"]
        if algorithm:
            argv += ["--speculative-algorithm", algorithm]
        if draft:
            argv += ["--speculative-draft-model-path", str(models.draft)]
        return prepare_server_args([*argv, *shlex.split(extra)])

    return _parse


def test_the_016_site_is_patched():
    import sglang
    from sglang.srt.speculative import ddtree_utils as shipped

    assert sglang.__version__ == "0.5.16"
    assert Path(shipped.__file__).read_bytes() == Path(du.__file__).read_bytes()


# ------------------------------------------------------------------------------------------
# Algorithm selection


def test_algorithm_predicates_and_worker():
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    ddtree = SpeculativeAlgorithm.from_string("ddtree")
    assert ddtree is SpeculativeAlgorithm.DDTREE
    assert ddtree.is_ddtree() and ddtree.is_dflash_family() and not ddtree.is_dflash()
    assert ddtree.supports_target_verify_for_draft()
    assert not SpeculativeAlgorithm.DFLASH.is_ddtree()
    assert ddtree.create_worker(SimpleNamespace()) is DDTreeWorkerV2
    assert issubclass(DDTreeWorkerV2, DFlashWorkerV2)
    assert SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace()) is DFlashWorkerV2
    assert hasattr(CustomSpecAlgo, "is_ddtree")


def test_verify_input_for_capture_carries_the_mask(parse):
    from sglang.srt.speculative.ddtree_info_v2 import DDTreeVerifyInput
    from sglang.srt.speculative.spec_info import (
        SpeculativeAlgorithm,
        create_dummy_verify_input,
    )

    args = parse("--attention-backend triton --speculative-ddtree-budget 63")
    mask = torch.ones(128, dtype=torch.bool)
    target = create_dummy_verify_input(SpeculativeAlgorithm.DDTREE, args, mask, 64, False)
    assert isinstance(target, DDTreeVerifyInput) and target.custom_mask is mask
    assert target.is_verify_input() and target.num_tokens_per_req == 64
    assert target.topk == args.speculative_eagle_topk > 1
    draft = create_dummy_verify_input(SpeculativeAlgorithm.DDTREE, args, mask, 64, True)
    assert not isinstance(draft, DDTreeVerifyInput) and draft.custom_mask is None


# ------------------------------------------------------------------------------------------
# Server args: accepted configurations


@pytest.mark.parametrize("budget", [1, 15, 63, 255])
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_ddtree_shape(parse, budget, backend):
    from sglang.srt.arg_groups.ddtree_hook import ddtree_decode_reserve_len
    from sglang.srt.speculative.ddtree_serving import DDTREE_MAX_CUDA_GRAPH_TOKENS
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_reserve_per_decode,
        get_req_to_token_extra_context_len,
    )

    args = parse(f"--attention-backend {backend} --speculative-ddtree-budget {budget}")
    n, depth = budget + 1, min(budget, BLOCK - 1)
    assert args.speculative_dflash_block_size == BLOCK
    assert args.speculative_ddtree_budget == budget
    assert args.speculative_ddtree_topk_cap == min(budget, 16)
    assert args.speculative_num_draft_tokens == n
    assert args.speculative_num_steps == depth
    assert args.speculative_eagle_topk > 1
    assert args.disable_overlap_schedule is False  # overlap stays on
    assert args.page_size == 1 and args.attention_backend == backend
    # The per-round reservation covers the worst one-round lag of the CPU committed length
    # (D + 1 tokens) plus the draft block, the tree and the staging slots of the KV move ...
    reserve = ddtree_decode_reserve_len(args)
    assert reserve >= (depth + 1) + max(BLOCK, n + depth + 1)
    # ... fits the scheduler's estimate and the req_to_token row headroom.
    assert get_alloc_reserve_per_decode(args) >= reserve
    assert get_req_to_token_extra_context_len(args) >= reserve
    decode = args.cuda_graph_config.decode
    assert decode.bs and max(decode.bs) * n <= max(DDTREE_MAX_CUDA_GRAPH_TOKENS, n)


def test_default_backend_is_triton(parse):
    # the backend with the split-KV tree attention and no host sync in the round; an explicit
    # choice is kept
    assert parse().attention_backend == "triton"
    assert parse("--attention-backend flashinfer").attention_backend == "flashinfer"


def test_num_draft_tokens_is_the_verify_width(parse):
    args = parse("--attention-backend triton --speculative-num-draft-tokens 32")
    assert args.speculative_ddtree_budget == 31 and args.speculative_num_draft_tokens == 32


def test_topk_cap_above_budget_is_clamped(parse):
    args = parse("--attention-backend triton --speculative-ddtree-budget 7 --speculative-ddtree-topk-cap 40")
    assert args.speculative_ddtree_topk_cap == 7


def test_other_algorithms_are_unchanged(parse):
    args = parse("--attention-backend triton", algorithm="DFLASH")
    assert args.speculative_num_draft_tokens == BLOCK
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.speculative_ddtree_budget is None


# ------------------------------------------------------------------------------------------
# Server args: rejected configurations, each with its message (the same checks as 0.5.13.post1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("--speculative-ddtree-budget 0", r"1 <= --speculative-ddtree-budget <= 1023.*got 0"),
        ("--speculative-ddtree-budget 1024", r"--speculative-ddtree-budget.*got 1024"),
        ("--speculative-ddtree-topk-cap 0", r"--speculative-ddtree-topk-cap >= 1, got 0"),
        (f"--speculative-ddtree-topk-cap 1 --speculative-ddtree-budget {BLOCK}",
         rf"holds at most {BLOCK - 1} nodes, fewer than --speculative-ddtree-budget {BLOCK}"),
        ("--speculative-dflash-block-size 2 --speculative-ddtree-topk-cap 3 --speculative-ddtree-budget 4",
         r"holds at most 3 nodes"),
        ("--speculative-dflash-block-size 1", r"block size >= 2.*got 1"),
        ("--speculative-num-draft-tokens 8 --speculative-ddtree-budget 31",
         r"must equal --speculative-ddtree-budget \+ 1"),
        ("--page-size 16", r"--page-size 1.*got page_size=16"),
        ("--pp-size 2", r"DDTREE.*pp_size == 1"),
    ],
)
def test_invalid_configurations(parse, extra, message):
    with pytest.raises(ValueError, match=message):
        parse("--attention-backend triton " + extra)


def test_backend_without_tree_mask_is_refused(parse):
    with pytest.raises(ValueError, match=r"tree mask.*flashinfer, triton.*got torch_native"):
        parse("--attention-backend torch_native")


def test_draft_model_is_required(parse):
    with pytest.raises(ValueError, match=r"DDTREE.*--speculative-draft-model-path"):
        parse("--attention-backend triton", draft=False)


@pytest.mark.parametrize(
    ("flag", "algorithm"),
    [
        ("--speculative-ddtree-budget 15", "DFLASH"),
        ("--speculative-ddtree-topk-cap 4", None),
        ("--speculative-ddtree-allow-hybrid-unsafe", "DFLASH"),
        ("--speculative-ddtree-debug-metrics", None),
    ],
)
def test_ddtree_flags_need_ddtree(parse, flag, algorithm):
    name = flag.split()[0]
    with pytest.raises(ValueError, match=rf"{name} require\(s\) --speculative-algorithm DDTREE"):
        parse(f"--attention-backend triton {flag}", algorithm=algorithm, draft=algorithm is not None)


def test_ddtree_flags_need_ddtree_even_for_dummy_models():
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(ValueError, match="require"):
        prepare_server_args(["--model-path", "dummy", "--speculative-ddtree-budget", "3"])


def test_help_documents_the_flags():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    for flag in ("--speculative-ddtree-budget", "--speculative-ddtree-topk-cap",
                 "--speculative-ddtree-allow-hybrid-unsafe", "--speculative-ddtree-debug-metrics"):
        assert flag in text


# ------------------------------------------------------------------------------------------
# Requests DDTREE refuses (the server keeps serving: the scheduler aborts only that request)


def _req(**params):
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(**params)
    sp.normalize(None)
    return SimpleNamespace(sampling_params=sp, custom_logit_processor=None)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": 0.3}, "presence_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"sampling_seed": 7}, "sampling_seed"),
    ],
)
def test_refused_requests(params, message):
    from sglang.srt.speculative.ddtree_serving import validate_ddtree_request

    msg = validate_ddtree_request(_req(**params))
    assert msg and "DDTREE" in msg and message in msg


def test_plain_and_sampled_requests_are_served():
    from sglang.srt.speculative.ddtree_serving import validate_ddtree_request

    assert validate_ddtree_request(_req(temperature=0)) is None
    assert validate_ddtree_request(_req(temperature=0.7, top_p=0.9, top_k=20)) is None
    req = _req(temperature=0)
    req.custom_logit_processor = "serialized"
    assert "custom_logit_processor" in validate_ddtree_request(req)


# ------------------------------------------------------------------------------------------
# The round's pure pieces on real pools


def _reserve_rows(args, prefix_lens):
    """A real ReqToTokenPool and allocator; each request gets committed + reservation slots
    (as DFlashDraftInputV2.prepare_for_decode reserves them)."""
    from sglang.srt.arg_groups.ddtree_hook import ddtree_decode_reserve_len
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    reserve = ddtree_decode_reserve_len(args)
    pool = ReqToTokenPool(size=len(prefix_lens) + 1, max_context_len=512, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(4096, torch.bfloat16, "cpu", None, False)
    rows = []
    for i, p in enumerate(prefix_lens):
        row = i + 1
        slots = alloc.alloc(int(p) + reserve)
        pool.write((row, slice(0, int(p) + reserve)), slots.to(torch.int32))
        rows.append(row)
    return pool, torch.tensor(rows), reserve


def _round(args, seed):
    """One round's tree, target predictions (a random child most of the time) and slots."""
    n = args.speculative_num_draft_tokens
    budget, depth = n - 1, args.speculative_num_steps
    g = torch.Generator().manual_seed(seed)
    bs = 4
    logits = torch.randn(bs, depth, 24, generator=g)
    logp, ids = du.draft_topk_logprobs(logits, args.speculative_ddtree_topk_cap, backend="torch")
    tree = dr.build_tree_reference(logp, ids, budget)
    committed = torch.randint(1, 60, (bs,), generator=g)
    # the true prefix runs up to one round (D + 1 tokens) ahead of the CPU committed length
    prefix = committed + torch.randint(0, depth + 2, (bs,), generator=g)
    bonus = torch.randint(0, 24, (bs,), generator=g)
    ct = du.compile_tree(tree, bonus, prefix, build_custom_mask=False, max_depth=depth, backend="torch")
    cand = ct.draft_tokens.view(bs, n)
    predict = torch.randint(0, 24, (bs, n), generator=g)
    for b in range(bs):
        for i in range(n):
            child = int(ct.retrieve_next_token[b, i])
            if child >= 0 and torch.rand((), generator=g) < 0.85:
                predict[b, i] = cand[b, child]
    return ct, cand, predict, committed, prefix, bonus


def _check_kv_move_on_a_real_pool(slots, path, acc_idx, commit, n, depth):
    """The worker's KV move on a real MHATokenToKVPool (CPU, 3 layers): its one-launch path
    (ddtree_utils.move_kv_rows on the pool's rows; the Triton kernel in the interpreter) and
    the pool's own move_kv_cache in two copies leave the same bytes, and every committed slot
    of every layer holds the KV of its path node."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    bs = slots.shape[0]
    size = int(slots.max()) + 1
    pools = []
    for _ in range(2):
        pool = MHATokenToKVPool(size, 1, torch.float32, 2, 8, 3, "cpu", False, enable_kv_cache_copy=True)
        for layer, buf in enumerate(pool.k_buffer + pool.v_buffer):
            for b in range(bs):  # the KV of verify node j of request b in this layer
                vals = (layer * 10000 + b * 100 + torch.arange(n)).float()
                buf[slots[b, :n]] = vals.view(n, 1, 1).expand(n, *buf.shape[1:])
        pools.append(pool)
    fast, upstream = pools
    worker = SimpleNamespace(_kv_rows=None, model_runner=SimpleNamespace(token_to_kv_pool=fast))
    rows = DDTreeWorkerV2._target_kv_rows(worker)
    assert rows and len(rows.buffers) == 6 and worker._kv_rows is rows
    assert DDTreeWorkerV2._target_kv_rows(worker) is rows  # built once
    du.move_kv_rows(rows, *du.kv_path_locs(slots, path, n, depth), backend="triton")
    for tgt, src in du.kv_move_locs(slots, path, n, depth):
        upstream.move_kv_cache(tgt, src)
    for layer, (a, b_) in enumerate(zip(fast.k_buffer + fast.v_buffer, upstream.k_buffer + upstream.v_buffer)):
        for b in range(bs):
            c = int(commit[b])
            want = [layer * 10000 + b * 100 + int(j) for j in acc_idx[b, :c]]
            assert a[slots[b, :c], 0, 0].tolist() == want
            assert torch.equal(a[slots[b, : depth + 1]], b_[slots[b, : depth + 1]])
    # a pool that replaces its buffers (a resize after graph capture) gets new rows
    fast.k_buffer[0] = fast.k_buffer[0].clone()
    again = DDTreeWorkerV2._target_kv_rows(worker)
    assert again is not rows and again.buffers[0] is fast.k_buffer[0]
    assert int(again.ptrs[0]) == fast.k_buffer[0].data_ptr()


@pytest.mark.parametrize("budget", [1, 15, 63])
def test_round_accept_commit_and_kv_move(parse, budget):
    args = parse(f"--attention-backend triton --speculative-ddtree-budget {budget}")
    n, depth, block = budget + 1, args.speculative_num_steps, args.speculative_dflash_block_size
    for seed in range(4):
        ct, cand, predict, committed, prefix, bonus = _round(args, seed)
        bs = cand.shape[0]
        pool, rows, reserve = _reserve_rows(args, committed)
        # every slot the round touches lies inside the reservation of the lagging committed length
        assert bool((prefix + max(block, n + depth + 1) <= committed + reserve).all())
        slots = du.verify_slots(pool.req_to_token, rows, prefix, n + depth + 1)
        for b in range(bs):
            p = int(prefix[b])
            assert slots[b].tolist() == pool.req_to_token[rows[b], p : p + n + depth + 1].long().tolist()

        index = torch.arange(bs * n).view(bs, n)
        acc_idx, acc_len, new_bonus = du.accept_tree_greedy(
            cand, predict, index, ct.retrieve_next_token, ct.retrieve_next_sibling, depth
        )
        ref = du.verify_greedy_reference(cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth)
        for got, want in zip((acc_idx, acc_len, new_bonus), ref):
            assert torch.equal(got, want)
        out, commit, path = du.tree_commit_layout(acc_idx, acc_len, new_bonus, cand, block)

        # Stand-in for one layer's K buffer: slot s holds the value of the verify node written
        # there; both copies run as one parallel gather-scatter each, like the copy kernel.
        kv = torch.full((4097,), -1, dtype=torch.int64)
        for b in range(bs):
            kv[slots[b, :n]] = b * 1000 + torch.arange(n)
        for tgt, src in du.kv_move_locs(slots, path, n, depth):
            assert not set(tgt.tolist()) & set(src.tolist())  # race-free in one launch
            kv[tgt] = kv[src].clone()
        for b in range(bs):
            c = int(commit[b])
            committed_slots = slots[b, :c]
            assert kv[committed_slots].tolist() == [b * 1000 + int(j) for j in acc_idx[b, :c]]

        _check_kv_move_on_a_real_pool(slots, path, acc_idx, commit, n, depth)

        # what the scheduler's _resolve_spec_v2_tokens takes from the result: stride = block
        flat, lens = out.reshape(-1).tolist(), commit.tolist()
        for b in range(bs):
            taken = flat[b * block : b * block + lens[b]]
            want = [int(cand[b, j]) for j in acc_idx[b, 1 : lens[b]]] + [int(new_bonus[b])]
            assert taken == want


def test_resolve_spec_v2_tokens_consumes_the_layout(parse):
    """The real scheduler method on the DDTREE result layout (the scheduler and requests are
    stand-ins: a Req needs a tokenizer and a running scheduler)."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as BatchResultProcessor,
    )

    args = parse("--attention-backend triton --speculative-ddtree-budget 15")
    depth, block = args.speculative_num_steps, args.speculative_dflash_block_size
    ct, cand, predict, *_ = _round(args, 3)
    acc_idx, acc_len, bonus = du.verify_greedy_reference(
        cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth
    )
    out, commit, _ = du.tree_commit_layout(acc_idx, acc_len, bonus, cand, block)

    class Req(SimpleNamespace):
        def finished(self):
            return False

        def update_spec_correct_drafts_histogram(self, n):
            self.hist.append(n)

    reqs = [Req(is_retracted=False, grammar=None, kv_committed_len=10, spec_verify_ct=0,
                spec_num_correct_drafts=0, hist=[]) for _ in range(cand.shape[0])]
    seen = {}
    owner = SimpleNamespace(model_worker=SimpleNamespace(
        on_verify_complete_cpu=lambda per_req, batch_size=0: seen.update(per_req=per_req)))
    result = SimpleNamespace(next_token_ids=out.reshape(-1), accept_lens=commit, block_accept_lens=None,
                             cap_lens=None, speculative_num_draft_tokens=block)
    tokens = BatchResultProcessor._resolve_spec_v2_tokens(owner, result, SimpleNamespace(reqs=reqs))
    for b, req in enumerate(reqs):
        walk = [int(cand[b, j]) for j in acc_idx[b] if int(j) > 0] + [int(bonus[b])]
        assert tokens[b] == walk
        assert req.kv_committed_len == 10 + len(walk)
        assert req.hist == [int(acc_len[b])]
    assert seen["per_req"] == acc_len.tolist()


def test_proposer_matches_the_ddtree_utils_pipeline(parse):
    """DDTreeProposer (the draft-graph tail hook) on the CPU = ddtree_utils step by step."""
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer

    g = torch.Generator().manual_seed(0)
    block, budget, depth, k, hidden, vocab = 16, 31, 15, 8, 24, 50
    weight = torch.randn(vocab, hidden, generator=g)
    prop = DDTreeProposer(weight=weight, num_org=vocab, org_vocab_start=0, block_size=block,
                          budget=budget, topk=k, max_depth=depth, max_bs=3)
    hs = torch.randn(3 * block, hidden, generator=g)
    got = prop.compute(hs)
    logits = (hs.view(3, block, hidden)[:, 1 : 1 + depth] @ weight.T)
    logp, ids = du.draft_topk_logprobs(logits, k, backend="torch")
    tree = dr.build_tree_reference(logp, ids, budget)
    zeros = torch.zeros(3, dtype=torch.int64)
    ct = du.compile_tree(tree, zeros, zeros, build_custom_mask=False, max_depth=depth, backend="torch")
    want = (ct.draft_tokens.view(3, budget + 1), ct.depth, ct.retrieve_next_token,
            ct.retrieve_next_sibling, ct.tree_mask)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    prop(hs)  # the capture-hook form writes the static buffers
    for a, b in zip(prop.captured(3), want):
        assert torch.equal(a, b)


def test_decode_reserve_len_per_algorithm(parse):
    from sglang.srt.arg_groups.ddtree_hook import ddtree_decode_reserve_len
    from sglang.srt.runtime_context import get_context, get_server_args
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    try:
        saved = get_server_args()
    except Exception:  # noqa: BLE001 - none set yet in this process
        saved = None
    try:
        ddtree = parse("--attention-backend triton --speculative-ddtree-budget 63")
        get_context().set_server_args(ddtree)
        assert DFlashDraftInputV2.decode_reserve_len(64) == ddtree_decode_reserve_len(ddtree)
        dflash = parse("--attention-backend triton", algorithm="DFLASH")
        get_context().set_server_args(dflash)
        assert DFlashDraftInputV2.decode_reserve_len(BLOCK) == 2 * BLOCK
    finally:
        if saved is not None:
            get_context().set_server_args(saved)


def test_topk_formula_covers_the_reservation(parse):
    for budget in (1, 2, 7, 15, 31, 63, 127, 255, 1023):
        args = parse(f"--attention-backend triton --speculative-ddtree-budget {budget}")
        from sglang.srt.arg_groups.ddtree_hook import ddtree_decode_reserve_len

        steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
        assert topk == max(2, math.ceil(ddtree_decode_reserve_len(args) / (2 * steps)))


def test_tree_attention_hook_is_on_by_default_and_can_be_switched_off(parse, monkeypatch):
    from sglang.srt.layers.attention import triton_backend
    from sglang.srt.speculative.ddtree_info_v2 import (
        ddtree_tree_attention_hook,
        ddtree_tree_verify_attention,
    )

    args = parse("--attention-backend triton --speculative-ddtree-budget 15")
    monkeypatch.delenv("SGLANG_DDTREE_TREE_ATTENTION", raising=False)
    assert ddtree_tree_attention_hook(args) is ddtree_tree_verify_attention
    for off in ("0", "false", " OFF "):
        monkeypatch.setenv("SGLANG_DDTREE_TREE_ATTENTION", off)
        assert ddtree_tree_attention_hook(args) is None
    monkeypatch.setenv("SGLANG_DDTREE_TREE_ATTENTION", "1")
    assert ddtree_tree_attention_hook(args) is ddtree_tree_verify_attention
    monkeypatch.setenv("SGLANG_DDTREE_TREE_ATTENTION", "maybe")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_TREE_ATTENTION='maybe': use 1 .* or 0"):
        ddtree_tree_attention_hook(args)
    monkeypatch.delenv("SGLANG_DDTREE_TREE_ATTENTION")
    assert ddtree_tree_attention_hook(parse("--attention-backend triton", algorithm="DFLASH")) is None
    # the patched backend module imports the hook and calls it before its own verify kernels
    src = Path(triton_backend.__file__).read_text()
    assert "ddtree_tree_attention_hook(model_runner.server_args)" in src
    assert src.index("self.ddtree_tree_attention(") < src.index("self.use_verify_splitkv\n")


def test_tree_attention_hook_on_a_real_pool():
    """ddtree_tree_verify_attention with the backend's metadata (stand-ins for the backend,
    layer and forward batch: they need a model runner) over a real MHATokenToKVPool (CPU,
    float32, the kernels in Triton's interpreter): the output equals
    dr.tree_verify_attention_reference, and every case it does not cover returns
    False with the output untouched."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.ddtree_info_v2 import ddtree_tree_verify_attention

    g = torch.Generator().manual_seed(0)
    hq, hkv, dim, n, plens = 4, 2, 16, 6, (9, 40)
    bs = len(plens)
    pool = MHATokenToKVPool(256, 1, torch.float32, hkv, dim, 2, "cpu", False)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    indptr = torch.tensor([0, plens[0], sum(plens)], dtype=torch.int32)
    indices = torch.randperm(200, generator=g)[: sum(plens)].to(torch.int64) + 8
    tree = torch.ones(bs, n, n, dtype=torch.bool).tril()
    tree[:, 3, 1:3] = False  # node 3 is a child of the root, a sibling of 1 and 2
    mask = du.tree_custom_mask(tree, list(plens))
    mask_indptr = torch.tensor([0, n * (plens[0] + n), n * (sum(plens) + 2 * n)], dtype=torch.int32)
    backend = SimpleNamespace(
        forward_metadata=SimpleNamespace(custom_mask=mask, mask_indptr=mask_indptr),
        page_size=1, token_to_kv_pool=pool, num_draft_tokens=n,
    )
    layer = SimpleNamespace(layer_id=1, tp_q_head_num=hq, tp_k_head_num=hkv, qk_head_dim=dim,
                            v_head_dim=dim, scaling=0.25, xai_temperature_len=-1)
    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    q = torch.randn(bs * n, hq * dim, generator=g)
    k = torch.randn(bs * n, hkv * dim, generator=g)
    v = torch.randn(bs * n, hkv * dim, generator=g)
    plain = {"sliding_window_size": -1, "logits_soft_cap": 0.0, "sinks": None, "score_mod": None,
             "k_descale": 1.0, "v_descale": 1.0}
    o = torch.zeros(bs * n, hq * dim)
    assert ddtree_tree_verify_attention(backend, q, k, v, o, layer, verify, indptr, indices, **plain)
    want = dr.tree_verify_attention_reference(
        q.view(-1, hq, dim), pool.k_buffer[1], pool.v_buffer[1], indptr, indices,
        k.view(-1, hkv, dim), v.view(-1, hkv, dim), mask, mask_indptr, n, 0.25,
    )
    torch.testing.assert_close(o.view(-1, hq, dim), want, atol=1e-5, rtol=1e-5)
    refused = [
        ({}, SimpleNamespace(forward_mode=ForwardMode.DECODE)),
        ({"sliding_window_size": 128}, verify),
        ({"logits_soft_cap": 30.0}, verify),
        ({"k_descale": 0.5}, verify),
        ({"sinks": torch.zeros(hq)}, verify),
    ]
    for change, batch in refused:
        out = torch.zeros_like(o)
        assert not ddtree_tree_verify_attention(
            backend, q, k, v, out, layer, batch, indptr, indices, **{**plain, **change}
        )
        assert not out.any()
    # a KV cache in another dtype than q (an fp8 cache): the extend kernel's business
    fp8 = MHATokenToKVPool(256, 1, torch.float8_e4m3fn, hkv, dim, 2, "cpu", False)
    out = torch.zeros_like(o)
    assert not ddtree_tree_verify_attention(
        SimpleNamespace(**{**vars(backend), "token_to_kv_pool": fp8}),
        q, k, v, out, layer, verify, indptr, indices, **plain,
    )
    assert not out.any()
    backend.forward_metadata.custom_mask = None  # the draft's DFlash block: no tree mask
    assert not ddtree_tree_verify_attention(backend, q, k, v, o, layer, verify, indptr, indices, **plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tree_attention_equals_sglangs_extend_kernel(dtype):
    """ddtree_utils.tree_verify_attention against SGLang 0.5.16's own Triton extend kernel on
    the same FULL mask (both in Triton's interpreter): the mask layout, the prefix and the
    ancestor rule as the backend uses them."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    g = torch.Generator().manual_seed(7)
    hq, hkv, dim, n, plens = 4, 2, 16, 6, (0, 20, 70)
    bs = len(plens)
    logits = torch.randn(bs, 5, 9, generator=g) * 3
    lp, ids = du.draft_topk_logprobs(logits, 3, backend="torch")
    tree = dr.build_tree_reference(lp, ids, n - 1)
    zeros = torch.zeros(bs, dtype=torch.int64)
    tree_mask = du.compile_tree(tree, zeros, zeros, backend="torch").tree_mask
    mask = du.tree_custom_mask(tree_mask, list(plens))
    mask_indptr = torch.tensor([0, *torch.tensor([n * (p + n) for p in plens]).cumsum(0).tolist()])
    indptr = torch.tensor([0, *torch.tensor(plens).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.randperm(120, generator=g)[: sum(plens)].to(torch.int64) + 4
    kb = torch.randn(128, hkv, dim, generator=g).to(dtype)
    vb = torch.randn(128, hkv, dim, generator=g).to(dtype)
    q = torch.randn(bs * n, hq, dim, generator=g).to(dtype)
    kt = torch.randn(bs * n, hkv, dim, generator=g).to(dtype)
    vt = torch.randn(bs * n, hkv, dim, generator=g).to(dtype)
    qo_indptr = torch.arange(0, (bs + 1) * n, n, dtype=torch.int32)
    ext = torch.empty_like(q)
    extend_attention_fwd(q, kt, vt, ext, kb, vb, qo_indptr, indptr, indices, mask, True,
                         mask_indptr, n, 1.0, 1.0, 0.3)
    got = du.tree_verify_attention(q, kb, vb, indptr, indices, kt, vt, mask, mask_indptr, n, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(got.float(), ext.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("n", [5, 1])
def test_target_predict_samples_each_request_with_its_own_parameters(n):
    """DDTreeWorkerV2._target_predict, the per-node target tokens of the tree walk: a greedy
    request gets every node's argmax; a sampled request a token inside its own filter. The
    per-request parameters are expanded request-major (row b * N + i = node i of request b).
    N = 1 is budget auto's `off` round: the root's token is the target's own sample."""
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    torch.manual_seed(0)
    bs, vocab = 3, 50
    logits = torch.randn(bs * n, vocab, generator=torch.Generator().manual_seed(1)) * 3
    worker = SimpleNamespace(num_verify_tokens=n)
    info = SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.tensor([[1.0], [0.7], [1.0]]),  # [bs, 1], as SGLang keeps them
        top_ks=torch.tensor([1, 2, 1 << 30]),  # greedy, top-k 2, unset
        top_ps=torch.ones(3),
        min_ps=torch.tensor([0.0, 0.0, 0.6]),
        need_top_k_sampling=True,
        need_top_p_sampling=False,
        need_min_p_sampling=True,
    )
    argmax = logits.argmax(-1).view(bs, n)
    top2 = logits.topk(2, dim=-1).indices.view(bs, n, 2)
    probs = torch.softmax(logits, -1).view(bs, n, vocab)  # request 2 runs at T = 1
    min_p_ok = probs[2] >= 0.6 * probs[2].max(-1, keepdim=True).values  # [n, V]
    draws = torch.stack([DDTreeWorkerV2._target_predict(worker, logits, info, bs, n) for _ in range(40)])
    assert draws.shape == (40, bs, n) and draws.dtype == torch.int64
    assert torch.equal(draws[:, 0], argmax[0].expand(40, n))
    assert (draws[:, 1, :, None] == top2[1]).any(-1).all()
    assert (draws[:, 1] != argmax[1]).any()  # it samples, not argmax every time
    assert min_p_ok.gather(1, draws[:, 2].T).all()
    info.is_all_greedy = True
    assert torch.equal(DDTreeWorkerV2._target_predict(worker, logits, info, bs, n), argmax)
