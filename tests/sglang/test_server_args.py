"""DDTREE selection and server-argument validation against the real sglang package (patched).

`--device cuda` parses on a CPU-only machine (no GPU is touched while parsing), which lets these
tests exercise the CUDA attention-backend rules. Expected values are derived from the draft
config written by the test and from the documented rules, never pasted from a run.
"""

from __future__ import annotations

import argparse
import copy
from types import SimpleNamespace

import pytest

import ddtree_serving
import ddtree_sglang_fixtures as fixtures

DRAFT_BLOCK = fixtures.draft_config()["block_size"]
DDTREE_FIELDS = (
    "speculative_algorithm",
    "speculative_ddtree_budget",
    "speculative_ddtree_topk_cap",
    "speculative_dflash_block_size",
    "speculative_num_draft_tokens",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "attention_backend",
    "page_size",
    "disable_overlap_schedule",
)


@pytest.fixture(scope="module")
def parse(sglang_overlay, tiny_models):
    """parse(*extra, algorithm="DDTREE", draft=True) -> ServerArgs via prepare_server_args."""
    from sglang.srt.server_args import prepare_server_args

    def _parse(*extra: str, algorithm: str | None = "DDTREE", draft: bool = True, device: str = "cuda"):
        argv = ["--model-path", str(tiny_models.target), "--device", device]
        if algorithm:
            argv += ["--speculative-algorithm", algorithm]
        if draft:
            argv += ["--speculative-draft-model-path", str(tiny_models.draft)]
        return prepare_server_args([*argv, *extra])

    return _parse


@pytest.fixture(scope="module")
def hook(sglang_overlay):
    """The DDTREE server-args hook of the 0.5.13.post1 series (a new file, patch 0002)."""
    from sglang.srt.arg_groups import ddtree_hook

    return ddtree_hook


def assert_ddtree_shape(args, *, block: int, budget: int, topk_cap: int) -> None:
    """The documented DDTREE contract between server args and the worker."""
    from sglang.srt.speculative.ddtree_serving import DDTREE_MAX_CUDA_GRAPH_TOKENS
    from sglang.srt.mem_cache.common import get_alloc_len_per_decode

    assert args.speculative_algorithm == "DDTREE"
    assert args.speculative_dflash_block_size == block
    assert args.speculative_ddtree_budget == budget
    assert args.speculative_ddtree_topk_cap == topk_cap
    assert args.speculative_num_draft_tokens == budget + 1  # target verify width
    assert args.speculative_eagle_topk > 1  # fa3 / Mamba tree paths
    # The real per-decode KV reservation is a round's peak: the draft block (released before
    # the verify) or the verify tree, whichever is larger.
    assert get_alloc_len_per_decode(args) == max(block, budget + 1)
    assert args.disable_overlap_schedule is True
    assert args.page_size == 1
    # Captured verify graphs stay bounded in tokens (one batch size always remains).
    assert args.cuda_graph_bs and max(args.cuda_graph_bs) == args.cuda_graph_max_bs
    assert args.cuda_graph_max_bs * (budget + 1) <= max(DDTREE_MAX_CUDA_GRAPH_TOKENS, budget + 1)


# --------------------------------------------------------------------------------------------
# Accepted configurations


def test_defaults_follow_the_draft_block_size(parse, hook):
    args = parse("--attention-backend", "triton")
    budget = DRAFT_BLOCK - 1
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=budget, topk_cap=min(budget, ddtree_serving.DDTREE_DEFAULT_TOPK_CAP))
    assert args.speculative_ddtree_allow_hybrid_unsafe is False
    assert args.speculative_ddtree_debug_metrics is False
    assert args.max_running_requests == 48  # inherited from DFLASH


