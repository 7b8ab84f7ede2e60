"""DDTreeVerifyInput against ddtree_utils' reference, on CPU with the real sglang package.

Trees come from ddtree_utils on random draft logits; the target's predictions are chosen so
that a known random root-to-node path is accepted. The real ReqToTokenPool,
TokenToKVPoolAllocator, ChunkCache and Req classes run on CPU (sglang's Triton helpers under
TRITON_INTERPRET=1). The batch object is a SimpleNamespace holding exactly the fields the
verify input reads: ScheduleBatch needs a full scheduler to construct, and this stands in
for it only.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

import ddtree_reference as dr

VOCAB = 64
HIDDEN = 8
BLOCK = 16


def _modules() -> SimpleNamespace:
    """The sglang pieces under test (imported after the overlay is on sys.path)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import ddtree_utils
    from sglang.srt.speculative.ddtree_info import DDTreeVerifyInput

    return SimpleNamespace(
        Req=Req,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        CacheInitParams=CacheInitParams,
        ChunkCache=ChunkCache,
        ReqToTokenPool=ReqToTokenPool,
        ForwardMode=ForwardMode,
        SamplingParams=SamplingParams,
        ddtree_utils=ddtree_utils,
        DDTreeVerifyInput=DDTreeVerifyInput,
    )


@pytest.fixture(scope="module")
def m(sglang_overlay):
    return _modules()


def _make_tree(m, bs, budget, seq_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, BLOCK - 1, VOCAB, generator=gen) * 3
    max_depth = min(budget, BLOCK - 1)
    logp, ids = m.ddtree_utils.draft_topk_logprobs(
        logits[:, :max_depth], min(budget, 8)
    )
    tree = dr.build_tree_reference(logp, ids, budget)
    bonus = torch.randint(3, VOCAB, (bs,), generator=gen)
    compiled = m.ddtree_utils.compile_tree(
        tree,
        bonus,
        torch.tensor(seq_lens),
        seq_lens_cpu=list(seq_lens),
        max_depth=max_depth,
    )
    return compiled, max_depth


def _random_path(parents, valid, rng, max_depth):
    """A random root-to-node path (verify indices, root first) of the tree."""
    n = len(parents)
    children = {
        i: [j for j in range(1, n) if parents[j] == i and valid[j]] for i in range(n)
    }
    path = [0]
    target_len = rng.randint(0, max_depth)
    while len(path) - 1 < target_len and children[path[-1]]:
        path.append(rng.choice(children[path[-1]]))
    return path


def _target_logits(compiled, paths, bs, n, rng, gen):
    """Verify logits whose argmax follows each request's path, then stops at a non-child."""
    tokens = compiled.draft_tokens.view(bs, n)
    parents = compiled.parents
    predict = torch.randint(3, VOCAB, (bs, n), generator=gen)
    for b, path in enumerate(paths):
        for a, c in itertools.pairwise(path):
            predict[b, a] = tokens[b, c]
        last = path[-1]
        child_tokens = {
            int(tokens[b, j]) for j in range(n) if int(parents[b, j]) == last
        }
        choices = [t for t in range(3, VOCAB) if t not in child_tokens]
        predict[b, last] = rng.choice(choices)
    logits = torch.randn(bs * n, VOCAB, generator=gen)
    logits.scatter_(1, predict.view(-1, 1), 20.0)
    return logits, predict


