"""--speculative-ddtree-budget auto on SGLang 0.5.16 (patched), on the CPU, in the child Python of
test_v2_pin.py.

Real sglang 0.5.16 modules with the build laid over them: server args through the real
prepare_server_args, the real DDTreeProposer (draft-graph tail hook) pricing every width, the real
ddtree_budget.AutoRounds feed, DDTreeWorkerV2.on_verify_complete_cpu / get_ddtree_server_info, the
scheduler's real _resolve_spec_v2_tokens and get_internal_state. What needs a GPU (the draft and
target forwards, the per-width CUDA-graph capture, CUDA events) is stood in for where it is used,
and said so there; tests/gpu/ddtree_e2e.py runs the server with `auto`.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ddtree_budget as db
import ddtree_utils as du

_FIX = Path(__file__).resolve().parents[2] / "sglang" / "fixtures.py"
_spec = importlib.util.spec_from_file_location("ddtree_fixtures_v2_auto", _FIX)
fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixtures)

BLOCK = fixtures.draft_config()["block_size"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return fixtures.write_model_dirs(tmp_path_factory.mktemp("tiny"), block_size=BLOCK)


@pytest.fixture(scope="module")
def parse(models):
    from sglang.srt.server_args import prepare_server_args

    def _parse(extra: str = ""):
        argv = ["--model-path", str(models.target), "--device", "cuda", "--speculative-algorithm", "DDTREE",
                "--speculative-draft-model-path", str(models.draft), "--attention-backend", "triton"]
        return prepare_server_args([*argv, *shlex.split(extra)])

    return _parse


# ------------------------------------------------------------------------------------------
# Server args and the round feed's buckets


@pytest.mark.parametrize(
    ("extra", "widths"),
    [
        ("--cuda-graph-max-bs 16", [8, 16, 32, 64, 128, 256]),
        ("--cuda-graph-max-bs 48", [8, 16, 32, 64, 128, 256]),
        ("--cuda-graph-max-bs-decode 256", [8, 16, 32, 64, 128, 256]),
        ("--disable-cuda-graph --max-running-requests 8", [8, 16, 32, 64, 128, 256]),
    ],
)
def test_budget_auto_resolves_its_widths_and_is_served(parse, extra, widths):
    """auto parses, resolves its widths and starts: the widest width sizes the tree buffers;
    the worker's round feed gets the widths, each with its own batch range (the graph sizes of at
    most 4096 tokens at that width; the narrowest serves every batch), and cost buckets (the
    graph batch sizes, plus the running cap above them)."""
    from sglang.srt.speculative import ddtree_serving as ds
    from sglang.srt.speculative.ddtree_auto_v2 import auto_rounds, width_limits

    args = parse(f"--speculative-ddtree-budget auto {extra}")
    assert args.speculative_ddtree_auto_widths == widths
    assert args.speculative_ddtree_budget == widths[-1] - 1
    assert args.speculative_num_draft_tokens == widths[-1]
    rounds = auto_rounds(args, "cpu")
    assert rounds.widths == widths and not rounds.cycle
    table = rounds.controller.table
    graph_bs = [] if args.disable_cuda_graph else sorted(set(args.cuda_graph_config.decode.bs))
    cap = int(args.max_running_requests)
    if graph_bs:
        assert table.buckets == graph_bs + ([cap] if cap > graph_bs[-1] else [])
        assert table.graph_sizes == graph_bs
        # the list is trimmed for the narrowest width only: 8 x 512 = 4096 tokens
        assert max(graph_bs) == min(int(extra.split()[-1]), 512)
    else:
        assert table.buckets[-1] == cap and all(b & (b - 1) == 0 for b in table.buckets[:-1])
    limits = width_limits(args)
    assert limits == ds.auto_width_limits(widths, graph_bs) and limits[widths[0]] is None
    assert width_limits(args) is limits  # cached: the scheduler asks for it twice a round
    assert rounds.controller.limits == limits
    # a fixed budget has no feed and no ranges
    fixed = parse("--speculative-ddtree-budget 15")
    assert auto_rounds(fixed, "cpu") is None and width_limits(fixed) is None
    with pytest.raises(SystemExit):  # argparse: not an integer nor auto
        parse("--speculative-ddtree-budget 63x")
    with pytest.raises(ValueError, match="drop --speculative-num-draft-tokens"):
        parse("--speculative-ddtree-budget AUTO --speculative-num-draft-tokens 16")


def test_auto_only_runs_the_listed_options_in_turn(parse, monkeypatch):
    """SGLANG_DDTREE_AUTO_ONLY (the worker's round feed, ddtree_auto_v2.auto_rounds): "off" forces
    plain-decode rounds (every batch), "off,16" cycles the two; unset, the controller chooses;
    anything else, or an option the server does not serve, is refused at start-up."""
    from sglang.srt.speculative import ddtree_budget as pdb
    from sglang.srt.speculative.ddtree_auto_v2 import ONLY_ENV, auto_rounds

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16")
    monkeypatch.setenv(ONLY_ENV, "off")
    rounds = auto_rounds(args, "cpu")
    assert rounds.cycle and {rounds.choose(b) for b in (1, 4, 16) for _ in range(3)} == {pdb.OFF_WIDTH}
    assert rounds.snapshot()["cycle_widths"] == [pdb.OFF_WIDTH]
    monkeypatch.setenv(ONLY_ENV, " 16, off ")
    rounds = auto_rounds(args, "cpu")
    assert [rounds.choose(4) for _ in range(4)] == [pdb.OFF_WIDTH, 16, pdb.OFF_WIDTH, 16]
    monkeypatch.delenv(ONLY_ENV)
    assert not auto_rounds(args, "cpu").cycle
    for bad, match in (("plain", "list off and tree widths"), ("off,12", "not served")):
        monkeypatch.setenv(ONLY_ENV, bad)
        with pytest.raises(ValueError, match=match):
            auto_rounds(args, "cpu")
    monkeypatch.setenv(ONLY_ENV, "off")
    monkeypatch.setenv("SGLANG_DDTREE_AUTO_OFF", "0")
    with pytest.raises(ValueError, match="not served"):
        auto_rounds(args, "cpu")


def test_budget_auto_is_the_default(parse):
    """This pin serves auto, so DDTREE without --speculative-ddtree-budget runs it (the server
    args the pin's real handling derives equal those of an explicit auto); a verify width
    (--speculative-num-draft-tokens) or a budget given keeps a fixed budget."""
    default, explicit = parse(), parse("--speculative-ddtree-budget auto")
    assert default.speculative_ddtree_auto_widths == explicit.speculative_ddtree_auto_widths
    assert default.speculative_ddtree_auto_widths[0] == 8
    for field in ("speculative_ddtree_budget", "speculative_num_draft_tokens", "speculative_ddtree_topk_cap",
                  "speculative_num_steps", "speculative_eagle_topk", "max_running_requests"):
        assert getattr(default, field) == getattr(explicit, field), field
    assert default.speculative_ddtree_budget == default.speculative_ddtree_auto_widths[-1] - 1
    width = parse("--speculative-num-draft-tokens 32")
    assert (width.speculative_ddtree_budget, width.speculative_ddtree_auto_widths) == (31, None)
    fixed = parse("--speculative-ddtree-budget 15")
    assert (fixed.speculative_ddtree_budget, fixed.speculative_ddtree_auto_widths) == (15, None)
    # TP > 1 (auto is not built for it): the default is block - 1, as on 0.5.13.post1
    tp2 = parse("--tp-size 2")
    assert (tp2.tp_size, tp2.speculative_ddtree_budget, tp2.speculative_ddtree_auto_widths) == (2, BLOCK - 1, None)
    # a verify backend other than triton (auto has run on triton only), or no CUDA graphs: block - 1
    # too; an explicit auto still runs there, and the triton backend named keeps the default
    for flags, auto in (("--attention-backend flashinfer", False),
                        ("--attention-backend flashinfer --speculative-ddtree-budget auto", True),
                        ("--attention-backend triton", True),
                        ("--prefill-attention-backend flashinfer --decode-attention-backend triton", False),
                        ("--prefill-attention-backend flashinfer --decode-attention-backend triton "
                         "--speculative-attention-mode decode", True),
                        ("--disable-cuda-graph", False),  # auto has not run without graphs
                        ("--disable-cuda-graph --speculative-ddtree-budget auto", True)):
        args = parse(flags)
        assert (args.speculative_ddtree_auto_widths is not None) == auto, flags
        if not auto:
            assert args.speculative_ddtree_budget == BLOCK - 1, flags


def test_budget_auto_at_the_default_graph_batch_keeps_every_width_in_its_range(parse):
    """At 0.5.16's default decode graphs on an 80-160 GB card (batch 256 at TP < 4) auto keeps
    every width: width 256 up to batch 16, 64 up to 64, 8 every batch (before the ranges, the
    memory rule left widths 8 and 16 only). Graph batches above 512 (width 8 x 512 = 4096) are
    refused with the flag to change."""
    from sglang.srt.speculative.ddtree_auto_v2 import width_limits

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs-decode 256")
    assert args.speculative_ddtree_auto_widths == [8, 16, 32, 64, 128, 256]
    limits = width_limits(args)
    graph_bs = sorted(set(args.cuda_graph_config.decode.bs))
    for w in (16, 32, 64, 128, 256):
        assert limits[w] == max(g for g in graph_bs if g * w <= 4096)
    assert limits[256] == 16 and limits[64] == 64 and limits[8] is None
    with pytest.raises(ValueError, match="no verify width"):
        parse("--speculative-ddtree-budget auto --cuda-graph-max-bs-decode 1024")


@pytest.mark.parametrize(
    ("extra", "rows"),
    [
        # auto at the default graph list: width 256 to batch 16, 16 to 256: 4096 rows (upstream's
        # max(graph bs) x 256 would be 65,536, 37 GiB of float32 logits at Qwen3's vocabulary)
        ("--speculative-ddtree-budget auto --cuda-graph-max-bs-decode 256", 4096),
        ("--speculative-ddtree-budget auto --cuda-graph-max-bs-decode 8", 8 * 256),
        # a fixed budget's graph list is trimmed at start-up: the same rows as upstream's rule
        ("--speculative-ddtree-budget 63 --cuda-graph-max-bs-decode 256", None),
        ("--speculative-ddtree-budget 15 --cuda-graph-max-bs-decode 16", None),
    ],
)
def test_shared_logits_buffer_holds_the_largest_verify_graph(parse, extra, rows, monkeypatch):
    """SGLang shares one (rows x vocab) float32 logits buffer between its CUDA graphs and sizes it
    ``max(graph bs) x verify width`` (ModelRunner.max_decode_logits_rows). DDTREE's target runners
    capture per width (ddtree_serving.width_graph_bs), so the seam in patch 0005 sizes it for the
    largest graph any width captures: the real method, on the pin's parsed server args, against
    the graphs each width captures. The draft runner keeps upstream's rule."""
    import types

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
    from sglang.srt.speculative import ddtree_serving as ds
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang.srt.model_executor.runner import base_cuda_graph_runner

    # TP = 1 without a process group: the graph-size filter reads only these two sizes from it
    monkeypatch.setattr(base_cuda_graph_runner, "get_parallel",
                        lambda: types.SimpleNamespace(attn_tp_size=1, attn_cp_size=1))
    args = parse(extra)
    n = int(args.speculative_num_draft_tokens)

    def runner(draft: bool):
        mr = types.SimpleNamespace(server_args=args, is_draft_worker=draft,
                                   spec_algorithm=SpeculativeAlgorithm.from_string("DDTREE"),
                                   req_to_token_pool=types.SimpleNamespace(size=int(args.max_running_requests)))
        mr.decode_num_tokens_per_req = lambda: n
        return mr

    target = runner(False)
    got = ModelRunner.max_decode_logits_rows(target)
    capture_bs, _ = get_batch_sizes_to_capture(target, n)
    widths = [n, *(args.speculative_ddtree_auto_widths or ())]
    graphs = [w * b for w in widths for b in ds.width_graph_bs(capture_bs, w)]
    assert got == max(graphs) <= ds.DDTREE_MAX_CUDA_GRAPH_TOKENS
    if rows is None:  # fixed budget: upstream's rule on the trimmed list
        assert got == max(capture_bs) * n
    else:
        assert got == rows
    assert ModelRunner.max_decode_logits_rows(runner(True)) == max(capture_bs) * n


def test_budget_auto_reserves_kv_for_the_widest_width_of_the_batch(parse):
    """The KV a request keeps past its committed length (DFlashDraftInputV2.decode_reserve_len,
    through the hook's ddtree_decode_reserve_len) and the scheduler's memory check
    (allocation_sizing.get_alloc_reserve_per_decode) follow the widest width the batch may run:
    (D + 1) + max(block, N + D + 1) at that N. Without a batch size (start-up sizing, the
    req_to_token row) it is the widest width's; DFLASH and fixed budgets ignore the batch size."""
    from sglang.srt.arg_groups.ddtree_hook import ddtree_decode_reserve_len
    from sglang.srt.mem_cache import allocation_sizing as al
    from sglang.srt.speculative import ddtree_serving as ds
    from sglang.srt.speculative.ddtree_auto_v2 import width_limits

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs-decode 256")
    block = int(args.speculative_dflash_block_size)
    depth = block - 1
    limits = width_limits(args)
    widest = ddtree_decode_reserve_len(args)
    assert widest == (depth + 1) + max(block, 256 + depth + 1)
    for bs in (1, 16, 17, 64, 65, 200, 256):
        n = ds.auto_widest_width(bs, limits)
        want = (min(n - 1, depth) + 1) + max(block, n + min(n - 1, depth) + 1)
        assert ddtree_decode_reserve_len(args, bs) == want <= widest
        check = al.get_alloc_reserve_per_decode(args, batch_size=bs)
        assert want <= check <= want + 1  # twice the rounded-up half
    assert ddtree_decode_reserve_len(args, 256) < ddtree_decode_reserve_len(args, 1) == widest
    # the static sizes (no batch size) keep the widest width's reservation
    assert al.get_alloc_reserve_per_decode(args) >= widest
    assert al.get_req_to_token_extra_context_len(args) >= widest
    fixed = parse("--speculative-ddtree-budget 63")
    assert ddtree_decode_reserve_len(fixed, 256) == ddtree_decode_reserve_len(fixed)
    assert al.get_alloc_reserve_per_decode(fixed, batch_size=256) == al.get_alloc_reserve_per_decode(fixed)


def test_cycle_switch(monkeypatch, parse):
    from sglang.srt.speculative.ddtree_auto_v2 import CYCLE_ENV, OFF_ENV, auto_rounds, cycle_mode

    for value, want in (("1", True), ("0", False), ("", False), ("on", True)):
        monkeypatch.setenv(CYCLE_ENV, value)
        assert cycle_mode() is want
    monkeypatch.setenv(CYCLE_ENV, "sometimes")
    with pytest.raises(ValueError, match=CYCLE_ENV):
        cycle_mode()
    monkeypatch.setenv(CYCLE_ENV, "1")
    rounds = auto_rounds(parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16"), "cpu")
    assert rounds.cycle  # `off` is on by default, so the cycle starts with it (width 1)
    assert [rounds.choose(3) for _ in range(8)] == [1, 8, 16, 32, 64, 128, 256, 1]
    monkeypatch.setenv(OFF_ENV, "0")
    rounds = auto_rounds(parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16"), "cpu")
    assert [rounds.choose(3) for _ in range(8)] == [8, 16, 32, 64, 128, 256, 8, 16]


# ------------------------------------------------------------------------------------------
# Per-width verify states (the GPU part stood in)


def test_verify_states_are_built_at_each_width_and_switched_around_the_verify(parse):
    """build_verify_states overrides the real server args' verify width while it builds each
    width's attention backend and restores it after; verify_width swaps the runner's backend and
    graph runner in and back. The model runner is a stand-in (its backends and CUDA graphs need a
    GPU): it records the width the server args say at each backend build."""
    from sglang.srt.speculative.ddtree_auto_v2 import build_verify_states, verify_width

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16")
    widest = args.speculative_num_draft_tokens

    class Runner(SimpleNamespace):
        def _get_attention_backend(self, init_new_workspace=False):
            assert init_new_workspace
            self.init_new_workspace = True  # as the real one leaves it
            return ("backend", int(self.server_args.speculative_num_draft_tokens))

    own = ("backend", widest)
    runner = Runner(server_args=args, attn_backend=own, decode_cuda_graph_runner=None,
                    device="cpu", init_new_workspace=False)
    states = build_verify_states(runner, args.speculative_ddtree_auto_widths, capture=False, log=False)
    assert sorted(states) == args.speculative_ddtree_auto_widths
    for w, st in states.items():
        assert st.width == w and st.attn_backend == (own if w == widest else ("backend", w))
        assert st.graph_runner is None  # eager: CUDA graphs off
    assert args.speculative_num_draft_tokens == widest and runner.init_new_workspace is False
    with verify_width(runner, states[8]):
        assert runner.attn_backend == ("backend", 8) and runner.decode_cuda_graph_runner is None
    assert runner.attn_backend is own
    with pytest.raises(RuntimeError), verify_width(runner, states[16]):
        raise RuntimeError("a failed verify")
    assert runner.attn_backend is own  # restored on errors too


def test_width_runners_capture_on_the_widest_widths_stream_and_say_so(parse, monkeypatch):
    """build_verify_states with CUDA graphs: each width's DecodeCudaGraphRunner is built after
    share_graph_buffers wrapped its backend, and the start-up log says whether it captured on the
    widest width's stream (patch 0005's seam). ddtree_e2e's check reads these real log lines: it
    passes when every width shares the stream and fails when one does not. The runner class is a
    stand-in recording its arguments (capturing needs a GPU); the stream is a sentinel object."""
    import logging

    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as dcgr
    from sglang.srt.speculative.ddtree_auto_v2 import build_verify_states

    e2e_path = Path(__file__).resolve().parents[2] / "gpu" / "ddtree_e2e.py"
    e2e_spec = importlib.util.spec_from_file_location("ddtree_e2e_t", e2e_path)
    e2e = importlib.util.module_from_spec(e2e_spec)
    monkeypatch.setitem(sys.modules, "ddtree_e2e_t", e2e)  # its dataclasses resolve their module
    e2e_spec.loader.exec_module(e2e)

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16")
    main_stream, other = object(), object()
    built, own_stream = [], set()  # widths whose runner captures on a stream of its own

    class Runner:
        def __init__(self, model_runner, attn_backend=None, speculative_num_draft_tokens=None):
            built.append(speculative_num_draft_tokens)
            main = getattr(model_runner, "decode_cuda_graph_runner", None)
            # the seam's rule: the widest width's runner's stream, when there is one
            shared = getattr(main, "stream", None)
            self.stream = other if speculative_num_draft_tokens in own_stream else shared

    class ModelRunner(SimpleNamespace):
        def _get_attention_backend(self, init_new_workspace=False):
            return SimpleNamespace(init_cuda_graph_state=lambda *a, **k: None)

    monkeypatch.setattr(dcgr, "DecodeCudaGraphRunner", Runner)
    log = logging.getLogger("sglang.srt.speculative.ddtree_auto_v2")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        for odd in (False, True):
            built.clear()
            own_stream.clear()
            if odd:
                own_stream.add(32)
            lines.clear()
            runner = ModelRunner(server_args=args, attn_backend=SimpleNamespace(), device="cpu",
                                 decode_cuda_graph_runner=SimpleNamespace(stream=main_stream))
            states = build_verify_states(runner, args.speculative_ddtree_auto_widths, capture=True, log=True)
            widest = args.speculative_num_draft_tokens
            assert built == [w for w in sorted(states) if w != widest]
            assert all(states[w].graph_runner.stream is (other if odd and w == 32 else main_stream) for w in built)
            assert len(lines) == len(built)
            assert e2e.capture_streams_shared("\n".join(lines)) is (not odd)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert not e2e.capture_streams_shared("no width lines")


def _triton_backend(max_context_len, device="cpu"):
    """The pin's TritonAttnBackend with only what init_cuda_graph_state reads set (its __init__
    needs a model runner with a KV pool on a GPU); its real init_cuda_graph_state runs."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    b = TritonAttnBackend.__new__(TritonAttnBackend)
    b.num_head, b.max_kv_splits, b.v_head_dim, b.swa_v_head_dim = 4, 2, 8, None
    b.max_context_len, b.device, b.skip_prefill, b.is_draft_runner = max_context_len, device, False, False
    b.sliding_window_size, b.use_sliding_window_kv_pool, b._translate_kv_loc = None, False, None
    return b


def test_narrower_widths_capture_over_the_widest_widths_graph_buffers():
    """share_graph_buffers: a narrower width's triton backend, at its (real) init_cuda_graph_state,
    takes the widest width's KV index list, split counts, tree mask and decode scratch instead of
    allocating its own (1.3 GB + 0.2 GB + 0.5 GB at 4096 graph tokens, a 40,960-token context and
    Qwen3-8B's heads), and keeps its own where its graphs would need more than those hold. Another
    backend type (flashinfer) is left alone."""
    from sglang.srt.speculative.ddtree_auto_v2 import share_graph_buffers

    ctx = 64
    main = _triton_backend(ctx)
    main.init_cuda_graph_state(16, 16 * 256)  # the widest width: 16 x 256 tokens
    names = ("cuda_graph_kv_indices", "cuda_graph_num_kv_splits", "cuda_graph_custom_mask",
             "cuda_graph_attn_logits", "cuda_graph_attn_lse")
    for max_bs, tokens in ((256, 256 * 16), (32, 32 * 64), (256, 256)):
        narrow = _triton_backend(ctx)
        assert share_graph_buffers(narrow, main)
        narrow.init_cuda_graph_state(max_bs, tokens)
        for n in names:
            assert getattr(narrow, n) is getattr(main, n), n
        assert narrow.cuda_graph_kv_indices.numel() >= tokens * ctx
    # graphs needing more than the main buffers hold keep their own (any width: no sharing)
    big = _triton_backend(ctx)
    assert share_graph_buffers(big, main)
    big.init_cuda_graph_state(512, 512 * 16)
    for n in names:
        assert getattr(big, n) is not getattr(main, n), n
    assert big.cuda_graph_kv_indices.numel() == 512 * 16 * ctx
    # a longer context than the main's: its own as well
    longer = _triton_backend(2 * ctx)
    assert share_graph_buffers(longer, main)
    longer.init_cuda_graph_state(16, 16 * 256)
    assert longer.cuda_graph_kv_indices is not main.cuda_graph_kv_indices
    # not a triton backend, or a main without graph buffers: nothing changes
    other = SimpleNamespace(init_cuda_graph_state=lambda *a, **k: None)
    assert not share_graph_buffers(other, main)
    assert not share_graph_buffers(_triton_backend(ctx), _triton_backend(ctx))


def test_verify_graphs_share_one_hidden_state_output():
    """SharedVerifyHidden (the DDTREE worker's capture tail hook on the target's runners): every
    verify graph's hidden states are copied into one buffer of the largest graph's rows and the
    graph's output is a view of it, so no graph keeps an output of its own; the values are the
    forward's. Outputs of other modes, and one that does not fit, are left as they are."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.ddtree_worker_v2 import SharedVerifyHidden

    hook, rows, dim = SharedVerifyHidden(), 64, 20
    runner = SimpleNamespace(model_runner=SimpleNamespace(max_decode_logits_rows=lambda: rows))
    verify = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    g = torch.Generator().manual_seed(0)
    outs, refs = [], []
    for tokens in (64, 16, 1):  # captured largest first, as SGLang does
        hidden = torch.randn(tokens, dim, generator=g, dtype=torch.bfloat16)
        out = LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)
        hook(runner, out, verify, tokens)
        assert torch.equal(out.hidden_states, hidden) and out.hidden_states is not hidden
        assert out.hidden_states.data_ptr() == hook.buffer.data_ptr()
        outs.append(out)
        refs.append(hidden)
    assert hook.buffer.shape == (rows, dim)
    # the last graph's values are in the shared rows (a replay refills them each round)
    assert torch.equal(outs[0].hidden_states[:1], refs[-1])
    for mode, hidden in ((ForwardMode.DECODE, torch.ones(4, dim, dtype=torch.bfloat16)),
                         (ForwardMode.TARGET_VERIFY, torch.ones(rows + 1, dim, dtype=torch.bfloat16)),
                         (ForwardMode.TARGET_VERIFY, torch.ones(4, dim + 1, dtype=torch.bfloat16))):
        out = LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)
        hook(runner, out, SimpleNamespace(forward_mode=mode), hidden.shape[0])
        assert out.hidden_states is hidden
    none = LogitsProcessorOutput(next_token_logits=None, hidden_states=None)
    hook(runner, none, verify, 4)
    assert none.hidden_states is None


# ------------------------------------------------------------------------------------------
# The round at changing widths: exact, and the feed carries the tree's estimate


def _proposer(widths, block, vocab, k):
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer

    # lm_head = identity: the draft block's hidden states are its logits (vocab = hidden)
    return DDTreeProposer(weight=torch.eye(vocab), num_org=vocab, org_vocab_start=0, block_size=block,
                          budget=max(widths) - 1, topk=k, max_depth=block - 1, max_bs=8, widths=widths)


def test_proposer_prices_every_width(parse):
    """With widths the proposer also returns, and writes in the capture hook, each width's
    expected committed tokens of its tree (ddtree_budget.expected_committed of the tree's scores)."""
    widths, block, vocab, k = [2, 4, 8, 16], 5, 12, 4
    prop = _proposer(widths, block, vocab, k)
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(3 * block, vocab, generator=g) * 2
    expected = prop.compute(hs)[5]
    logp, ids = du.draft_topk_logprobs(hs.view(3, block, vocab)[:, 1:], k, backend="torch")
    tree = du.build_tree(logp, ids, max(widths) - 1, topk_cap=k, backend="torch")
    want = db.expected_committed(tree.score, db.width_gather_index(widths, max(widths) - 1))
    assert torch.allclose(expected, want)
    assert bool((expected[:, 1:] >= expected[:, :-1]).all()) and bool((expected >= 1).all())
    prop(hs)
    *_, captured = prop.captured(3)
    assert torch.equal(captured, expected)
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer

    plain = DDTreeProposer(weight=torch.eye(vocab), num_org=vocab, org_vocab_start=0, block_size=block,
                           budget=15, topk=k, max_depth=block - 1, max_bs=8)  # a fixed budget
    assert plain.compute(hs)[5] is None and plain.captured(3)[5] is None


def test_proposer_builds_each_batch_the_tree_of_the_widest_width_in_its_range():
    """With width ranges a batch's tree has the budget of the widest width whose range holds
    it (so large batches do not build trees they cannot verify): its outputs equal a direct build
    at that budget, the capture hook writes them into the buffers' first columns, and the
    truncation to any width in range gives the tree of that width. warm() runs one eager call
    per budget before capture (the tree kernels' first-use tables)."""
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer

    widths, block, vocab, k = [2, 4, 8, 16], 5, 12, 4
    limits = {2: None, 4: 4, 8: 2, 16: 1}
    prop = DDTreeProposer(weight=torch.eye(vocab), num_org=vocab, org_vocab_start=0, block_size=block,
                          budget=15, topk=k, max_depth=block - 1, max_bs=8, widths=widths, limits=limits)
    assert [prop.budget_at(b) for b in (1, 2, 3, 4, 5, 8)] == [15, 7, 3, 3, 1, 1]
    g = torch.Generator().manual_seed(1)
    for bs in (1, 2, 3, 6):
        hs = torch.randn(bs * block, vocab, generator=g) * 2
        budget = prop.budget_at(bs)
        out = prop.compute(hs)
        logp, ids = du.draft_topk_logprobs(hs.view(bs, block, vocab)[:, 1:], k, backend="torch")
        tree = du.build_tree(logp, ids, budget, topk_cap=min(k, budget), backend="torch")
        zeros = torch.zeros(bs, dtype=torch.int64)
        compiled = du.compile_tree(tree, zeros, zeros, build_custom_mask=False, max_depth=block - 1)
        want = (compiled.draft_tokens.view(bs, budget + 1), compiled.depth, compiled.retrieve_next_token,
                compiled.retrieve_next_sibling, compiled.tree_mask)
        for got, ref in zip(out[:5], want):
            assert torch.equal(got, ref)
        assert torch.allclose(out[5], db.expected_committed(tree.score, db.width_gather_index(widths, budget)))
        prop(hs)  # the capture hook: the first budget + 1 columns
        captured = prop.captured(bs)
        for w in widths:
            if limits[w] is not None and bs > limits[w]:
                continue
            cut = db.truncate_tree(*captured[:5], w)
            for got, ref in zip(cut, db.truncate_tree(*out[:5], w)):
                assert torch.equal(got, ref)
    seen = []
    real = prop.compute
    prop.compute = lambda x, budget=None: seen.append((x.shape[0] // block, budget)) or real(x, budget)
    prop.warm(vocab, torch.float32)
    assert sorted(seen) == [(1, 1), (1, 3), (1, 7), (1, 15)]


def _worker_stub(rounds):
    """The worker fields on_verify_complete_cpu / get_ddtree_server_info read (a DDTreeWorkerV2
    needs a GPU model runner to construct)."""
    return SimpleNamespace(_auto=rounds, debug_metrics=None, ps=SimpleNamespace(tp_rank=0))


def _resolve(worker, out, commit, block, bs):
    """The scheduler's real _resolve_spec_v2_tokens on a round's result (the scheduler and the
    requests are stand-ins: a Req needs a tokenizer and a running scheduler); it calls the real
    DDTreeWorkerV2.on_verify_complete_cpu."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor as BatchResultProcessor,
    )
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    class Req(SimpleNamespace):
        def finished(self):
            return False

        def update_spec_correct_drafts_histogram(self, n):
            pass

    reqs = [Req(is_retracted=False, grammar=None, kv_committed_len=0, spec_verify_ct=0,
                spec_num_correct_drafts=0) for _ in range(bs)]
    owner = SimpleNamespace(model_worker=SimpleNamespace(
        on_verify_complete_cpu=lambda per_req, batch_size=0: DDTreeWorkerV2.on_verify_complete_cpu(
            worker, per_req, batch_size)))
    result = SimpleNamespace(next_token_ids=out.reshape(-1), accept_lens=commit, block_accept_lens=None,
                             cap_lens=None, speculative_num_draft_tokens=block)
    return BatchResultProcessor._resolve_spec_v2_tokens(owner, result, SimpleNamespace(reqs=reqs))


@pytest.mark.parametrize("cycle", [True, False])
def test_rounds_at_changing_widths_give_the_targets_greedy_tokens(cycle):
    """6 requests, 24 rounds: the width of each round from the real AutoRounds (cycle: every
    width in turn; controller: warm-up over every width, then its choice from a synthetic cost
    model), the tree built at the widest budget by the real proposer and cut to the width
    (ddtree_budget.truncate_tree, as the worker does), the walk and commit layout of the worker
    (ddtree_utils), the result through the scheduler's _resolve_spec_v2_tokens, which feeds the
    worker's on_verify_complete_cpu one round late (overlap). Target: a bigram table; the
    drafter's logits are the target's along its greedy chain plus noise. The tokens are the
    target's greedy continuation, computed here; the controller saw the tree's own estimate."""
    widths, block, vocab, k, bs = [2, 4, 8, 16], 5, 12, 4, 6
    depth, n_full = block - 1, max(widths)
    g = torch.Generator().manual_seed(7)
    table = torch.randn(vocab, vocab, generator=g) * 3  # target logits of the next token given the last
    prop = _proposer(widths, block, vocab, k)
    rounds = db.AutoRounds(widths, n_full - 1, [1, 2, 4, 8], cycle=cycle, explore_every=5)
    worker = _worker_stub(rounds)
    root = torch.randint(0, vocab, (bs,), generator=g)
    seqs = [[int(r)] for r in root]
    ran, waiting, accepted, all_sums = [], None, 0, []
    for _ in range(24):
        # draft block hidden states = logits: depth d scores the target's chain token d + noise
        hs = torch.zeros(bs, block, vocab)
        tok = root.clone()
        for d in range(1, block):
            hs[:, d] = table[tok] + torch.randn(bs, vocab, generator=g) * 2.5
            tok = table[tok].argmax(-1)
        tokens, tdepth, next_token, next_sibling, tree_mask, expected = prop.compute(hs.view(bs * block, vocab))
        tokens[:, 0].copy_(root)
        w = rounds.choose(bs)
        ran.append(w)
        tokens, tdepth, next_token, next_sibling, tree_mask = db.truncate_tree(
            tokens, tdepth, next_token, next_sibling, tree_mask, w)
        predict = table[tokens].argmax(-1)  # [bs, w] the target's greedy next token at each node
        index = torch.arange(bs * w).view(bs, w)
        acc_idx, acc_len, bonus = du.accept_tree_greedy(tokens, predict, index, next_token, next_sibling, depth)
        out, commit, _ = du.tree_commit_layout(acc_idx, acc_len, bonus, tokens, block)
        accepted += int(acc_len.sum())
        rounds.record(w, expected, 0.0, 1e-3 * (1.0 + 0.05 * bs * w))  # synthetic seconds
        if waiting is not None:  # the previous round's results reach the host now
            for b, toks in enumerate(_resolve(worker, *waiting[:4])):
                seqs[b] += toks
        waiting = (out, commit, block, bs, expected.sum(0))
        all_sums.append(expected.sum(0))
        root = bonus
    assert len(all_sums) == 24
    for b, toks in enumerate(_resolve(worker, *waiting[:4])):
        seqs[b] += toks
    assert accepted > bs  # drafts landed
    for s in seqs:
        want = s[:1]
        while len(want) < len(s):
            want.append(int(table[want[-1]].argmax()))
        assert s == want
    assert len(set(ran)) == len(widths) and any(a != b for a, b in itertools.pairwise(ran))
    if cycle:
        assert ran == [widths[i % len(widths)] for i in range(len(ran))]
    # the controller's estimate is the rounds' tree estimates (through the ring), pooled over
    # SMOOTH_REQUESTS requests: the first round's, then a moving average (bs requests a round)
    want, seen = None, 0
    for sums in all_sums:
        seen = min(db.BudgetController.SMOOTH_REQUESTS, seen + bs)
        now = sums / bs
        want = now if want is None else want + min(1.0, bs / seen) * (now - want)
    for w, x in zip(widths, want.tolist()):
        assert rounds.controller.predicted[w] == pytest.approx(x)
    assert rounds.observed == 24 and rounds.dropped == 0
    snap = rounds.snapshot()
    assert sum(snap["chosen"].values()) == 24 and snap["mode"] == ("cycle" if cycle else "controller")
    costs = rounds.controller.table.costs(bs)
    assert set(costs) == set(widths)  # every width timed in this batch's bucket (first ones dropped)
    for w in widths:
        assert costs[w] == pytest.approx(1e-3 * (1.0 + 0.05 * bs * w))


def test_rounds_of_changing_batches_keep_each_width_in_its_range_and_the_greedy_tokens():
    """Batch ranges per width (ddtree_serving.auto_width_limits over graph sizes 1, 2, 4, 8 at
    32 tokens a graph: width 16 up to batch 2, 8 up to 4, 4 up to 8, 2 every batch). 6 requests,
    40 rounds, each round a random subset of 1..6 of them (the scheduler's batch changes): the
    draft tree built as the draft graph does (the batch padded to a graph size, the capture hook
    at the padded size's budget, read back with captured()), the width from the real AutoRounds
    (controller with exploration), the walk and commit of the worker, the results one round late
    through the scheduler's _resolve_spec_v2_tokens. Every round's width is within its batch's
    range and its padded tree holds it; every request's tokens are the target's greedy ones."""
    import ddtree_serving as ds

    widths, block, vocab, k, graph_bs = [2, 4, 8, 16], 5, 12, 4, [1, 2, 4, 8]
    limits = ds.auto_width_limits(widths, graph_bs, max_graph_tokens=32)
    assert limits == {2: None, 4: 8, 8: 4, 16: 2}
    depth = block - 1
    g = torch.Generator().manual_seed(11)
    table = torch.randn(vocab, vocab, generator=g) * 3
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeProposer

    prop = DDTreeProposer(weight=torch.eye(vocab), num_org=vocab, org_vocab_start=0, block_size=block,
                          budget=15, topk=k, max_depth=depth, max_bs=8, widths=widths, limits=limits)
    rounds = db.AutoRounds(widths, 15, graph_bs, graph_sizes=graph_bs, explore_every=3, limits=limits, off=True)
    worker = _worker_stub(rounds)
    roots = torch.randint(0, vocab, (6,), generator=g)
    seqs = [[int(r)] for r in roots]
    waiting, ran = None, []
    sizes = [1, 1, 1, 2, 2, 3, 5, 6]
    for _ in range(60):
        m = sizes[int(torch.randint(0, len(sizes), (1,), generator=g))]
        active = torch.randperm(6, generator=g)[:m].sort().values
        root = roots[active]
        hs = torch.zeros(m, block, vocab)
        tok = root.clone()
        for d in range(1, block):
            hs[:, d] = table[tok] + torch.randn(m, vocab, generator=g) * 2.5
            tok = table[tok].argmax(-1)
        padded = next(b for b in graph_bs if b >= m)
        prop(torch.cat([hs, torch.zeros(padded - m, block, vocab)]).view(padded * block, vocab))
        tokens, tdepth, next_token, next_sibling, tree_mask, expected = prop.captured(m)
        w = rounds.choose(m)
        ran.append((m, w))
        if w == db.OFF_WIDTH:
            expected = None
        else:
            assert limits[w] is None or m <= limits[w]
            assert w - 1 <= prop.budget_at(padded)
        tokens = tokens.clone()
        tokens[:, 0].copy_(root)
        tokens, tdepth, next_token, next_sibling, tree_mask = db.truncate_tree(
            tokens, tdepth, next_token, next_sibling, tree_mask, w)
        predict = table[tokens].argmax(-1)
        index = torch.arange(m * w).view(m, w)
        acc_idx, acc_len, bonus = du.accept_tree_greedy(
            tokens.contiguous(), predict, index, next_token, next_sibling, depth)
        out, commit, _ = du.tree_commit_layout(acc_idx, acc_len, bonus, tokens, block)
        rounds.record(w, expected, 0.0, 1e-3 * (1.0 + 0.05 * m * w), bs=m)
        if waiting is not None:
            for b, toks in zip(waiting[0].tolist(), _resolve(worker, *waiting[1:])):
                seqs[b] += toks
        waiting = (active, out, commit, block, m)
        roots[active] = bonus
    for b, toks in zip(waiting[0].tolist(), _resolve(worker, *waiting[1:])):
        seqs[b] += toks
    for s in seqs:
        want = s[:1]
        while len(want) < len(s):
            want.append(int(table[want[-1]].argmax()))
        assert s == want
    assert rounds.observed == 60 and rounds.dropped == 0
    assert any(w == 16 for m, w in ran) and any(m > 2 for m, w in ran)  # both ends of the ranges ran


def test_a_result_of_another_batch_size_is_dropped_not_observed():
    rounds = db.AutoRounds([2, 4], 3, [1, 4])
    rounds.record(4, torch.ones(3, 2) * 2, 0.0, 1e-3)
    assert rounds.on_verify_complete_cpu([1, 1], 2) is False  # 2 results for a round of 3
    assert rounds.dropped == 1 and rounds.observed == 0 and not rounds.pending
    assert rounds.on_verify_complete_cpu([1], 1) is False  # nothing pending: ignored


# ------------------------------------------------------------------------------------------
# /get_server_info


def test_server_info_shows_the_controller(parse):
    """The scheduler's real get_internal_state (what /get_server_info returns under
    internal_states) carries the worker's get_ddtree_server_info: budget auto's snapshot (and the
    debug metrics when on), msgspec-serialisable. The scheduler is a stand-in for the fields
    get_internal_state reads (a real one needs a GPU model)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.server_args import set_global_server_args_for_scheduler
    from sglang.srt.speculative import ddtree_serving
    from sglang.srt.speculative.ddtree_auto_v2 import auto_rounds
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16 --speculative-ddtree-debug-metrics")
    set_global_server_args_for_scheduler(args)
    rounds = auto_rounds(args, "cpu")
    worker = _worker_stub(rounds)
    worker.debug_metrics = ddtree_serving.DDTreeDebugMetrics(15, 255)
    w = rounds.choose(2)
    rounds.record(w, torch.full((2, len(rounds.widths)), 3.0), 0.0, 2e-3)
    DDTreeWorkerV2.on_verify_complete_cpu(worker, [2, 0], 2)
    worker.get_ddtree_server_info = lambda: DDTreeWorkerV2.get_ddtree_server_info(worker)
    sched = SimpleNamespace(
        metrics_reporter=SimpleNamespace(last_gen_throughput=0.0, spec_total_num_forward_ct=0),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(weight_load_mem_usage=1.0, graph_mem_usage=0.5)),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace(mem_usage=2.0)),
        max_total_num_tokens=1024, max_running_requests=48, server_args=args,
        spec_algorithm=SpeculativeAlgorithm.DDTREE, draft_worker=worker,
    )
    state = Scheduler.get_internal_state(sched, None).internal_state
    auto = state["ddtree_budget_auto"]
    # the options: the tree widths, then `off` (offered by default)
    assert auto["widths"] == args.speculative_ddtree_auto_widths == [int(x) for x in auto["options"][:-1]]
    assert auto["options"][-1] == "off" and auto["off"] is True
    assert auto["chosen"][str(w)] == 1 and auto["observed_rounds"] == 1 and auto["last"] == str(w)
    assert auto["cost_table"]["buckets"] == rounds.controller.table.buckets
    assert {"ms", "verify_ms", "offset_ms", "cost_ms"} <= set(auto["cost_table"])
    assert auto["startup"] == {"status": "not measured"}  # no init_cuda_graphs in this test
    assert set(auto["calibration"]["ratio"]) == {str(x) for x in rounds.widths} | {"off"}
    assert state["ddtree_debug_metrics"]["rounds"] == 1
    json.dumps(state["ddtree_budget_auto"])
    # a fixed budget without debug metrics adds nothing
    assert DDTreeWorkerV2.get_ddtree_server_info(_worker_stub(None)) == {}


# ------------------------------------------------------------------------------------------
# Start-up cost table: each width's captured verify graphs replayed and timed


class _Clock:
    """A fake clock for the replay test double: each replay advances it by the verify cost of
    its (batch size, width), so the measurement can be checked exactly."""

    def __init__(self):
        self.now = 0.0

    def timer(self, fn, repeats):  # the measurement's timer contract: mean seconds of a call
        start = self.now
        for _ in range(repeats):
            fn()
        return (self.now - start) / repeats


class _ReplayDouble:
    """Test double for a captured torch.cuda.CUDAGraph (capture and replay need a GPU): replay()
    advances the fake clock by the cell's cost and counts itself; ``fail`` makes it raise."""

    def __init__(self, clock, seconds, fail=False):
        self.clock, self.seconds, self.fail, self.replays = clock, seconds, fail, 0

    def replay(self):
        if self.fail:
            raise RuntimeError("CUDA error: replay failed")
        self.replays += 1
        self.clock.now += self.seconds


def _verify_cost(bs, w):
    return 1e-3 * (1.0 + bs * w / 64.0)


def _graph_runner(width, capture_bs, clock, fail_bs=()):
    """A real DecodeCudaGraphRunner (its shape-key methods) with a real FullCudaGraphBackend,
    built without capturing (that needs a GPU): the backend holds replay doubles and stand-in
    outputs under the runner's own keys, where capture_one leaves a torch.cuda.CUDAGraph and the
    forward's output, plus one graph under a LoRA-variant key the measurement must leave out."""
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import (
        DecodeCudaGraphRunner,
    )
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import (
        FullCudaGraphBackend,
    )

    runner = object.__new__(DecodeCudaGraphRunner)
    runner.capture_bs, runner.captured_req_width, runner.ragged_verify_mode = list(capture_bs), width, False
    runner.device_module = torch.cuda
    runner.model_runner = SimpleNamespace(tp_group=None)
    runner.backend = FullCudaGraphBackend(runner)
    graphs = {}
    for bs in capture_bs:
        key = runner._make_graph_key(runner._capture_graph_size(bs=bs, num_tokens=bs * width))
        graphs[bs] = runner.backend._graphs[key] = _ReplayDouble(clock, _verify_cost(bs, width), bs in fail_bs)
        runner.backend._outputs[key] = ("output", bs)
    lora = _ReplayDouble(clock, 1.0)
    lora_key = runner._make_graph_key(max(capture_bs) * 2, None, "lora")
    runner.backend._graphs[lora_key], runner.backend._outputs[lora_key] = lora, ("output", "lora")
    return runner, graphs, lora


def test_startup_replays_time_every_captured_size_of_every_width_and_seed_the_table(caplog):
    """measure_verify_seconds replays each width's captured graphs (the real runner's keys, the
    real backend's replay and replay session) after a warm-up and times them; seed_startup_costs
    seeds budget auto's cost table with them and logs the table. The graphs and the clock are
    test doubles (CUDA graphs and events need a GPU); the eager width (no graphs) has no cells."""
    import logging

    from sglang.srt.speculative.ddtree_auto_v2 import (
        STARTUP_REPEATS,
        STARTUP_WARMUP,
        VerifyWidthState,
        measure_verify_seconds,
        seed_startup_costs,
    )

    clock, widths, sizes = _Clock(), [8, 16, 32], [1, 2, 4, 8]
    states, graphs, loras = {}, {}, []
    for w in widths[:2]:
        runner, graphs[w], lora = _graph_runner(w, sizes, clock)
        states[w] = VerifyWidthState(w, ("backend", w), runner)
        loras.append(lora)
    states[32] = VerifyWidthState(32, ("backend", 32), None)
    got = measure_verify_seconds(states, timer=clock.timer)
    want = {(bs, w): _verify_cost(bs, w) for w in widths[:2] for bs in sizes}
    assert got.keys() == want.keys()
    for cell, s in want.items():
        assert got[cell] == pytest.approx(s, rel=1e-12)
    for w in widths[:2]:
        assert all(g.replays == STARTUP_WARMUP + STARTUP_REPEATS for g in graphs[w].values())
    assert all(lora.replays == 0 for lora in loras)

    auto = db.AutoRounds(widths, 31, [1, 2, 4, 8, 48], graph_sizes=sizes)
    with caplog.at_level(logging.INFO, logger="sglang.srt.speculative.ddtree_auto_v2"):
        status = seed_startup_costs(auto, states, timer=clock.timer)
    assert status["status"] == "measured" and status["cells"] == status["seeded"] == 8
    assert auto.snapshot()["startup"] == status
    table = auto.controller.table
    for i, b in enumerate(table.buckets):
        for j, w in enumerate(widths):
            seeded = table.verify[i][j]
            if (b, w) in want:
                assert seeded == pytest.approx(want[(b, w)], rel=1e-12)
            else:
                assert seeded is None  # the eager width, the running cap above the graphs
    assert table.missing(4) == [32] and table.missing(48) == widths
    assert "start-up verify cost table" in caplog.text and table.format_ms("verify") in caplog.text


def test_startup_measurement_never_fails_the_start(caplog):
    """A replay that raises, CUDA graphs off, or tp > 1: seed_startup_costs logs why, seeds
    nothing (the table fills online, as before) and returns. Replay doubles as above."""
    import logging

    from sglang.srt.speculative.ddtree_auto_v2 import (
        VerifyWidthState,
        seed_startup_costs,
    )

    clock = _Clock()
    ok, ok_graphs, _ = _graph_runner(8, [1, 2], clock)
    bad, _, _ = _graph_runner(16, [1, 2], clock, fail_bs=(2,))
    states = {8: VerifyWidthState(8, None, ok), 16: VerifyWidthState(16, None, bad)}
    auto = db.AutoRounds([8, 16], 15, [1, 2])
    with caplog.at_level(logging.WARNING, logger="sglang.srt.speculative.ddtree_auto_v2"):
        status = seed_startup_costs(auto, states, timer=clock.timer)
    assert status["status"] == "failed" and "replay failed" in status["reason"]
    assert "fills online" in caplog.text
    table = auto.controller.table
    assert all(s is None for row in table.verify for s in row) and table.missing(1) == [8, 16]

    eager = {w: VerifyWidthState(w, None, None) for w in (8, 16)}
    assert seed_startup_costs(auto, eager, timer=clock.timer)["reason"].startswith("CUDA graphs are off")
    before = sum(g.replays for g in ok_graphs.values())
    status = seed_startup_costs(auto, {8: states[8]}, tp_size=2, timer=clock.timer)
    assert status == {"status": "skipped", "reason": "tp_size > 1"} == auto.snapshot()["startup"]
    assert sum(g.replays for g in ok_graphs.values()) == before  # nothing replayed
    assert all(s is None for row in table.verify for s in row)


def test_the_worker_builds_its_widths_then_the_startup_table(parse):
    """DDTreeWorkerV2.init_cuda_graphs (real, on a worker built without its GPU __init__): after
    the draft's graphs it builds every width's verify state and then the start-up cost table;
    with CUDA graphs off that is skipped, said in the snapshot, and the table fills online. The
    draft worker and the target model runner are stand-ins (they need a GPU model)."""
    from sglang.srt.speculative.ddtree_auto_v2 import auto_rounds
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    args = parse("--speculative-ddtree-budget auto --disable-cuda-graph --max-running-requests 8")
    widest = args.speculative_num_draft_tokens

    class Runner(SimpleNamespace):
        def _get_attention_backend(self, init_new_workspace=False):
            return ("backend", int(self.server_args.speculative_num_draft_tokens))

    calls = []
    worker = object.__new__(DDTreeWorkerV2)
    worker.server_args = args
    worker._draft_worker = SimpleNamespace(init_cuda_graphs=lambda **kw: calls.append(kw))
    worker._target_worker = SimpleNamespace(model_runner=Runner(
        server_args=args, attn_backend=("backend", widest), decode_cuda_graph_runner=None, device="cpu"))
    worker.ps = SimpleNamespace(tp_rank=0, tp_size=1)
    worker._auto = auto_rounds(args, "cpu")
    worker.debug_metrics = None
    worker.init_cuda_graphs()
    assert calls == [{"capture_decode_cuda_graph": False}]
    assert sorted(worker._verify_states) == [db.OFF_WIDTH, *args.speculative_ddtree_auto_widths]  # off by default
    startup = worker.get_ddtree_server_info()["ddtree_budget_auto"]["startup"]
    assert startup == {"status": "skipped", "reason": "CUDA graphs are off (eager verify)"}




# ------------------------------------------------------------------------------------------
# `off` rounds (on unless SGLANG_DDTREE_AUTO_OFF=0) through the worker's own round


def test_off_mode_switch_and_the_root_only_tree(monkeypatch, parse):
    """`off` (width 1) is offered unless SGLANG_DDTREE_AUTO_OFF=0: the feed's verify widths and
    cycle start with it. An off round's tree (ddtree_auto_v2.root_tree) is the root alone, equal to
    truncate_tree(tree, 1) of the real proposer's tree with that root."""
    from sglang.srt.speculative.ddtree_auto_v2 import (
        OFF_ENV,
        auto_rounds,
        off_mode,
        root_tree,
    )

    monkeypatch.setenv(OFF_ENV, "maybe")
    with pytest.raises(ValueError, match=OFF_ENV):
        off_mode()
    monkeypatch.setenv(OFF_ENV, "1")
    args = parse("--speculative-ddtree-budget auto --cuda-graph-max-bs 16")
    rounds = auto_rounds(args, "cpu")
    assert rounds.off and rounds.verify_widths == [db.OFF_WIDTH, *args.speculative_ddtree_auto_widths]
    assert rounds.widths == args.speculative_ddtree_auto_widths  # the proposer prices trees only
    # width 1 gets its verify state like any width (stand-in runner, as in the test above: its
    # backends need a GPU), built under the width override, which is restored after
    from sglang.srt.speculative.ddtree_auto_v2 import build_verify_states

    class Runner(SimpleNamespace):
        def _get_attention_backend(self, init_new_workspace=False):
            return ("backend", int(self.server_args.speculative_num_draft_tokens))

    widest = args.speculative_num_draft_tokens
    runner = Runner(server_args=args, attn_backend=("backend", widest), decode_cuda_graph_runner=None, device="cpu")
    states = build_verify_states(runner, rounds.verify_widths, capture=False, log=False)
    assert states[db.OFF_WIDTH].attn_backend == ("backend", 1) and states[db.OFF_WIDTH].graph_runner is None
    assert sorted(states) == rounds.verify_widths and args.speculative_num_draft_tokens == widest
    monkeypatch.setenv(OFF_ENV, "0")
    assert not auto_rounds(args, "cpu").off
    assert db.OFF_WIDTH not in auto_rounds(args, "cpu").verify_widths
    monkeypatch.delenv(OFF_ENV)  # the default: `off` is offered (the measured auto+off)
    assert off_mode() and auto_rounds(args, "cpu").off

    widths, block, vocab, k = [2, 4, 8], 5, 12, 4
    prop = _proposer(widths, block, vocab, k)
    hs = torch.randn(3 * block, vocab, generator=torch.Generator().manual_seed(3))
    tokens, *rest = prop.compute(hs)[:5]
    bonus = torch.tensor([5, 0, 11])
    tokens[:, 0] = bonus
    want = db.truncate_tree(tokens, *rest, 1)
    got = root_tree(bonus)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


class _WorkerRound:
    """A real DDTreeWorkerV2 (its class, its round: DDTreeWorkerV2._forward_decode ->
    _forward_tree_round, the real DFlashWorkerV2._run_draft_block (eager block preparation) and
    _commit_verified, the real AutoRounds, ddtree_auto_v2.verify_width, the KV move on a real
    MHATokenToKVPool) with test doubles only where a model forward runs (a GPU, or model weights,
    would be needed):

    * the draft model runner's forward: the drafter's block hidden states = the target's logits
      along its greedy chain from the block's root, plus noise (lm_head = identity);
    * the target verify (`_target_verify`): bigram logits of each verify token, its KV written at
      the verify slots as ``1000 * token + position``, its hidden state ``[token, position]``
      (a causal target's hidden state depends on the token and what precedes its position only);
    * the draft KV write of the committed tokens (`_append_target_hidden_to_draft_kv_by_loc`,
      the draft model's KV projection): records the hidden state and position per draft slot,
      in the layout the real one takes (``cache_loc_2d`` ``[bs, rows]``, the other arguments
      flat in the same order, checked as the real one checks them), and the rows it projected.
    """

    def __init__(self, rounds, widths, block, vocab, k, bs, table, seed):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.speculative.ddtree_auto_v2 import VerifyWidthState
        from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2
        from sglang.srt.speculative.draft_worker_common import (
            make_draft_block_spec_info,
        )

        self.table, self.block, self.vocab, self.bs = table, block, vocab, bs
        self.g = torch.Generator().manual_seed(seed)
        self.row = 160
        # request b's position i lives in slot 1 + b + bs * i (interleaved requests)
        req_to_token = (1 + torch.arange(bs).view(bs, 1) + bs * torch.arange(self.row).view(1, -1)).to(torch.int32)
        self.pool = MHATokenToKVPool(bs * self.row + 1, 1, torch.float32, 1, 2, 2, "cpu", False,
                                     enable_kv_cache_copy=True)
        widest = max(rounds.verify_widths)
        runner = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=self.pool,
            attn_backend=("backend", widest), decode_cuda_graph_runner=None, device="cpu",
            model=SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(vocab + 1, 4),
                                  lm_head=SimpleNamespace(weight=torch.eye(vocab))),
        )
        w = object.__new__(DDTreeWorkerV2)
        w.__dict__.update(
            _target_worker=SimpleNamespace(model_runner=runner), model_runner=runner, device="cpu",
            block_size=block, num_verify_tokens=widest, budget=widest - 1, max_depth=block - 1, topk=k,
            verify_topk=2, _phase_timer=None, _sync_debug=False, _auto=rounds, debug_metrics=None,
            ps=SimpleNamespace(tp_rank=0), _proposer=_proposer(widths, block, vocab, k), _draft_sampler=None,
            _verify_states={x: VerifyWidthState(x, ("backend", x), None) for x in rounds.verify_widths},
            _mask_buf=None, _retrieve_index=None, _kv_rows=None, _need_mamba_verify_commit=False,
            use_compact_draft_cache=False, _use_triton_prepare_block=True, _mask_token_id=vocab,
            _block_pos_offsets=torch.arange(block), _draft_block_ids_buf=None,
            _draft_block_spec_info=make_draft_block_spec_info(draft_token_num=block, device="cpu"),
            draft_model_runner=SimpleNamespace(forward=self._draft_forward),
            _target_verify=self._target_verify,
            _append_target_hidden_to_draft_kv_by_loc=self._draft_kv_write,
        )
        self.worker, self.runner = w, runner
        self.draft_forwards, self.verify_widths, self.draft_kv, self.draft_kv_rows = 0, [], {}, []

    def _draft_forward(self, forward_batch):
        self.draft_forwards += 1
        bs, block = self.bs, self.block
        tok = forward_batch.input_ids.view(bs, block)[:, 0].clone()
        hs = torch.zeros(bs, block, self.vocab)
        for d in range(1, block):
            hs[:, d] = self.table[tok] + torch.randn(bs, self.vocab, generator=self.g) * 2.5
            tok = self.table[tok].argmax(-1)
        out = SimpleNamespace(hidden_states=hs.view(bs * block, self.vocab))
        return SimpleNamespace(logits_output=out, can_run_graph=False)

    def _target_verify(self, batch, verify_input, host_seq_lens, host_seq_lens_sum, sampling_info):
        n = int(verify_input.draft_token_num)
        # the round's width state is the runner's inside the verify (ddtree_auto_v2.verify_width)
        assert self.runner.attn_backend == ("backend", n)
        self.verify_widths.append(n)
        assert verify_input.custom_mask is not None and verify_input.draft_token.numel() == self.bs * n
        toks, pos = verify_input.draft_token.to(torch.int64), verify_input.positions.to(torch.int64)
        kv = (1000 * toks + pos).float()
        for buf in self.pool.k_buffer + self.pool.v_buffer:
            buf[batch.out_cache_loc] = kv.view(-1, 1, 1).expand(-1, *buf.shape[1:])
        out = SimpleNamespace(next_token_logits=self.table[toks].clone(),
                              hidden_states=torch.stack([toks, pos], 1).float())
        return SimpleNamespace(logits_output=out, can_run_cuda_graph=False)

    def _draft_kv_write(self, *, target_hidden, cache_loc, positions, cache_loc_2d, commit_lens):
        bs, rows = cache_loc_2d.shape
        assert target_hidden.shape[0] == cache_loc.numel() == positions.numel() == bs * rows
        assert torch.equal(cache_loc, cache_loc_2d.reshape(-1)) and int(commit_lens.max()) <= rows
        self.draft_kv_rows.append(rows)
        hidden, pos = target_hidden.view(bs, rows, -1), positions.view(bs, rows)
        for b in range(bs):
            for j in range(int(commit_lens[b])):
                self.draft_kv[int(cache_loc_2d[b, j])] = (hidden[b, j].tolist(), int(pos[b, j]))

    def run(self, n_rounds, prompt_len):
        from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

        bs, table = self.bs, self.table
        seqs = [torch.randint(0, self.vocab, (prompt_len,), generator=self.g).tolist() for _ in range(bs)]
        root = torch.tensor([int(table[s[-1]].argmax()) for s in seqs])  # the prefill's token
        for b in range(bs):
            seqs[b].append(int(root[b]))
        seq_lens = torch.full((bs,), prompt_len, dtype=torch.int64)
        batch = SimpleNamespace(seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), seq_lens_sum=int(seq_lens.sum()),
                                req_pool_indices=torch.arange(bs), sampling_info=None, out_cache_loc=None)
        draft_input = make_draft_input_v2(bonus_tokens=root, new_seq_lens=seq_lens)
        ran, waiting = [], None
        for _ in range(n_rounds):
            n_before = len(self.verify_widths)
            result = self.worker._forward_decode(batch, draft_input, None)
            ran.append(self.verify_widths[n_before])
            if waiting is not None:  # overlap: the previous round's results reach the host now
                for b, toks in enumerate(_resolve(self.worker, *waiting)):
                    seqs[b] += toks
            waiting = (result.next_token_ids.view(bs, self.block), result.accept_lens, self.block, bs)
            draft_input = result.next_draft_input
            batch.seq_lens = result.new_seq_lens.to(torch.int64)
            batch.seq_lens_cpu = batch.seq_lens.clone()
            batch.seq_lens_sum = int(batch.seq_lens.sum())
        for b, toks in enumerate(_resolve(self.worker, *waiting)):
            seqs[b] += toks
        return seqs, ran, batch.seq_lens

    def slot(self, b, i):
        return int(self.runner.req_to_token_pool.req_to_token[b, i])


@pytest.mark.parametrize("mode", ["cycle", "controller"])
def test_worker_rounds_with_off_give_the_targets_greedy_tokens_and_keep_the_draft_context(mode, monkeypatch):
    """The worker's own round with `off` offered, 6 requests: in cycle mode every 4th round is
    off; with the controller, a cost model (seconds per round, fed as each round's marks) in
    which an off round is cheap enough that the controller picks it between its warm-up and
    exploration rounds. Off rounds run no draft forward and verify width 1 (only the root). The
    committed tokens (through the scheduler's _resolve_spec_v2_tokens) are the target's greedy
    continuation; every committed position's target KV holds its token's KV and its draft KV
    slot holds the target hidden state of its token at its position, as after a run of tree
    rounds only (compared, slot for slot)."""
    # Tensor.record_stream (the round's first step, for the overlap scheduler's streams) is a
    # CUDA stream op; the CPU has one stream, so it is a no-op here.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    widths, block, vocab, k, bs = [2, 4, 8], 5, 12, 4, 6
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(11)) * 3
    prompt = 3
    results = {}
    for off in (True, False):
        rounds = db.AutoRounds(widths, max(widths) - 1, [1, 2, 4, 8], off=off, cycle=(mode == "cycle"),
                               explore_every=5)
        if mode == "controller":
            # synthetic timing: round seconds = host marks the worker cannot give on the CPU
            # (no CUDA events); an off round 1 ms, a tree round 10 ms + 1 ms per verify row
            record = rounds.record

            def timed(width, expected, start=None, end=None, bs=None, sampled=False, _record=record):
                secs = 1e-3 if width == db.OFF_WIDTH else 1e-2 + 1e-3 * width
                return _record(width, expected, 0.0, secs, bs=bs, sampled=sampled)

            rounds.record = timed
        wr = _WorkerRound(rounds, widths, block, vocab, k, bs, table, seed=5)
        modes = []  # the batch's mode the worker gives auto (a greedy batch: sampling_info None)
        choose = rounds.choose
        rounds.choose = lambda b, sampled=False, _choose=choose: modes.append(sampled) or _choose(b, sampled=sampled)
        seqs, ran, final = wr.run(24, prompt)
        assert modes == [False] * 24  # ... and the greedy calibration is the one its rounds fed
        ctl = rounds.controller
        assert sum(ctl.sampled_calibration.rounds.values()) == 0 < sum(ctl.calibration.rounds.values())
        for s in seqs:  # the target's greedy tokens
            want = s[:prompt]
            while len(want) < len(s):
                want.append(int(table[want[-1]].argmax()))
            assert s == want
        n_off = ran.count(db.OFF_WIDTH)
        assert wr.draft_forwards == len(ran) - n_off  # off rounds run no draft forward
        # an off round projects one row a request into the draft KV (its one committed token), a
        # tree round the whole block
        assert wr.draft_kv_rows == [1 if r == db.OFF_WIDTH else block for r in ran]
        assert rounds.observed == 24 and rounds.dropped == 0
        if off:
            assert n_off > 0 and set(ran) - {db.OFF_WIDTH}  # off and tree rounds both ran
            assert rounds.snapshot()["chosen"]["off"] == n_off
            if mode == "cycle":
                assert ran == [rounds.verify_widths[i % 4] for i in range(24)]
        else:
            assert n_off == 0
        for b in range(bs):  # committed positions: target KV and draft context
            for i in range(prompt, int(final[b])):
                slot = wr.slot(b, i)
                assert float(wr.pool.k_buffer[0][slot, 0, 0]) == 1000 * seqs[b][i] + i
                assert wr.draft_kv[slot] == ([float(seqs[b][i]), float(i)], i)
        results[off] = (seqs, final, {s: v for s, v in wr.draft_kv.items()})
    (s_off, f_off, kv_off), (s_tree, f_tree, kv_tree) = results[True], results[False]
    for b in range(bs):  # the same draft context as the tree-only run, where both committed
        common = min(int(f_off[b]), int(f_tree[b]))
        assert s_off[b][:common] == s_tree[b][:common]
        for i in range(prompt, common):
            slot = _WorkerRound.slot(SimpleNamespace(runner=wr.runner), b, i)
            assert kv_off[slot] == kv_tree[slot]