@pytest.mark.parametrize(
    ("budget", "topk_cap"),
    [(1, None), (7, 3), (63, None), (63, 4), (255, 32), (1023, None)],
)
def test_explicit_budget_and_topk_cap(parse, hook, budget, topk_cap):
    extra = ["--attention-backend", "triton", "--speculative-ddtree-budget", str(budget)]
    if topk_cap is not None:
        extra += ["--speculative-ddtree-topk-cap", str(topk_cap)]
    args = parse(*extra)
    want_cap = topk_cap if topk_cap is not None else min(budget, ddtree_serving.DDTREE_DEFAULT_TOPK_CAP)
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=budget, topk_cap=want_cap)


def test_cuda_graph_batch_sizes(parse, hook):
    dflash = parse("--attention-backend", "triton", algorithm="DFLASH")
    small = parse("--attention-backend", "triton")  # verify width 16: nothing to trim
    assert small.cuda_graph_bs == dflash.cuda_graph_bs
    large = parse("--attention-backend", "triton", "--speculative-ddtree-budget", "255")
    cap = ddtree_serving.DDTREE_MAX_CUDA_GRAPH_TOKENS // 256
    assert large.cuda_graph_bs == [bs for bs in dflash.cuda_graph_bs if bs <= cap]
    explicit = parse("--attention-backend", "triton", "--speculative-ddtree-budget", "1023",
                     "--cuda-graph-bs", "8", "16")
    assert explicit.cuda_graph_bs == [ddtree_serving.DDTREE_MAX_CUDA_GRAPH_TOKENS // 1024]


@pytest.mark.parametrize(("block", "cap", "budget"), [(16, 1, 15), (2, 3, 3), (3, 2, 6), (4, 2, 14)])
def test_smallest_trees_that_hold_the_budget(parse, block, cap, budget):
    # A tree of depth <= block - 1 with cap children per node holds sum(cap**d) nodes.
    assert budget == sum(cap**d for d in range(1, block))
    args = parse("--attention-backend", "triton", "--speculative-dflash-block-size", str(block),
                 "--speculative-ddtree-topk-cap", str(cap), "--speculative-ddtree-budget", str(budget))
    assert_ddtree_shape(args, block=block, budget=budget, topk_cap=cap)
    with pytest.raises(ValueError, match=f"holds at most {budget} nodes"):
        parse("--attention-backend", "triton", "--speculative-dflash-block-size", str(block),
              "--speculative-ddtree-topk-cap", str(cap), "--speculative-ddtree-budget", str(budget + 1))


def test_topk_cap_above_budget_is_clamped(parse):
    args = parse("--attention-backend", "triton", "--speculative-ddtree-budget", "5",
                 "--speculative-ddtree-topk-cap", "50")
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=5, topk_cap=5)


def test_eagle_knobs_are_derived_not_taken(parse):
    args = parse("--attention-backend", "triton", "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", "1", "--speculative-ddtree-budget", "40")
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=40, topk_cap=16)


def test_draft_window_must_cover_the_block(parse):
    args = parse("--attention-backend", "triton", "--speculative-draft-window-size", str(2 * DRAFT_BLOCK))
    assert args.speculative_draft_window_size == 2 * DRAFT_BLOCK
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=DRAFT_BLOCK - 1, topk_cap=DRAFT_BLOCK - 1)
    with pytest.raises(ValueError, match=r"DDTREE.*--speculative-draft-window-size must be >="):
        parse("--attention-backend", "triton", "--speculative-draft-window-size", str(DRAFT_BLOCK - 1))


def test_flags_parse_and_lowercase_algorithm(parse):
    args = parse("--attention-backend", "triton", "--speculative-ddtree-allow-hybrid-unsafe",
                 "--speculative-ddtree-debug-metrics", algorithm="ddtree")
    assert args.speculative_ddtree_allow_hybrid_unsafe is True
    assert args.speculative_ddtree_debug_metrics is True
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=DRAFT_BLOCK - 1, topk_cap=min(DRAFT_BLOCK - 1, 16))


def test_block_size_flag_overrides_the_draft_config(parse):
    args = parse("--attention-backend", "triton", "--speculative-dflash-block-size", "8")
    assert_ddtree_shape(args, block=8, budget=7, topk_cap=7)


