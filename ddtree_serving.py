"""DDTREE serving rules shared by every pin: server arguments, request refusals, serving limits
and the debug metrics.

Standard library only (no torch). Shipped next to ddtree_utils.py as
``sglang/srt/speculative/ddtree_serving.py``; each pin's patches call these functions from their
hooks, so a rule is written once:

* server arguments: the DDTREE-only flags (:func:`reject_ddtree_flags_without_ddtree`) and the
  budget / top-k cap / DFlash block resolution (:func:`resolve_ddtree_server_args`), the verify
  backend and page size checks (:func:`verify_attention_backend`, :func:`check_page_size`), the
  CUDA-graph batch sizes of the verify (:func:`verify_cuda_graph_bs`); what differs per pin (the scheduler's
  KV reservation, the attention backends a pin is tested with, model checks) stays in its hook;
* per request: :func:`validate_ddtree_request` (both pins' schedulers);
* serving limits derived from the budget (:func:`spec_steps_and_topk`, :func:`verify_token_limit`,
  ...: the 0.5.13.post1 worker's; the 0.5.16 worker sizes its round in its own hook);
* the worker's sizes (:func:`worker_shape`) and ``--speculative-ddtree-debug-metrics``
  (:class:`DDTreeDebugMetrics`).

Units are tokens (= KV slots at page size 1) unless a name says bytes.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

__all__ = [
    "auto_decode_reserve_len",
    "auto_verify_widths",
    "auto_widest_width",
    "auto_width_limits",
    "check_page_size",
    "DDTREE_AUTO",
    "DDTREE_AUTO_WIDTHS",
    "DDTREE_DEFAULT_TOPK_CAP",
    "DDTREE_FLAGS",
    "DDTREE_MAX_BUDGET",
    "DDTREE_MAX_CUDA_GRAPH_TOKENS",
    "DDTreeDebugMetrics",
    "decode_kv_reservation",
    "graph_batch_size",
    "is_ddtree_algorithm",
    "max_accept_depth",
    "parse_ddtree_budget",
    "reject_ddtree_flags_without_ddtree",
    "resolve_ddtree_server_args",
    "spec_steps_and_topk",
    "tree_capacity",
    "tree_decode_reserve_len",
    "unsupported_sampling_param",
    "validate_ddtree_request",
    "verify_attention_backend",
    "verify_backend_of",
    "verify_cuda_graph_bs",
    "verify_graph_rows",
    "VERIFY_LOGITS_MEMORY_SHARE",
    "verify_max_running_requests",
    "VERIFY_SAMPLING_WORKSPACE_ROWS",
    "verify_token_limit",
    "width_graph_bs",
    "worker_shape",
    "WorkerShape",
]

logger = logging.getLogger(__name__)

# The tree kernels (sgl_kernel's verify_tree_greedy, reconstruct_indices_from_tree_mask) run one
# thread block per request with one thread per node: N = budget + 1 <= 1024.
DDTREE_MAX_BUDGET = 1023
DDTREE_DEFAULT_TOPK_CAP = 16
# Tokens per captured target-verify CUDA graph (batch size * (budget + 1)). Each token also gets a
# float32 vocab-sized logits row in the graph buffers, so large budgets capture fewer batch sizes;
# larger batches run the verify without CUDA graphs.
DDTREE_MAX_CUDA_GRAPH_TOKENS = 4096
# --speculative-ddtree-budget auto: the verify widths (budget + 1) a round may use before the
# memory rule below filters them (ddtree_budget chooses one per round).
DDTREE_AUTO = "auto"
DDTREE_AUTO_WIDTHS = (8, 16, 32, 64, 128, 256)
# (flag, server-args field): DDTREE only, an error with any other algorithm (or none).
DDTREE_FLAGS = (
    ("--speculative-ddtree-budget", "speculative_ddtree_budget"),
    ("--speculative-ddtree-topk-cap", "speculative_ddtree_topk_cap"),
    ("--speculative-ddtree-allow-hybrid-unsafe", "speculative_ddtree_allow_hybrid_unsafe"),
    ("--speculative-ddtree-debug-metrics", "speculative_ddtree_debug_metrics"),
)


# ----------------------------------------------------------------------------------------------
# Server arguments
# ----------------------------------------------------------------------------------------------


def is_ddtree_algorithm(speculative_algorithm: str | None) -> bool:
    return (speculative_algorithm or "").upper() == "DDTREE"


def reject_ddtree_flags_without_ddtree(server_args) -> None:
    """DDTREE-only flags are an error with any other algorithm (or none)."""
    if is_ddtree_algorithm(server_args.speculative_algorithm):
        return
    flags = [
        flag
        for flag, field in DDTREE_FLAGS
        if getattr(server_args, field, None) not in (None, False)
    ]
    if flags:
        raise ValueError(
            f"{', '.join(flags)} require(s) --speculative-algorithm DDTREE, "
            f"got speculative_algorithm={server_args.speculative_algorithm}."
        )


def parse_ddtree_budget(value):
    """``--speculative-ddtree-budget``'s value (both pins' CLI type): None, an int (its range is
    checked by :func:`resolve_ddtree_server_args`) or :data:`DDTREE_AUTO`; case and blanks
    around ``auto`` are ignored. ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"--speculative-ddtree-budget must be an integer or 'auto', got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if text == DDTREE_AUTO:
        return DDTREE_AUTO
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"--speculative-ddtree-budget must be an integer or 'auto', got {value!r}"
        ) from None