def _tree_paths_logits(m, seq_lens, budget, seed):
    """A tree per request (all nodes valid), a random root-to-node path in each, and verify
    logits whose argmax follows it: (compiled, max_depth, paths, logits, generator for further
    draws)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    bs, n = len(seq_lens), budget + 1
    compiled, max_depth = _make_tree(m, bs, budget, seq_lens, seed)
    paths = [
        _random_path(compiled.parents[b].tolist(), [True] * n, rng, max_depth)
        for b in range(bs)
    ]
    logits, _ = _target_logits(compiled, paths, bs, n, rng, gen)
    return compiled, max_depth, paths, logits, gen


def _setup(m, seq_lens, max_new):
    bs = len(seq_lens)
    pool = m.ReqToTokenPool(
        size=bs + 2, max_context_len=1024, device="cpu", enable_memory_saver=False
    )
    alloc = m.TokenToKVPoolAllocator(
        size=4096, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False
    )
    cache = m.ChunkCache(
        m.CacheInitParams(
            disable=True,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=alloc,
            page_size=1,
        )
    )
    reqs, pool_idx = [], []
    for i, (s, mn) in enumerate(zip(seq_lens, max_new)):
        sp = m.SamplingParams(max_new_tokens=mn, temperature=0, ignore_eos=True)
        sp.normalize(None)
        req = m.Req(f"r{i}", "", list(range(3, 3 + s)), sp, vocab_size=VOCAB)
        # The committed prefix already owns s KV slots.
        pool.req_to_token[i + 1, :s] = alloc.alloc(s)
        reqs.append(req)
        pool_idx.append(i + 1)
    batch = SimpleNamespace(
        forward_mode=m.ForwardMode.TARGET_VERIFY,
        input_ids=None,
        out_cache_loc=None,
        tree_cache=cache,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=alloc,
        req_pool_indices=torch.tensor(pool_idx, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        reqs=reqs,
        sampling_info=None,
        device="cpu",
    )
    batch.batch_size = lambda: len(reqs)
    return batch


def _verify_input(m, compiled, n, max_depth):
    return m.DDTreeVerifyInput(
        draft_token=compiled.draft_tokens,
        positions=compiled.positions,
        draft_token_num=n,
        custom_mask=compiled.custom_mask,
        retrieve_index=compiled.retrieve_index,
        retrieve_next_token=compiled.retrieve_next_token,
        retrieve_next_sibling=compiled.retrieve_next_sibling,
        max_depth=max_depth,
    )


@pytest.mark.parametrize("budget,seed", [(1, 0), (15, 1), (63, 2), (255, 3)])
def test_greedy_verify_matches_reference(m, budget, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    seq_lens = [5, 17, 40, 3]
    bs, n = len(seq_lens), budget + 1
    # Request 2 may finish mid-path (max_new_tokens 2): its commit is truncated.
    max_new = [64, 64, 2, 64]
    compiled, max_depth = _make_tree(m, bs, budget, seq_lens, seed)
    paths = [
        _random_path(
            compiled.parents[b].tolist(),
            [True] + [bool(x) for x in compiled.tree_mask[b].diagonal()[1:]],
            rng,
            max_depth,
        )
        for b in range(bs)
    ]
    if budget >= 15:  # deep, branching acceptance is exercised, not only the root
        assert max(len(p) for p in paths) >= 3
    logits, predict = _target_logits(compiled, paths, bs, n, rng, gen)
    hidden = torch.randn(bs * n, HIDDEN, generator=gen)

    batch = _setup(m, seq_lens, max_new)
    free_before = batch.token_to_kv_pool_allocator.available_size()
    vi = _verify_input(m, compiled, n, max_depth)
    vi.prepare_for_verify(batch, page_size=1)

    out_cache_loc = batch.out_cache_loc.clone()
    assert out_cache_loc.numel() == bs * n
    assert torch.equal(batch.input_ids, compiled.draft_tokens)
    for b, s in enumerate(seq_lens):
        row = batch.req_to_token_pool.req_to_token[b + 1, s : s + n]
        assert torch.equal(row.to(torch.int64), out_cache_loc[b * n : (b + 1) * n])

    # Reference: ddtree_utils' walk on the same tree and target argmax.
    ref_index, ref_len, ref_bonus = m.ddtree_utils.verify_greedy_reference(
        compiled.draft_tokens.view(bs, n),
        compiled.retrieve_next_token,
        compiled.retrieve_next_sibling,
        predict,
        max_depth,
    )
    for b, path in enumerate(
        paths
    ):  # the constructed path is what the reference accepts
        assert ref_index[b, : len(path)].tolist() == path
        assert int(ref_len[b]) == len(path) - 1

    logits_output = SimpleNamespace(
        next_token_logits=logits, hidden_states=hidden.clone()
    )
    bonus, commit_lens, next_hidden, correct = vi.verify(
        batch=batch, logits_output=logits_output, page_size=1
    )

    tokens = compiled.draft_tokens.view(bs, n)
    exp_commit, exp_hidden_rows, exp_keep = [], [], []
    for b, path in enumerate(paths):
        proposed = [int(tokens[b, j]) for j in path[1:]] + [int(ref_bonus[b])]
        committed = proposed[: max_new[b]]  # finish truncation (ignore_eos)
        assert list(batch.reqs[b].output_ids) == committed
        exp_commit.append(len(committed))
        rows = [b * n + j for j in path[: len(committed)]]
        exp_hidden_rows += rows
        exp_keep.append(out_cache_loc[rows])
        assert int(bonus[b]) == committed[-1]
        assert int(vi.last_node_index[b]) == path[len(committed) - 1]
        s = seq_lens[b]
        written = batch.req_to_token_pool.req_to_token[b + 1, s : s + len(committed)]
        assert torch.equal(written.to(torch.int64), out_cache_loc[rows])
        assert batch.reqs[b].kv_committed_len == len(committed)
    assert commit_lens.tolist() == exp_commit
    assert correct == [c - 1 for c in exp_commit]
    assert torch.equal(next_hidden, hidden[exp_hidden_rows])
    assert torch.equal(batch.out_cache_loc, torch.cat(exp_keep))
    assert batch.seq_lens.tolist() == [s + c for s, c in zip(seq_lens, exp_commit)]
    assert batch.seq_lens_cpu.tolist() == batch.seq_lens.tolist()
    assert batch.seq_lens_sum == sum(seq_lens) + sum(exp_commit)
    assert logits_output.hidden_states is None

    # Every tree slot off the committed paths went back to the allocator, and only those.
    alloc = batch.token_to_kv_pool_allocator
    kept = set(torch.cat(exp_keep).tolist())
    freed = set(out_cache_loc.tolist()) - kept
    assert alloc.available_size() == free_before - sum(exp_commit)
    free_now = set(alloc.free_pages.tolist())
    assert freed <= free_now and not (kept & free_now)


def test_sampling_verify_with_one_hot_targets_follows_the_path(m, sampler):
    """top_k=1 makes the target distribution one-hot: sampling must accept the greedy path."""
    seq_lens = [9, 30, 4]
    bs, budget = len(seq_lens), 31
    n = budget + 1
    compiled, max_depth, paths, logits, gen = _tree_paths_logits(m, seq_lens, budget, 7)
    batch = _setup(m, seq_lens, [64] * bs)
    batch.sampling_info = SimpleNamespace(
        is_all_greedy=False,
        temperatures=torch.full((bs, 1), 0.7),
        top_ks=torch.ones(bs, dtype=torch.int32),
        top_ps=torch.full((bs,), 0.9),
        has_custom_logit_processor=False,
        penalizer_orchestrator=SimpleNamespace(is_required=False),
        logit_bias=None,
    )
    batch.sampling_info = _Sized(batch.sampling_info, bs)
    vi = _verify_input(m, compiled, n, max_depth)
    vi.prepare_for_verify(batch, page_size=1)
    hidden = torch.randn(bs * n, HIDDEN, generator=gen)
    vi.verify(
        batch=batch,
        logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
        page_size=1,
    )
    for b, path in enumerate(paths):
        assert vi.accept_index[b, : len(path)].tolist() == path
        assert int(vi.accept_len[b]) == len(path) - 1


class _Sized:
    """sampling_info stand-in with len() (SamplingBatchInfo needs a full batch to build)."""

    def __init__(self, ns, size):
        self.__dict__.update(vars(ns))
        self._size = size

    def __len__(self):
        return self._size


def test_prepare_for_verify_refuses_paged_kv_and_missing_mask(m):
    compiled, max_depth = _make_tree(m, 1, 3, [4], 0)
    batch = _setup(m, [4], [8])
    vi = _verify_input(m, compiled, 4, max_depth)
    with pytest.raises(ValueError, match="page_size == 1"):
        vi.prepare_for_verify(batch, page_size=16)
    vi.custom_mask = None
    with pytest.raises(ValueError, match="custom_mask"):
        vi.prepare_for_verify(batch, page_size=1)


# --- DDTreeWorker pieces that run without a model ------------------------------------------
# A DDTreeWorker needs loaded target and draft models (GPU). The methods below are called on
# stand-in `self` objects carrying only the attributes they read.


@pytest.fixture(scope="module")
def worker_mod(sglang_overlay):
    from sglang.srt.speculative import ddtree_worker

    return ddtree_worker


class _Recorder:
    """Stands in for a hybrid attention backend: records the Mamba commit call."""

    def __init__(self):
        self.calls = []

    def update_mamba_state_after_mtp_verify(self, **kwargs):
        self.calls.append(kwargs)


def test_mamba_commit_uses_the_tree_node_of_each_committed_token(worker_mod):
    backend = _Recorder()
    fake = SimpleNamespace(
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(attn_backend=backend, model=None)
        ),
        server_args=SimpleNamespace(mamba_track_interval=4),
    )
    # Paths (block-local, root first): request 0 commits 3 tokens, request 1 one.
    path = torch.tensor([[0, 2, 7, -1], [0, -1, -1, -1]])
    commit = torch.tensor([3, 1], dtype=torch.int32)
    pre = torch.tensor([6, 9])
    batch = SimpleNamespace(
        seq_lens=pre + commit, mamba_track_indices=torch.tensor([0, 1])
    )
    worker_mod.DFlashWorker._update_target_mamba_state_after_verify(
        fake,
        batch=batch,
        seq_lens_pre_verify=pre,
        commit_lens=commit,
        step_index_map=path,
    )
    (call,) = backend.calls
    assert call["last_correct_step_indices"].tolist() == [7, 0]
    # Request 0 crosses the track point 8 at its 2nd committed token (index 1) -> node 2.
    steps = call["mamba_steps_to_track"].tolist()
    ith = (((pre + commit) // 4) * 4 - pre - 1).clamp(min=0)
    crosses = (pre // 4 != (pre + commit) // 4) & (ith < commit)
    want = [int(path[b, ith[b]]) if crosses[b] else -1 for b in range(2)]
    assert steps == want and steps[0] == 2


def test_chain_mamba_commit_is_unchanged_without_a_map(worker_mod):
    backend = _Recorder()
    fake = SimpleNamespace(
        target_worker=SimpleNamespace(
            model_runner=SimpleNamespace(attn_backend=backend, model=None)
        ),
        server_args=SimpleNamespace(mamba_track_interval=4),
    )
    commit = torch.tensor([3, 1], dtype=torch.int32)
    batch = SimpleNamespace(seq_lens=torch.tensor([9, 10]), mamba_track_indices=None)
    worker_mod.DFlashWorker._update_target_mamba_state_after_verify(
        fake, batch=batch, seq_lens_pre_verify=torch.tensor([6, 9]), commit_lens=commit
    )
    assert backend.calls[0]["last_correct_step_indices"].tolist() == [2, 0]


def test_hybrid_target_is_refused_without_the_flag(worker_mod):
    target = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=_Recorder()))
    args = SimpleNamespace(
        speculative_ddtree_allow_hybrid_unsafe=False, speculative_eagle_topk=2
    )
    worker = worker_mod.DDTreeWorker.__new__(worker_mod.DDTreeWorker)
    with pytest.raises(ValueError, match="--speculative-ddtree-allow-hybrid-unsafe"):
        worker.__init__(args, 0, 0, None, 0, 0, 0, 0, target)


class _FakeTPGroup:
    """Two-rank tensor-parallel group seen from rank 0: all_gather fills rank 1's share from
    precomputed statistics (one process cannot hold both ranks)."""

    world_size = 2

    def __init__(self, other):
        self.other = list(other)

    def all_gather_into_tensor(self, out, inp):
        out[0].copy_(inp)
        out[1].copy_(self.other.pop(0))


def _lm_head(weight, start):
    shard = SimpleNamespace(
        num_org_elements=weight.shape[0], org_vocab_start_index=start
    )
    return SimpleNamespace(weight=weight, shard_indices=shard)


def test_draft_topk_logprobs_single_and_two_shards(worker_mod, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    bs, depth, hidden, vocab, k = 2, 5, 16, 40, 6
    hs = torch.randn(bs, depth, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    full = torch.log_softmax(hs @ weight.T, dim=-1)
    want_logp, want_ids = full.topk(k, dim=-1)

    monkeypatch.setattr(
        worker_mod, "get_tp_group", lambda: SimpleNamespace(world_size=1)
    )
    logp, ids = worker_mod.DDTreeWorker._draft_topk_logprobs(
        None, hs, _lm_head(weight, 0), k, token_chunk=3
    )
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)

    # Rank 0 owns ids [0, 20), rank 1 [20, 40).
    half = vocab // 2
    other = worker_mod.ddtree_utils.shard_topk_stats(
        (hs @ weight[half:].T).reshape(1, bs * depth, half), k, half
    )
    monkeypatch.setattr(worker_mod, "get_tp_group", lambda: _FakeTPGroup(other))
    logp, ids = worker_mod.DDTreeWorker._draft_topk_logprobs(
        None, hs, _lm_head(weight[:half], 0), k, token_chunk=bs * depth
    )
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)


def test_debug_metrics_histogram(worker_mod):
    """The worker's metrics are ddtree_serving's (the same on both pins), fed per round with
    the accept lengths, the valid tree nodes and the build time."""
    metrics = worker_mod.ddtree_serving.DDTreeDebugMetrics(max_depth=3, budget=15)
    metrics.record([0, 2, 3], tree_nodes=30, build_ms=1.5)
    metrics.record([5, 1], tree_nodes=20, build_ms=0.5)
    snap = metrics.snapshot()
    assert snap["rounds"] == 2
    assert snap["accepted_depth_hist"] == [1, 1, 1, 2]  # depth 5 clamps to max_depth
    assert snap["avg_tree_size"] == 50 / 5
    assert snap["avg_tree_build_ms"] == 1.0


class _Rank0Group:
    """A TP group seen from rank 1: broadcast(src=0) overwrites with rank 0's tensors."""

    world_size = 2

    def __init__(self, rank0_tensors):
        self.rank0 = list(rank0_tensors)
        self.calls = 0

    def broadcast(self, tensor, src=0):
        assert src == 0
        tensor.copy_(self.rank0[self.calls])
        self.calls += 1