def test_block_size_comes_from_the_draft_config(sglang_overlay, tmp_path):
    from sglang.srt.server_args import prepare_server_args

    dirs = fixtures.write_model_dirs(tmp_path, block_size=8)
    args = prepare_server_args(["--model-path", str(dirs.target), "--device", "cuda",
                                "--attention-backend", "triton", "--speculative-algorithm", "DDTREE",
                                "--speculative-draft-model-path", str(dirs.draft)])
    assert_ddtree_shape(args, block=8, budget=7, topk_cap=7)


def test_num_draft_tokens_is_the_verify_width(parse):
    args = parse("--attention-backend", "triton", "--speculative-num-draft-tokens", "32")
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=31, topk_cap=16)
    args = parse("--attention-backend", "triton", "--speculative-num-draft-tokens", "32",
                 "--speculative-ddtree-budget", "31")
    assert args.speculative_ddtree_budget == 31


@pytest.mark.parametrize("backend", ["triton", "flashinfer", "fa3"])
def test_tree_mask_backends_are_accepted(parse, backend):
    args = parse("--attention-backend", backend)
    assert args.attention_backend == backend
    assert_ddtree_shape(args, block=DRAFT_BLOCK, budget=DRAFT_BLOCK - 1, topk_cap=DRAFT_BLOCK - 1)


def test_automatic_backend_is_a_tree_mask_backend(parse):
    from sglang.srt.utils import is_flashinfer_available

    args = parse()  # no --attention-backend
    assert args.attention_backend == ("flashinfer" if is_flashinfer_available() else "triton")


@pytest.mark.parametrize("default", ["fa3", "trtllm_mha", "aiter", "flashinfer", "triton"])
def test_default_backend_resolution(hook, default):
    from sglang.srt.utils import is_flashinfer_available

    fallback = "flashinfer" if is_flashinfer_available() else "triton"
    want = default if default in ("flashinfer", "triton") else fallback
    assert hook.resolve_ddtree_default_attention_backend(default) == want


def test_verify_backend_follows_speculative_attention_mode(parse):
    args = parse("--prefill-attention-backend", "triton", "--decode-attention-backend", "torch_native")
    assert args.get_attention_backends()[0] == "triton"
    with pytest.raises(ValueError, match="got torch_native"):
        parse("--prefill-attention-backend", "triton", "--decode-attention-backend", "torch_native",
              "--speculative-attention-mode", "decode")


def test_handling_is_idempotent(parse, hook):
    # ServerArgs may be validated again after a copy; the derived fields must be stable.
    args = parse("--attention-backend", "triton", "--speculative-ddtree-budget", "40",
                 "--speculative-ddtree-topk-cap", "6")
    again = copy.deepcopy(args)
    from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding

    handle_speculative_decoding(again)
    assert {f: getattr(again, f) for f in DDTREE_FIELDS} == {f: getattr(args, f) for f in DDTREE_FIELDS}


def test_other_algorithms_are_unchanged(parse):
    args = parse("--attention-backend", "triton", algorithm="DFLASH")
    assert args.speculative_algorithm == "DFLASH"
    assert args.speculative_num_draft_tokens == DRAFT_BLOCK
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.speculative_ddtree_budget is None and args.speculative_ddtree_topk_cap is None