def auto_verify_widths(
    max_batch: int,
    capacity: int,
    widths=DDTREE_AUTO_WIDTHS,
    max_graph_tokens: int = DDTREE_MAX_CUDA_GRAPH_TOKENS,
) -> tuple:
    """The verify widths ``--speculative-ddtree-budget auto`` may use, ascending: ``2 <= w <=
    DDTREE_MAX_BUDGET + 1``, ``w - 1`` nodes that the tree can hold (``capacity``,
    :func:`tree_capacity`) and ``w <= max_graph_tokens`` (one request's verify fits a graph).

    Each width has a batch range of its own (:func:`auto_width_limits`): a verify holds at most
    ``max_graph_tokens`` tokens, so width ``w`` serves batches up to about ``max_graph_tokens //
    w`` and the narrowest width serves every batch up to ``max_batch`` (the largest CUDA-graph
    batch size, or the running-request cap without graphs): it must fit ``w * max_batch <=
    max_graph_tokens``. ValueError when no width is left or the narrowest does not fit."""
    max_batch, capacity = int(max_batch), int(capacity)
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    keep = sorted(
        {
            int(w)
            for w in widths
            if 2 <= int(w) <= DDTREE_MAX_BUDGET + 1
            and int(w) - 1 <= capacity
            and int(w) <= max_graph_tokens
        }
    )
    if not keep or keep[0] * max_batch > max_graph_tokens:
        raise ValueError(
            f"DDTREE --speculative-ddtree-budget auto: no verify width in "
            f"{sorted(int(w) for w in widths)} fits {max_graph_tokens} tokens per verify at "
            f"batch {max_batch} and a tree of at most {capacity} nodes; lower "
            "--cuda-graph-max-bs / --max-running-requests or pass a fixed budget."
        )
    return tuple(keep)


