"""DDTREE serving rules on CPU with the real sglang package (patched).

Request refusals with real Req / SamplingParams objects, the accept-rate denominator through
the real TokenizerManager method, the drafter-independent pieces of the worker (tree-build
graph padding, sliding-window backstop, fallback warning) on stand-in `self` objects (a
DDTreeWorker needs loaded models on a GPU).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import ddtree_sglang_fixtures as fixtures  # noqa: F401  (conftest loads it)

VOCAB = 64


@pytest.fixture(scope="module")
def parse(sglang_overlay, tiny_models):
    from sglang.srt.server_args import prepare_server_args

    def _parse(algorithm="DDTREE", *extra):
        return prepare_server_args(["--model-path", str(tiny_models.target), "--device", "cuda",
                                    "--attention-backend", "triton", "--speculative-algorithm",
                                    algorithm, "--speculative-draft-model-path",
                                    str(tiny_models.draft), *extra])

    return _parse


@pytest.fixture
def as_global(monkeypatch):
    from sglang.srt import server_args as server_args_mod

    def _set(args):
        monkeypatch.setattr(server_args_mod, "_global_server_args", args)

    return _set


def _req(params: dict, custom_logit_processor=None, rid="r"):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=16, **params)
    sp.normalize(None)
    sp.verify(VOCAB)  # sglang's own validation accepts these values
    return Req(rid, "", [3, 4, 5], sp, vocab_size=VOCAB, custom_logit_processor=custom_logit_processor)


REFUSED = [
    (dict(repetition_penalty=1.2), None, "repetition_penalty=1.2"),
    (dict(frequency_penalty=0.5), None, "frequency_penalty=0.5"),
    (dict(presence_penalty=0.3), None, "presence_penalty=0.3"),
    (dict(min_new_tokens=5), None, "min_new_tokens=5"),
    (dict(sampling_seed=1234), None, "sampling_seed=1234"),
    (dict(temperature=0.7), '{"callable": "stub"}', "custom_logit_processor"),
    # Greedy requests are refused too: their penalised argmax would also be per request.
    (dict(temperature=0.0, repetition_penalty=1.05), None, "repetition_penalty=1.05"),
]


@pytest.mark.parametrize(("params", "processor", "name"), REFUSED)
def test_ddtree_refuses_inexact_sampling_params_by_name(parse, as_global, params, processor, name):
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    as_global(parse("DDTREE"))
    req = _req(params, processor)
    msg = validate_dflash_request(req)
    assert msg == (
        f"DDTREE speculative decoding does not support {name}: it would apply one value per "
        "request to every draft-tree node (temperature, top_k, top_p, min_p and logit_bias "
        "are supported)."
    )
    # The scheduler aborts only the request whose check returns a message (as for logprob
    # requests, Scheduler.handle_generate_request); another request is admitted.
    assert validate_dflash_request(_req(dict(temperature=0.7, top_p=0.9), rid="other")) is None


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=0.7),
        dict(temperature=0.7, top_k=20),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.3, top_k=5, top_p=0.8, min_p=0.1),
        dict(temperature=0.7, logit_bias={"7": 2.5, "11": -100.0}),
        dict(temperature=0.7, repetition_penalty=1.0, frequency_penalty=0.0,
             presence_penalty=0.0, min_new_tokens=0),
    ],
)
def test_ddtree_serves_the_exact_sampling_params(parse, as_global, params):
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    as_global(parse("DDTREE"))
    assert validate_dflash_request(_req(params)) is None


def test_logprob_and_grammar_refusals_name_ddtree(parse, as_global):
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    as_global(parse("DDTREE"))
    req = _req(dict(temperature=0.7, repetition_penalty=1.2))
    req.return_logprob = True
    assert validate_dflash_request(req) == "DDTREE speculative decoding does not support return_logprob yet."


@pytest.mark.parametrize(("params", "processor", "name"), REFUSED)
def test_dflash_requests_are_unchanged(parse, as_global, params, processor, name):
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    as_global(parse("DFLASH"))
    assert validate_dflash_request(_req(params, processor)) is None


# --- accept rate ---------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 15, 63, 255])
def test_accept_rate_divides_by_the_reachable_depth(parse, budget):
    from sglang.srt.arg_groups.ddtree_hook import speculative_drafts_per_round
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    args = parse("DDTREE", "--speculative-ddtree-budget", str(budget))
    depth = min(budget, args.speculative_dflash_block_size - 1)
    assert speculative_drafts_per_round(args) == depth
    # 10 rounds, 23 accepted drafts, 33 tokens: the real per-request metric.
    recv = SimpleNamespace(spec_verify_ct=[10], spec_num_correct_drafts=[23], completion_tokens=[33],
                           spec_correct_drafts_histogram=None)
    meta: dict = {}
    TokenizerManager._calculate_spec_decoding_metrics(SimpleNamespace(server_args=args), meta, recv, 0)
    assert meta["spec_accept_rate"] == pytest.approx(23 / (10 * depth))
    assert meta["spec_accept_length"] == pytest.approx(3.3)


def test_accept_rate_of_other_algorithms_is_unchanged(parse):
    from sglang.srt.arg_groups.ddtree_hook import speculative_drafts_per_round
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    args = parse("DFLASH")
    assert speculative_drafts_per_round(args) == args.speculative_num_draft_tokens - 1
    recv = SimpleNamespace(spec_verify_ct=[4], spec_num_correct_drafts=[6], completion_tokens=[10],
                           spec_correct_drafts_histogram=None)
    meta: dict = {}
    TokenizerManager._calculate_spec_decoding_metrics(SimpleNamespace(server_args=args), meta, recv, 0)
    assert meta["spec_accept_rate"] == pytest.approx(6 / (4 * (args.speculative_num_draft_tokens - 1)))


# --- worker pieces -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker_mod(sglang_overlay):
    from sglang.srt.speculative import ddtree_worker

    return ddtree_worker


class _ReplayOnCpu:
    """Stands in for a captured torch.cuda.CUDAGraph (no capture without CUDA): replay() runs
    the builder's own eager step on the captured static buffers and writes its results into
    the static outputs, which is what replaying the captured kernels does."""

    def __init__(self, builder, static_in, static_out):
        self.builder, self.static_in, self.static_out = builder, static_in, static_out

    def replay(self):
        node_valid, compiled = self.builder._eager(*self.static_in)
        self.static_out[0].copy_(node_valid)
        for dst, src in zip(self.static_out[1], compiled):
            dst.copy_(src)


def test_tree_builder_replays_the_next_captured_size_and_never_captures_lazily(worker_mod, sglang_overlay):
    from sglang.srt.speculative import ddtree_utils

    budget, topk, depth = 31, 8, 15
    builder = worker_mod._TreeBuilder(budget, topk, depth, use_cuda_graph=True)
    for graph_bs in (4, 8):  # what capture() holds per size: static inputs, outputs, graph
        gen = torch.Generator().manual_seed(graph_bs)
        static_in = (*ddtree_utils.draft_topk_logprobs(torch.randn(graph_bs, depth, VOCAB, generator=gen), topk),
                     torch.zeros(graph_bs, dtype=torch.int64), torch.zeros(graph_bs, dtype=torch.int64))
        static_out = builder._eager(*static_in)
        builder._graphs[graph_bs] = (_ReplayOnCpu(builder, static_in, static_out), static_in, static_out)
    builder.captured_bs = sorted(builder._graphs)

    for bs in (1, 3, 4, 6, 8, 11):
        gen = torch.Generator().manual_seed(100 + bs)
        logp, ids = ddtree_utils.draft_topk_logprobs(torch.randn(bs, depth, VOCAB, generator=gen), topk)
        bonus = torch.randint(3, VOCAB, (bs,), generator=gen)
        seq_lens = torch.randint(1, 50, (bs,), generator=gen)
        node_valid, got = builder(logp, ids, bonus, seq_lens)
        want_valid, want = builder._eager(logp, ids, bonus, seq_lens)
        assert torch.equal(node_valid, want_valid)
        for name in want._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), (bs, name)
        assert sorted(builder._graphs) == [4, 8]  # bs 11 ran eagerly, nothing was captured


def test_tree_builder_without_graphs_is_eager(worker_mod):
    builder = worker_mod._TreeBuilder(7, 4, 7, use_cuda_graph=False)
    builder.capture([1, 2, 4], "cpu")  # a no-op when graphs are off
    assert builder.captured_bs == [] and builder._graphs == {}


@pytest.mark.parametrize(("backend", "refused"), [("triton", True), ("flashinfer", True), ("fa3", False)])
def test_worker_refuses_a_loaded_sliding_window_target(parse, worker_mod, backend, refused):
    args = parse("DDTREE")
    args.attention_backend = backend
    runner = SimpleNamespace(sliding_window_size=127)
    if refused:
        with pytest.raises(ValueError, match=rf"window 127\), and the {backend} backend"):
            worker_mod._refuse_sliding_window_target(args, runner)
    else:
        worker_mod._refuse_sliding_window_target(args, runner)
    worker_mod._refuse_sliding_window_target(args, SimpleNamespace(sliding_window_size=None))


def test_sampling_fallback_warning_names_the_python_walk(worker_mod, monkeypatch, caplog):
    from sglang.srt.speculative import ddtree_info

    monkeypatch.setattr(ddtree_info, "verify_tree_greedy", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    worker = SimpleNamespace(_warned_sampling_fallback=False, tp_rank=0)
    with caplog.at_level(logging.WARNING, logger=worker_mod.logger.name):
        worker_mod.DDTreeWorker._maybe_warn_sampling_fallback(worker)
        worker_mod.DDTreeWorker._maybe_warn_sampling_fallback(worker)  # once only
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "verify_greedy_reference" in messages[0] and "greedy argmax" not in messages[0]


def _load_request_matrix():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "request_matrix.py"
    spec = importlib.util.spec_from_file_location("ddtree_request_matrix", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pin_016_request_messages(tmp_path, matrix) -> dict:
    """The matrix through the 0.5.16 pin's request check, in a child Python with the 0.5.16
    build laid over the real 0.5.16 site (as tests/sglang_v2/test_v2_pin.py runs it)."""
    import json
    import os
    import subprocess
    import sys

    from ddtree_deploy.checks.sglang_smoke import make_overlay
    from ddtree_deploy.deploy.build import build as b
    from ddtree_deploy.deploy.build import pins

    site = pins.sglang_site("0.5.16")
    if site is None:
        pytest.skip(f"no sglang 0.5.16 test site in {pins.sites_root()} (scripts/install_sglang_env.sh)")
    (pin,) = pins.select("0.5.16")
    build = tmp_path / "build-0.5.16"
    b.assemble(b.prepare(pin.inputs()), build)
    overlay = make_overlay(build, tmp_path / "overlay-0.5.16", site / "sglang")
    root = matrix.DOCS.parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), str(site), str(root)]),
               TRITON_INTERPRET="1", SGLANG_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([sys.executable, matrix.__file__], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_both_pins_and_the_docs_agree_on_every_request_parameter(parse, as_global, tmp_path):
    """One request matrix (tests/request_matrix.py: a non-default value of every parameter in
    docs/DDTREE.md's per-request table, on real Req / SamplingParams objects) through the
    request check of each pin: 0.5.13.post1's validate_dflash_request here, 0.5.16's scheduler
    check (validate_dflash_request, then validate_ddtree_request) in a child Python. Each pin
    refuses exactly the parameters the docs call refused, and a DDTREE refusal names the
    parameter. Slow-ish (about 20 s on 2 cores): the child imports sglang 0.5.16."""
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    matrix = _load_request_matrix()
    want = matrix.expected(matrix.documented_rules())
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    as_global(parse("DDTREE"))
    got = {
        "0.5.13.post1": {c: validate_dflash_request(r) for c, r in matrix.make_requests(Req, SamplingParams).items()},
        "0.5.16": _pin_016_request_messages(tmp_path, matrix),
    }
    params = {case: param for case, param, _, _ in matrix.MATRIX}
    for pin, messages in got.items():
        refused = {case: msg is not None for case, msg in messages.items()}
        assert refused == want, (pin, {c: m for c, m in messages.items() if refused[c] != want[c]})
        for case, msg in messages.items():
            if msg is not None and params[case] not in ("logprobs", "grammar"):
                name = params[case].replace(" ", "_")  # custom logit processor -> custom_logit_processor
                assert msg.startswith(f"DDTREE speculative decoding does not support {name}"), (pin, msg)


@pytest.mark.parametrize("extra", [(), ("--speculative-ddtree-budget", "63", "--speculative-ddtree-topk-cap", "4"),
                                   ("--speculative-ddtree-budget", "3", "--speculative-ddtree-debug-metrics")])
def test_worker_shape_from_resolved_server_args(parse, extra):
    """Both pins' workers take their sizes from ddtree_serving.worker_shape of the resolved
    (real) server args; a page size other than 1 and unresolved args are refused."""
    from sglang.srt.speculative import ddtree_serving

    args = parse("DDTREE", *extra)
    block, budget = args.speculative_dflash_block_size, args.speculative_ddtree_budget
    shape = ddtree_serving.worker_shape(args, block, 1, VOCAB)
    assert shape.num_verify_tokens == budget + 1 == args.speculative_num_draft_tokens
    assert shape.max_depth == min(budget, block - 1)
    assert shape.topk == min(args.speculative_ddtree_topk_cap, budget, VOCAB)
    assert shape.verify_topk == args.speculative_eagle_topk > 1
    assert (shape.debug_metrics is not None) == args.speculative_ddtree_debug_metrics
    with pytest.raises(ValueError, match="page_size == 1"):
        ddtree_serving.worker_shape(args, block, 16, VOCAB)
    args.speculative_num_draft_tokens = budget + 2
    with pytest.raises(ValueError, match="budget \\+ 1"):
        ddtree_serving.worker_shape(args, block, 1, VOCAB)