# --------------------------------------------------------------------------------------------
# Rejected configurations: each fails with a message that names the problem


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--speculative-ddtree-budget", "0"], r"1 <= --speculative-ddtree-budget <= 1023.*got 0"),
        (["--speculative-ddtree-budget", "-4"], r"--speculative-ddtree-budget.*got -4"),
        (["--speculative-ddtree-budget", "1024"], r"--speculative-ddtree-budget.*got 1024"),
        (["--speculative-ddtree-topk-cap", "0"], r"--speculative-ddtree-topk-cap >= 1, got 0"),
        (["--speculative-ddtree-topk-cap", "1", "--speculative-ddtree-budget", str(DRAFT_BLOCK)],
         rf"holds at most {DRAFT_BLOCK - 1} nodes, fewer than --speculative-ddtree-budget {DRAFT_BLOCK}"),
        (["--speculative-dflash-block-size", "2", "--speculative-ddtree-topk-cap", "3",
          "--speculative-ddtree-budget", "4"], r"holds at most 3 nodes"),
        (["--speculative-dflash-block-size", "1"], r"block size >= 2.*got 1"),
        (["--speculative-num-draft-tokens", "8", "--speculative-ddtree-budget", "31"],
         r"must equal --speculative-ddtree-budget \+ 1"),
        (["--attention-backend", "torch_native"], r"tree mask.*flashinfer, triton, fa3.*got torch_native"),
        (["--page-size", "16"], r"--page-size 1.*got page_size=16"),
        (["--pp-size", "2"], r"DDTREE.*pp_size == 1"),
        (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], r"DDTREE.*dp attention"),
        (["--speculative-accept-threshold-single", "0.5"],
         r"DDTREE samples exactly.*--speculative-accept-threshold-single must stay 1.0, got 0.5"),
        (["--enable-deterministic-inference"],
         r"DDTREE does not support --enable-deterministic-inference"),
        (["--speculative-accept-threshold-acc", "0.3"],
         r"--speculative-accept-threshold-acc must stay 1.0, got 0.3"),
    ],
)
def test_invalid_ddtree_configurations(parse, extra, message):
    if "--attention-backend" not in extra:
        extra = ["--attention-backend", "triton", *extra]
    with pytest.raises(ValueError, match=message):
        parse(*extra)


def test_draft_model_is_required(parse):
    with pytest.raises(ValueError, match=r"DDTREE.*--speculative-draft-model-path"):
        parse("--attention-backend", "triton", draft=False)


def test_cpu_device_is_refused(parse):
    with pytest.raises(ValueError, match="tree mask"):
        parse(device="cpu")


@pytest.mark.parametrize(
    ("flag", "algorithm"),
    [
        (["--speculative-ddtree-budget", "15"], "DFLASH"),
        (["--speculative-ddtree-topk-cap", "4"], None),
        (["--speculative-ddtree-allow-hybrid-unsafe"], "DFLASH"),
        (["--speculative-ddtree-debug-metrics"], None),
    ],
)
def test_ddtree_flags_need_ddtree(parse, flag, algorithm):
    with pytest.raises(ValueError, match=rf"{flag[0]} require\(s\) --speculative-algorithm DDTREE"):
        parse("--attention-backend", "triton", *flag, algorithm=algorithm, draft=algorithm is not None)


def test_ddtree_flags_need_ddtree_even_for_dummy_models(sglang_overlay):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(ValueError, match="require"):
        prepare_server_args(["--model-path", "dummy", "--speculative-ddtree-budget", "3"])


# --------------------------------------------------------------------------------------------
# Algorithm selection (spec_info / spec_registry)


def test_algorithm_predicates(sglang_overlay):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    ddtree = SpeculativeAlgorithm.from_string("ddtree")
    assert ddtree is SpeculativeAlgorithm.DDTREE
    assert ddtree.is_ddtree() and ddtree.is_dflash() and ddtree.supports_target_verify_for_draft()
    assert not ddtree.supports_spec_v2() and not ddtree.is_eagle()
    for other in SpeculativeAlgorithm:
        if other is not SpeculativeAlgorithm.DDTREE:
            assert not other.is_ddtree(), other
    assert SpeculativeAlgorithm.DFLASH.is_dflash()


def test_ddtree_verify_input_type(sglang_overlay):
    from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

    class _Probe(SpecInput):  # the abstract base needs one method to instantiate
        def get_spec_adjust_token_coefficient(self):
            return (1, 1)

    probe = _Probe(SpecInputType.DDTREE_VERIFY)
    assert probe.is_verify_input() and not probe.is_draft_input()