def auto_width_limits(
    widths,
    graph_bs,
    max_graph_tokens: int = DDTREE_MAX_CUDA_GRAPH_TOKENS,
) -> dict:
    """``{width: largest batch it verifies}`` for budget auto's tree widths (ascending, from
    :func:`auto_verify_widths`); the narrowest maps to None: it serves every batch.

    With CUDA graphs (``graph_bs``: the decode graph batch sizes) a width ``w`` captures the
    sizes ``g`` with ``g * w <= max_graph_tokens`` (:func:`width_graph_bs`) and serves the batches
    up to the largest of them, so every batch it serves pads to one of its own graphs. Without
    graphs (``graph_bs`` empty) it serves batches up to ``max_graph_tokens // w``. The worker's
    controller offers a width only within its range, the draft tree of a batch is built for the
    widest width in range (:func:`auto_widest_width`), and the scheduler's KV reservation follows
    that width too."""
    widths = sorted(int(w) for w in widths)
    sizes = sorted({int(b) for b in (graph_bs or [])})
    out: dict = {}
    for i, w in enumerate(widths):
        if i == 0:
            out[w] = None
            continue
        if not sizes:
            out[w] = max(1, max_graph_tokens // w)
            continue
        # 0: no graph holds even the smallest batch at this width, so it is never offered
        out[w] = max((g for g in sizes if g * w <= max_graph_tokens), default=0)
    return out


def auto_widest_width(bs: int, limits) -> int:
    """The widest tree width whose range (:func:`auto_width_limits`) holds a batch of ``bs``."""
    return max(w for w, limit in limits.items() if limit is None or int(bs) <= limit)


def width_graph_bs(batch_sizes, verify_width: int, max_graph_tokens: int = DDTREE_MAX_CUDA_GRAPH_TOKENS) -> list:
    """The CUDA-graph batch sizes a DDTREE target runner of ``verify_width`` tokens a request
    captures: those of ``batch_sizes`` that hold at most ``max_graph_tokens`` tokens, at least the
    smallest one. For a fixed budget the list was trimmed at start-up already
    (:func:`verify_cuda_graph_bs`); for budget auto each width keeps its own range."""
    sizes = sorted(int(b) for b in batch_sizes)
    return [b for b in sizes if b * int(verify_width) <= max_graph_tokens] or sizes[:1]


def verify_graph_rows(batch_sizes, verify_widths, max_graph_tokens: int = DDTREE_MAX_CUDA_GRAPH_TOKENS) -> int:
    """Rows of the logits buffer that SGLang shares between its CUDA graphs, for the DDTREE
    target's verify runners: one runner a verify width (the budget's, and under budget auto every
    width), each capturing :func:`width_graph_bs`, so the largest graph holds ``w * max(its
    sizes)`` tokens. Upstream sizes the buffer ``max(batch_sizes) * N`` for verify width N: at
    auto's widest width 256 and graphs to batch 256 that is 65,536 rows (37 GiB at Qwen3's
    vocabulary) where no graph holds more than 4,096."""
    return max(int(w) * max(width_graph_bs(batch_sizes, w, max_graph_tokens)) for w in verify_widths)


def tree_decode_reserve_len(verify_width: int, block_size: int) -> int:
    """KV slots a request reserves past its (host, one round late) committed length on the
    overlap scheduler's v2 round: from the true prefix p <= committed + (D + 1) the round writes
    the draft block at [p, p + block), the tree verify at [p, p + N) and the accepted path's
    staging copy at [p + N, p + N + D + 1), so ``(D + 1) + max(block, N + D + 1)`` with N the
    verify width and D = min(N - 1, block - 1) the deepest acceptable path."""
    n, block = int(verify_width), int(block_size)
    depth = min(n - 1, block - 1)
    return (depth + 1) + max(block, n + depth + 1)


def auto_decode_reserve_len(bs: int, limits, block_size: int) -> int:
    """:func:`tree_decode_reserve_len` for a round of ``bs`` requests under budget auto: at the
    widest width the batch may run (:func:`auto_widest_width`). A large batch runs narrow trees
    only, so it reserves a narrow tree's slots rather than the widest width's."""
    return tree_decode_reserve_len(auto_widest_width(bs, limits), block_size)


def tree_capacity(topk_cap: int, max_depth: int, budget: int) -> int:
    """Nodes a tree of depth <= ``max_depth`` with at most ``topk_cap`` children per node can
    hold (``K + K^2 + ... + K^D``), counted only until it reaches ``budget``."""
    capacity, width = 0, 1
    for _ in range(max_depth):
        width *= topk_cap
        capacity += width
        if capacity >= budget:
            break
    return capacity


def resolve_ddtree_server_args(
    server_args,
    handle_dflash: Callable[[object], None],
    auto_max_batch: Callable[[object], int] | None = None,
    auto_default: Callable[[object], bool] | None = None,
) -> tuple[int, int, int]:
    """The DDTREE part of the server-args handling that is the same on every pin.

    ``--speculative-num-draft-tokens`` is the verify width (budget + 1) for DDTREE; the DFlash
    block size comes from ``--speculative-dflash-block-size`` or the draft config, which the
    pin's DFLASH handling (``handle_dflash(server_args)``, run here with the derived fields
    cleared) resolves into ``speculative_num_draft_tokens``. Then: block >= 2, budget in
    1..DDTREE_MAX_BUDGET (default: below), top-k cap >= 1 (default min(budget, 16), clamped to
    the budget) able to hold the budget, no deterministic inference and no lossy acceptance.

    The default budget: ``auto`` on a pin that serves it (one that passes ``auto_max_batch``) at
    ``tp_size`` 1 where the pin's ``auto_default(server_args)`` allows it (e.g. the verify
    attention backend auto has run on), when neither ``--speculative-ddtree-budget`` nor
    ``--speculative-num-draft-tokens`` is given; otherwise the block size - 1.

    ``--speculative-ddtree-budget auto`` (a pin that runs it passes ``auto_max_batch``: the
    largest batch one verify may hold after the DFLASH handling, e.g. the largest CUDA-graph
    batch size, which the narrowest width must serve): the budget becomes the widest of
    :func:`auto_verify_widths` minus one (the tree buffers and the static sizes cover every
    width; each width serves its own batch range, :func:`auto_width_limits`) and
    ``speculative_ddtree_auto_widths`` lists the widths; the verify width varies per round, so
    ``--speculative-num-draft-tokens`` is refused with it.

    Sets ``speculative_dflash_block_size``, ``speculative_ddtree_budget`` and
    ``speculative_ddtree_topk_cap``; leaves ``speculative_num_draft_tokens`` at the block size
    for the pin to set the verify width and its (num_steps, topk). Returns
    ``(block, budget, topk_cap)``. Raises ValueError with the flag to change.
    """
    verify_width = server_args.speculative_num_draft_tokens
    budget = parse_ddtree_budget(server_args.speculative_ddtree_budget)
    if budget is None and verify_width is None and auto_max_batch is not None:
        # the default where the pin serves auto (docs/DDTREE.md, "Defaults"); auto is not built
        # for tensor parallelism (the ranks would time and choose apart), so TP > 1 keeps block - 1
        if int(getattr(server_args, "tp_size", 1) or 1) > 1:
            logger.info(
                "DDTREE: a fixed budget of block size - 1 (the default with --tp-size > 1, "
                "where budget auto is not available)."
            )
        elif auto_default is not None and not auto_default(server_args):
            logger.info(
                "DDTREE: a fixed budget of block size - 1 (the default here: budget auto is the "
                "default with CUDA graphs and the triton verify backend, where it is tested; "
                "pass --speculative-ddtree-budget auto to run it here)."
            )
        else:
            budget = DDTREE_AUTO
            logger.info("DDTREE: --speculative-ddtree-budget auto (the default on this version).")
    auto = budget == DDTREE_AUTO
    if auto:
        if auto_max_batch is None:
            raise ValueError(
                "DDTREE: --speculative-ddtree-budget auto is not available on this SGLang "
                "version; pass a fixed budget (1..1023)."
            )
        if verify_width is not None:
            raise ValueError(
                "DDTREE: --speculative-ddtree-budget auto chooses the verify width per round; "
                f"drop --speculative-num-draft-tokens (got {verify_width})."
            )
    elif verify_width is not None:
        verify_width = int(verify_width)
        if budget is None:
            budget = verify_width - 1
        elif verify_width != int(budget) + 1:
            raise ValueError(
                "DDTREE: --speculative-num-draft-tokens is the verify width and must equal "
                f"--speculative-ddtree-budget + 1, got speculative_num_draft_tokens={verify_width}, "
                f"speculative_ddtree_budget={budget}."
            )
    # num_steps / topk are derived by the pin; clear them so DFLASH's forcing does not warn.
    server_args.speculative_num_draft_tokens = None
    server_args.speculative_num_steps = None
    server_args.speculative_eagle_topk = None
    try:
        handle_dflash(server_args)
    except ValueError as e:
        raise ValueError(f"DDTREE (a DFlash-family algorithm): {e}") from e
    block_size = int(server_args.speculative_num_draft_tokens)
    if block_size < 2:
        raise ValueError(
            "DDTREE needs a DFlash block size >= 2 (the bonus token plus at least one "
            f"drafted position), got {block_size}."
        )
    server_args.speculative_dflash_block_size = block_size

    if auto:
        cap = server_args.speculative_ddtree_topk_cap
        cap = DDTREE_DEFAULT_TOPK_CAP if cap is None else max(1, int(cap))
        max_batch = auto_max_batch(server_args)
        widths = auto_verify_widths(max_batch, tree_capacity(cap, block_size - 1, DDTREE_MAX_BUDGET))
        server_args.speculative_ddtree_auto_widths = list(widths)
        budget = widths[-1] - 1
        logger.info(
            "DDTREE budget auto: verify widths %s, each over its own batch range (budget %d "
            "sizes the tree buffers).",
            widths,
            budget,
        )
    if budget is None:
        budget = block_size - 1
    budget = int(budget)
    if not 1 <= budget <= DDTREE_MAX_BUDGET:
        raise ValueError(
            f"DDTREE requires 1 <= --speculative-ddtree-budget <= {DDTREE_MAX_BUDGET} "
            f"(the tree kernels verify at most {DDTREE_MAX_BUDGET + 1} tokens per request), "
            f"got {budget}."
        )
    topk_cap = server_args.speculative_ddtree_topk_cap
    if topk_cap is None:
        topk_cap = min(budget, DDTREE_DEFAULT_TOPK_CAP)
    topk_cap = int(topk_cap)
    if topk_cap < 1:
        raise ValueError(f"DDTREE requires --speculative-ddtree-topk-cap >= 1, got {topk_cap}.")
    if topk_cap > budget:
        logger.warning(
            "DDTREE: --speculative-ddtree-topk-cap %d exceeds the budget %d; using %d.",
            topk_cap,
            budget,
            budget,
        )
        topk_cap = budget
    max_depth = block_size - 1
    capacity = tree_capacity(topk_cap, max_depth, budget)
    if capacity < budget:
        raise ValueError(
            f"DDTREE: a tree of depth <= block_size - 1 = {max_depth} with "
            f"--speculative-ddtree-topk-cap {topk_cap} holds at most {capacity} nodes, "
            f"fewer than --speculative-ddtree-budget {budget}."
        )
    server_args.speculative_ddtree_budget = budget
    server_args.speculative_ddtree_topk_cap = topk_cap
    if getattr(server_args, "enable_deterministic_inference", False):
        raise ValueError(
            "DDTREE does not support --enable-deterministic-inference: the plain "
            "sampler's per-request seeded draws cannot be reproduced by a tree verify."
        )
    # The tree sampler is exact target sampling; it has no lossy acceptance mode.
    for flag, field in (
        ("--speculative-accept-threshold-single", "speculative_accept_threshold_single"),
        ("--speculative-accept-threshold-acc", "speculative_accept_threshold_acc"),
    ):
        value = getattr(server_args, field, 1.0)
        if value != 1.0:
            raise ValueError(
                f"DDTREE samples exactly from the target's distribution; {flag} must stay "
                f"1.0, got {value}."
            )
    return block_size, budget, topk_cap


def verify_backend_of(
    prefill_backend: str | None, decode_backend: str | None, attention_mode: str | None
) -> str | None:
    """The attention backend that runs the target verify: the decode backend with
    ``--speculative-attention-mode decode``, else the prefill backend."""
    return decode_backend if attention_mode == "decode" else prefill_backend


def verify_attention_backend(
    prefill_backend: str | None,
    decode_backend: str | None,
    attention_mode: str | None,
    tree_mask_backends: tuple[str, ...],
) -> str:
    """The attention backend that runs the target verify (:func:`verify_backend_of`), refused
    unless it is one of the pin's ``tree_mask_backends`` (those that apply the tree mask in
    TARGET_VERIFY)."""
    verify_backend = verify_backend_of(prefill_backend, decode_backend, attention_mode)
    if verify_backend not in tree_mask_backends:
        raise ValueError(
            f"DDTREE needs a target attention backend that applies a tree mask in "
            f"target verify ({', '.join(tree_mask_backends)}), got "
            f"{verify_backend}. Pass e.g. --attention-backend flashinfer."
        )
    return verify_backend


def check_page_size(page_size: int | None) -> None:
    """Page size 1 only: the accepted path is not contiguous inside the verify block."""
    if page_size is not None and int(page_size) > 1:
        raise ValueError(
            "DDTREE currently supports only --page-size 1 (the accepted tree path is "
            f"not contiguous in the verify block), got page_size={page_size}."
        )


def verify_cuda_graph_bs(batch_sizes, verify_width: int) -> list[int] | None:
    """The target's CUDA-graph batch sizes trimmed so that each captured verify graph holds at
    most DDTREE_MAX_CUDA_GRAPH_TOKENS tokens (``bs * verify_width``), or None when every size
    already fits (or there is no list). Larger batches run the verify without CUDA graphs."""
    if not batch_sizes:
        return None
    max_bs = max(1, DDTREE_MAX_CUDA_GRAPH_TOKENS // int(verify_width))
    if max(batch_sizes) <= max_bs:
        return None
    trimmed = [bs for bs in batch_sizes if bs <= max_bs] or [max_bs]
    logger.warning(
        "DDTREE: CUDA graphs capture batch sizes up to %d (verify width %d, at most "
        "%d tokens per graph); larger batches run the verify without CUDA graphs.",
        max(trimmed),
        verify_width,
        DDTREE_MAX_CUDA_GRAPH_TOKENS,
    )
    return trimmed


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def unsupported_sampling_param(
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    min_new_tokens: int = 0,
    sampling_seed: int | None = None,
    custom_logit_processor: object | None = None,
) -> str | None:
    """The first request parameter the tree verify cannot apply exactly, or None.

    SGLang applies penalties (and the min-new-tokens EOS mask) as one vector per request to
    every verify row; in a tree each node has its own ancestors, so these would be inexact. A
    custom logit processor sees one row per request in plain decoding and a per-request
    ``sampling_seed`` fixes the plain sampler's draws, neither of which a tree can reproduce.
    Returns the parameter's name (as in the API) with its value.
    """
    if repetition_penalty is not None and repetition_penalty != 1.0:
        return f"repetition_penalty={repetition_penalty}"
    if frequency_penalty is not None and frequency_penalty != 0.0:
        return f"frequency_penalty={frequency_penalty}"
    if presence_penalty is not None and presence_penalty != 0.0:
        return f"presence_penalty={presence_penalty}"
    if min_new_tokens and min_new_tokens > 0:
        return f"min_new_tokens={min_new_tokens}"
    if sampling_seed is not None:
        return f"sampling_seed={sampling_seed}"
    if custom_logit_processor:
        return "custom_logit_processor"
    return None


def validate_ddtree_request(req) -> str | None:
    """The refusal message of a request DDTREE cannot serve exactly (beyond DFLASH's own
    refusals of logprobs and grammars), or None. ``req``: SGLang's ``Req`` (its
    ``sampling_params`` and ``custom_logit_processor``); the scheduler aborts only this request."""
    params = req.sampling_params
    unsupported = unsupported_sampling_param(
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        min_new_tokens=params.min_new_tokens,
        sampling_seed=getattr(params, "sampling_seed", None),
        custom_logit_processor=getattr(req, "custom_logit_processor", None),
    )
    if unsupported is None:
        return None
    return (
        f"DDTREE speculative decoding does not support {unsupported}: it would apply "
        "one value per request to every draft-tree node (temperature, top_k, top_p, "
        "min_p and logit_bias are supported)."
    )


# ----------------------------------------------------------------------------------------------
# Serving limits: server-argument numbers derived from the budget (0.5.13.post1's worker)
# ----------------------------------------------------------------------------------------------
# Plain integer arithmetic on the values SGLang's server args and memory plan hold.

# Dense float32 [V] rows a sampled verify keeps per verify token besides the logits themselves
# (the bounded-memory sampler's workspace, at most 2x the verify logits).
VERIFY_SAMPLING_WORKSPACE_ROWS = 2
# Share of the memory free after startup that the verify logits and the sampler may use; the
# rest is left to the forward's activations (bounded separately by max_forward_tokens).
VERIFY_LOGITS_MEMORY_SHARE = 0.5


def max_accept_depth(budget: int, block_size: int) -> int:
    """Most draft tokens one round can accept: the tree depth is capped by the draft block."""
    return max(0, min(int(budget), int(block_size) - 1))


def decode_kv_reservation(budget: int, block_size: int) -> int:
    """KV slots one request allocates at the peak of a round (page size 1).

    A v1 round allocates the draft block (``block_size`` slots), frees it before the verify,
    then allocates the verify tree (``budget + 1`` slots) and frees the rejected nodes after
    it, so the peak per request is ``max(block_size, budget + 1)``.
    """
    return max(int(block_size), int(budget) + 1)


def spec_steps_and_topk(budget: int, block_size: int) -> tuple[int, int]:
    """``(speculative_num_steps, speculative_eagle_topk)`` for a DDTree target.

    SGLang reserves ``max(num_steps * topk, num_draft_tokens)`` KV slots per request and decode
    round (page size 1, spec v1); topk must be > 1 so that the fa3 and Mamba backends take
    their tree paths. ``(1, decode_kv_reservation)`` makes the reservation exactly the peak.
    """
    return 1, max(2, decode_kv_reservation(budget, block_size))


def verify_token_limit(
    free_bytes: int,
    vocab_size: int,
    max_forward_tokens: int,
    extra_bytes_per_token: int = 0,
) -> int:
    """Most tokens one verify forward may hold, from the memory left after startup.

    Each verify token gets a float32 ``[V]`` logits row plus the sampler's workspace
    (``VERIFY_SAMPLING_WORKSPACE_ROWS`` more rows) and ``extra_bytes_per_token`` (e.g. the
    captured hidden states); together they may use ``VERIFY_LOGITS_MEMORY_SHARE`` of
    ``free_bytes``. ``max_forward_tokens`` (the largest extend forward the memory plan was sized
    for, SGLang's chunked prefill size) bounds the activations. At least 1.
    """
    per_token = 4 * int(vocab_size) * (1 + VERIFY_SAMPLING_WORKSPACE_ROWS) + int(
        extra_bytes_per_token
    )
    by_memory = int(max(0, int(free_bytes)) * VERIFY_LOGITS_MEMORY_SHARE) // max(1, per_token)
    return max(1, min(int(max_forward_tokens), by_memory))


def verify_max_running_requests(
    token_limit: int, budget: int, block_size: int, requested: int
) -> int:
    """Running-request cap so that every forward of a round (the draft block, ``block_size``
    tokens a request, and the verify, ``budget + 1``) stays within ``token_limit``. At least 1
    and at most ``requested``."""
    per_request = decode_kv_reservation(budget, block_size)
    return max(1, min(int(requested), int(token_limit) // per_request))


def graph_batch_size(bs: int, captured: list[int] | tuple[int, ...]) -> int | None:
    """The smallest captured batch size >= ``bs`` (``captured`` sorted ascending), or None
    when ``bs`` is larger than every captured size (the caller then runs eagerly)."""
    for size in captured:
        if size >= bs:
            return int(size)
    return None


# ----------------------------------------------------------------------------------------------
# --speculative-ddtree-debug-metrics
# ----------------------------------------------------------------------------------------------


class DDTreeDebugMetrics:
    """Per-round DDTREE counters: the accepted-depth histogram (both pins, from the accept
    lengths the round already has on the host) and, where a worker measures them, tree sizes
    and tree-build times. Logged every ``log_interval`` rounds and reported in
    ``/get_server_info`` by the worker (``snapshot()``)."""

    def __init__(self, max_depth: int, budget: int, log_interval: int = 200):
        self.max_depth = int(max_depth)
        self.budget = int(budget)
        self.log_interval = int(log_interval)
        self.rounds = 0
        self.requests = 0
        self.accepted_depth_hist = [0] * (self.max_depth + 1)
        self.measured_rounds = 0
        self.tree_nodes = 0
        self.tree_build_ms = 0.0

    def record(self, accepted, tree_nodes: int | None = None, build_ms: float | None = None) -> bool:
        """Count one round: ``accepted`` draft tokens per request (clamped to 0..max_depth),
        optionally the valid tree nodes of the batch and the tree-build milliseconds. Returns
        whether this round is one to log."""
        self.rounds += 1
        self.requests += len(accepted)
        for depth in accepted:
            self.accepted_depth_hist[min(max(int(depth), 0), self.max_depth)] += 1
        if tree_nodes is not None:
            self.measured_rounds += 1
            self.tree_nodes += int(tree_nodes)
            self.tree_build_ms += float(build_ms or 0.0)
        return self.rounds % self.log_interval == 0

    def snapshot(self) -> dict:
        reqs = max(self.requests, 1)
        out = {
            "rounds": self.rounds,
            "tree_size": self.budget,
            "avg_accepted_depth": sum(d * c for d, c in enumerate(self.accepted_depth_hist)) / reqs,
            "accepted_depth_hist": list(self.accepted_depth_hist),
        }
        if self.measured_rounds:
            out["avg_tree_size"] = self.tree_nodes / reqs
            out["avg_tree_build_ms"] = self.tree_build_ms / self.measured_rounds
        return out


class WorkerShape(NamedTuple):
    """A DDTREE worker's sizes, from the resolved server args (both pins' workers)."""

    num_verify_tokens: int  # N = budget + 1
    budget: int
    max_depth: int  # D = min(budget, block - 1): the deepest acceptable path
    topk: int  # per-depth draft candidates: the top-k cap, at most the budget and the vocab
    verify_topk: int  # speculative_eagle_topk (> 1: the backends' tree paths)
    debug_metrics: DDTreeDebugMetrics | None  # --speculative-ddtree-debug-metrics


def worker_shape(server_args, block_size: int, page_size: int, vocab_size: int) -> WorkerShape:
    """The sizes a DDTREE worker runs with; ValueError if the server args were not resolved by
    :func:`resolve_ddtree_server_args` (verify width != budget + 1) or the page size is not 1."""
    n = int(server_args.speculative_num_draft_tokens)
    budget = int(server_args.speculative_ddtree_budget or n - 1)
    if budget + 1 != n:
        raise ValueError(
            "DDTREE expects speculative_num_draft_tokens == budget + 1, got "
            f"{n} and budget={budget}."
        )
    if page_size != 1:
        raise ValueError(f"DDTREE requires page_size == 1, got {page_size}.")
    max_depth = min(budget, int(block_size) - 1)
    topk = max(1, min(int(server_args.speculative_ddtree_topk_cap or budget), budget, int(vocab_size)))
    metrics = (
        DDTreeDebugMetrics(max_depth, budget) if server_args.speculative_ddtree_debug_metrics else None
    )
    return WorkerShape(
        n, budget, max_depth, topk, max(2, int(server_args.speculative_eagle_topk or 2)), metrics
    )