def test_sampled_decision_is_taken_from_tp_rank0(m, monkeypatch, sampler):
    from sglang.srt.distributed import parallel_state

    seq_lens = [12, 7]
    bs, budget = len(seq_lens), 15
    n = budget + 1
    compiled, max_depth, paths, logits, gen = _tree_paths_logits(
        m, seq_lens, budget, 11
    )
    # Rank 0 accepted nothing and drew bonus tokens 5 and 6.
    rank0_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int64)
    rank0_index[:, 0] = 0
    group = _Rank0Group(
        [rank0_index, torch.zeros(bs, dtype=torch.int64), torch.tensor([5, 6])]
    )
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)

    batch = _setup(m, seq_lens, [64] * bs)
    batch.sampling_info = _Sized(
        SimpleNamespace(
            is_all_greedy=False,
            temperatures=torch.full((bs, 1), 0.7),
            top_ks=torch.ones(bs, dtype=torch.int32),
            top_ps=torch.ones(bs),
            has_custom_logit_processor=False,
            penalizer_orchestrator=SimpleNamespace(is_required=False),
            logit_bias=None,
        ),
        bs,
    )
    vi = _verify_input(m, compiled, n, max_depth)
    vi.prepare_for_verify(batch, page_size=1)
    slots = batch.out_cache_loc.clone()
    hidden = torch.randn(bs * n, HIDDEN, generator=gen)
    _, commit_lens, next_hidden, _ = vi.verify(
        batch=batch,
        logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=hidden),
        page_size=1,
    )
    assert group.calls == 3
    assert [list(r.output_ids) for r in batch.reqs] == [[5], [6]]
    assert commit_lens.tolist() == [1, 1]
    assert torch.equal(batch.out_cache_loc, slots[[0, n]])
    assert torch.equal(next_hidden, hidden[[0, n]])