def test_plugin_conformance_still_holds(sglang_overlay):
    from sglang.srt.speculative import spec_registry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec_registry._assert_custom_spec_algo_conforms(spec_registry.CustomSpecAlgo)
    assert spec_registry.CustomSpecAlgo("X", lambda sa: object).is_ddtree() is False
    with pytest.raises(ValueError, match="reserved"):
        SpeculativeAlgorithm.register("ddtree")(lambda sa: object)
    # The guard is live: a spec class without is_ddtree() is refused by name.
    stripped = type("Stripped", (), {k: v for k, v in vars(spec_registry.CustomSpecAlgo).items()
                                     if k != "is_ddtree"})
    with pytest.raises(TypeError, match="is_ddtree"):
        spec_registry._assert_custom_spec_algo_conforms(stripped)


def test_create_worker(sglang_overlay):
    from sglang.srt.speculative import ddtree_worker, dflash_worker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    with pytest.raises(ValueError, match="DDTREE does not support overlap"):
        SpeculativeAlgorithm.DDTREE.create_worker(SimpleNamespace(disable_overlap_schedule=False))
    worker = SpeculativeAlgorithm.DDTREE.create_worker(SimpleNamespace(disable_overlap_schedule=True))
    assert worker is ddtree_worker.DDTreeWorker and issubclass(worker, dflash_worker.DFlashWorker)
    assert SpeculativeAlgorithm.DFLASH.create_worker(SimpleNamespace(disable_overlap_schedule=True)) \
        is dflash_worker.DFlashWorker


# --------------------------------------------------------------------------------------------
# --help


def test_help_documents_the_flags(sglang_overlay, hook):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    for flag in ("--speculative-ddtree-budget", "--speculative-ddtree-topk-cap",
                 "--speculative-ddtree-allow-hybrid-unsafe", "--speculative-ddtree-debug-metrics"):
        assert flag in text
    assert "NGRAM, DFLASH, DDTREE" in text
    assert f"(1 to {ddtree_serving.DDTREE_MAX_BUDGET})" in text
    assert "Default: DFlash block size - 1" in text and "starting point" in text
    assert f"Default: min(budget, {ddtree_serving.DDTREE_DEFAULT_TOPK_CAP})" in text
    assert "refused at startup" in text and "/get_server_info" in text


# --------------------------------------------------------------------------------------------
# Derived serving numbers: KV reservation, drafter graph batch sizes, sliding windows


def _round_peak_slots(block: int, budget: int) -> int:
    """KV slots one request holds at the peak of a v1 DDTREE round, replayed step by step:
    the draft block is allocated and released, then the verify tree is allocated; the
    rejected tree nodes are freed after the verify."""
    held = peak = 0
    for step in (+block, -block, +(budget + 1)):
        held += step
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("budget", [1, 15, 63, 255, 1023])
def test_kv_reservation_is_the_round_peak(parse, budget, monkeypatch):
    from sglang.srt import server_args as server_args_mod
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.common import get_alloc_len_per_decode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    args = parse("--attention-backend", "triton", "--speculative-ddtree-budget", str(budget))
    peak = _round_peak_slots(DRAFT_BLOCK, budget)
    assert get_alloc_len_per_decode(args) == peak
    # The scheduler's own check (spec v1, page size 1) reserves exactly that per request.
    monkeypatch.setattr(server_args_mod, "_global_server_args", args)
    batch = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
        reqs=[object(), object(), object()],
        spec_algorithm=SpeculativeAlgorithm.DDTREE,
        is_spec_v2=False,
    )
    assert ScheduleBatch.new_tokens_required_next_decode(batch) == 3 * peak


def test_drafter_keeps_the_untrimmed_cuda_graph_batch_sizes(parse, sglang_overlay):
    from sglang.srt.speculative import ddtree_worker

    dflash = parse("--attention-backend", "triton", algorithm="DFLASH")
    for budget in (15, 255, 1023):
        args = parse("--attention-backend", "triton", "--speculative-ddtree-budget", str(budget))
        assert args.speculative_ddtree_draft_cuda_graph_bs == dflash.cuda_graph_bs
        assert args.speculative_ddtree_draft_cuda_graph_max_bs == dflash.cuda_graph_max_bs
        draft = ddtree_worker.DDTreeWorker._make_draft_server_args(None, args)
        assert draft.cuda_graph_bs == dflash.cuda_graph_bs
        assert draft.cuda_graph_max_bs == dflash.cuda_graph_max_bs
        assert draft.speculative_num_draft_tokens == DRAFT_BLOCK
        # The target's list is trimmed for the verify width; the drafter's is not.
        assert args.cuda_graph_bs == [b for b in dflash.cuda_graph_bs
                                      if b <= max(1, 4096 // (budget + 1))] or budget == 1023
    # An explicit --cuda-graph-bs reaches the drafter unchanged.
    args = parse("--attention-backend", "triton", "--speculative-ddtree-budget", "1023",
                 "--cuda-graph-bs", "8", "16")
    assert ddtree_worker.DDTreeWorker._make_draft_server_args(None, args).cuda_graph_bs == [8, 16]


def _sliding_window_dirs(tmp_path, **target_overrides):
    dirs = fixtures.write_model_dirs(tmp_path, block_size=16)
    cfg = fixtures.target_config()
    cfg.update(target_overrides)
    (dirs.target / "config.json").write_text(__import__("json").dumps(cfg))
    return dirs


def _parse_dirs(dirs, *extra):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", str(dirs.target), "--device", "cuda",
                                "--speculative-algorithm", "DDTREE",
                                "--speculative-draft-model-path", str(dirs.draft), *extra])


GEMMA2_SLIDING = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=128,
                      query_pre_attn_scalar=64, final_logit_softcapping=None,
                      attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_sliding_window_target_is_refused_on_position_window_backends(sglang_overlay, tmp_path, backend):
    dirs = _sliding_window_dirs(tmp_path, **GEMMA2_SLIDING)
    with pytest.raises(ValueError, match=rf"DDTREE: the target uses sliding-window attention "
                       rf"\(window 128\), and the {backend} backend .* --attention-backend fa3"):
        _parse_dirs(dirs, "--attention-backend", backend)


def test_sliding_window_target_is_accepted_on_fa3(sglang_overlay, tmp_path):
    dirs = _sliding_window_dirs(tmp_path, **GEMMA2_SLIDING)
    args = _parse_dirs(dirs, "--attention-backend", "fa3")
    assert args.attention_backend == "fa3" and args.speculative_algorithm == "DDTREE"


def test_unused_sliding_window_field_is_not_a_window(sglang_overlay, tmp_path, hook):
    # Qwen-style configs carry `sliding_window` with use_sliding_window false; SGLang's Qwen3
    # model applies no window, so DDTREE serves it on any tree-mask backend.
    dirs = _sliding_window_dirs(tmp_path, sliding_window=4096, use_sliding_window=False)
    args = _parse_dirs(dirs, "--attention-backend", "triton")
    assert hook.ddtree_target_sliding_window(args) is None


def test_sliding_window_architectures_match_the_installed_models(sglang_overlay, hook):
    """The architecture list equals the EntryClass names whose SGLang model class defines or
    inherits get_attention_sliding_window_size (read from the installed sources), EAGLE-3
    drafts aside."""
    import ast
    from pathlib import Path

    classes, entries = {}, set()
    for path in sorted((sglang_overlay.installed / "srt" / "models").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8-sig"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                own = any(isinstance(m, ast.FunctionDef) and m.name == "get_attention_sliding_window_size"
                          for m in node.body)
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                classes.setdefault(node.name, (own, bases))
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
                entries |= {v.id for v in values if isinstance(v, ast.Name)}

    def applies_window(name, seen=()):
        if name not in classes or name in seen:
            return False
        own, bases = classes[name]
        return own or any(applies_window(b, seen + (name,)) for b in bases)

    want = {e for e in entries if applies_window(e) and "Eagle3" not in e}
    assert want and set(hook.DDTREE_SLIDING_WINDOW_ARCHS) == want
    assert Path(sglang_overlay.installed).is_dir()