def test_tree_builder_matches_ddtree_utils(m, worker_mod):
    """The worker's tree step (graph replay off / on CPU) == build_tree + compile_tree."""
    gen = torch.Generator().manual_seed(5)
    bs, budget, depth = 3, 31, 15
    logp, ids = m.ddtree_utils.draft_topk_logprobs(
        torch.randn(bs, depth, VOCAB, generator=gen), 8
    )
    bonus, seq_lens = torch.tensor([4, 9, 11]), torch.tensor([7, 30, 2])
    builder = worker_mod._TreeBuilder(budget, 8, depth, use_cuda_graph=True)
    node_valid, got = builder(logp, ids, bonus, seq_lens)
    tree = m.ddtree_utils.build_tree(logp, ids, budget, topk_cap=8)
    want = m.ddtree_utils.compile_tree(tree, bonus, seq_lens, seq_lens_cpu=seq_lens)
    assert torch.equal(node_valid, tree.node_valid)
    for name in want._fields:
        if name != "custom_mask":
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    mask = m.ddtree_utils.tree_custom_mask(got.tree_mask, seq_lens)
    assert torch.equal(mask, want.custom_mask)


# --- Sampled verify: one target draw per node (ddtree_utils.sample_from_logits) + greedy walk --


def _dense_target_probs(m, logits, temperature, top_k, top_p, min_p):
    """The plain target sampler's distribution, dense (ddtree_utils' reference)."""
    try:
        return dr.target_probs_from_logits(logits, temperature, top_k, top_p, min_p=min_p)
    except TypeError:
        # TEMPORARY (until the sampling engineer's ddtree_utils lands on main): the reference
        # without min_p, with SGLang's min-p rule applied on top (p >= min_p * p_max).
        probs = dr.target_probs_from_logits(logits, temperature, top_k, top_p)
        if min_p is not None:
            mp = torch.as_tensor(min_p, dtype=probs.dtype).reshape(-1, *([1] * (probs.dim() - 1)))
            probs = torch.where(probs >= mp * probs.amax(dim=-1, keepdim=True), probs, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


@pytest.fixture
def sampler(m, monkeypatch):
    """ddtree_utils.sample_from_logits, or a TEMPORARY test-only stand-in with the same
    signature (a multinomial draw from the dense reference) while the sampling engineer's
    function is not on this branch yet. Remove the stand-in when it lands."""
    if not hasattr(m.ddtree_utils, "sample_from_logits"):
        def _stand_in(logits, temperature, top_k, top_p, min_p=None, *, max_top_k=None,
                      generator=None, backend="auto"):
            probs = _dense_target_probs(m, logits, temperature, top_k, top_p, min_p)
            return torch.multinomial(probs.float(), 1, generator=generator).view(-1)

        monkeypatch.setattr(m.ddtree_utils, "sample_from_logits", _stand_in, raising=False)
    return m.ddtree_utils.sample_from_logits


def _real_sampling_info(m, reqs, vocab, monkeypatch, tiny_args):
    """SamplingBatchInfo.from_schedule_batch over real Reqs (the batch stands in for a
    ScheduleBatch: only reqs and device are read)."""
    from sglang.srt import server_args as server_args_mod
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    class _Batch:  # weak-referenceable, unlike SimpleNamespace (the penalizers keep a weakref)
        def __init__(self):
            self.reqs, self.device = reqs, "cpu"

    monkeypatch.setattr(server_args_mod, "_global_server_args", tiny_args)
    batch = _Batch()
    return SamplingBatchInfo.from_schedule_batch(batch, vocab), batch


@pytest.fixture(scope="module")
def tiny_args(sglang_overlay, tiny_models):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", str(tiny_models.target), "--device", "cuda",
                                "--attention-backend", "triton", "--speculative-algorithm", "DDTREE",
                                "--speculative-draft-model-path", str(tiny_models.draft)])


def _req(m, i, **params):
    sp = m.SamplingParams(max_new_tokens=64, **params)
    sp.normalize(None)
    return m.Req(f"s{i}", "", [3, 4, 5], sp, vocab_size=VOCAB)


@pytest.mark.stat
def test_sampled_verify_draws_the_target_distribution_and_keeps_greedy_rows_exact(
    m, sampler, monkeypatch, tiny_args
):
    """A mixed batch: copies of one sampled request (temperature, top-k, top-p, min-p and a
    logit bias) and of one greedy request share a tree and verify logits. The first token a
    sampled row emits is its root node's draw, so its frequencies must match the target's
    filtered distribution (logit bias included), with no token outside its support; the
    greedy rows must accept exactly the greedy walk of the argmax."""
    per, budget = 400, 15
    n = budget + 1
    seq_lens = [6] * (2 * per)
    bs = len(seq_lens)
    compiled, max_depth = _make_tree(m, 1, budget, [6], 21)
    cand = compiled.draft_tokens.view(1, n).expand(bs, n).contiguous()
    gen = torch.Generator().manual_seed(21)
    node_logits = torch.randn(n, VOCAB, generator=gen) * 2.0
    logits = node_logits.repeat(bs, 1)
    bias = {"5": 1.5, "9": -30.0}
    params = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logit_bias=bias)
    reqs = [_req(m, i, **params) for i in range(per)] + [
        _req(m, per + i, temperature=0.0) for i in range(per)]
    info, _batch = _real_sampling_info(m, reqs, VOCAB, monkeypatch, tiny_args)
    vi = m.DDTreeVerifyInput(
        draft_token=cand.view(-1), positions=compiled.positions.view(1, n).expand(bs, n).reshape(-1),
        draft_token_num=n, custom_mask=None,
        retrieve_index=torch.arange(bs * n).view(bs, n),
        retrieve_next_token=compiled.retrieve_next_token.expand(bs, n).contiguous(),
        retrieve_next_sibling=compiled.retrieve_next_sibling.expand(bs, n).contiguous(),
        max_depth=max_depth,
    )
    from sglang.srt.speculative.dflash_info import _apply_verify_logits_adjustments

    _apply_verify_logits_adjustments(logits, info, bs, n)
    accept_index, accept_len, bonus = vi._sampling_accept(cand, logits, info)

    first = torch.where(
        accept_len > 0,
        torch.gather(cand, 1, accept_index[:, 1:2].clamp(min=0)).view(-1),
        bonus,
    )
    biased_root = node_logits[0].clone()
    biased_root[5] += 1.5
    biased_root[9] -= 30.0
    want = _dense_target_probs(m, biased_root.view(1, -1), torch.tensor([0.7]),
                               torch.tensor([20]), torch.tensor([0.9]), torch.tensor([0.05]))[0]
    got = torch.bincount(first[:per], minlength=VOCAB).double() / per
    assert not bool(((want == 0) & (got > 0)).any()), "a token outside the target's support"
    sigma = (want.double() * (1 - want.double()) / per).sqrt()
    assert bool(((got - want.double()).abs() <= 5 * sigma + 1.0 / per).all())
    assert int((want > 0).sum()) >= 2  # the filter leaves a real choice

    greedy_index, greedy_len, greedy_bonus = m.ddtree_utils.verify_greedy_reference(
        cand[per:], vi.retrieve_next_token[per:], vi.retrieve_next_sibling[per:],
        logits[per * n:].argmax(dim=-1).view(per, n), max_depth)
    assert torch.equal(accept_index[per:], greedy_index)
    assert torch.equal(accept_len[per:], greedy_len)
    assert torch.equal(bonus[per:], greedy_bonus)
