"""DDTree core, the module both pins import: draft top-k, exact draft-tree construction, tree
compilation, the greedy tree walk, target sampling, the sync-free round pieces, tree-verify attention.

Depends only on torch and the standard library; Triton, which every CUDA build of torch
installs, is imported when present, and then the sibling module ``ddtree_triton`` (the kernels
this module launches). Shipped verbatim into SGLang as ``sglang/srt/speculative/ddtree_utils.py``,
with ``ddtree_triton.py`` next to it. The DDTREE serving rules both pins call (server args,
request refusals, serving limits, debug metrics) are in ``ddtree_serving``; the oracles the tests
check this module against (the paper's heap builder, the dense sampling reference, ...) are in
``ddtree_reference``, which is never shipped.

Vocabulary used throughout (shapes are documented per function):

* ``bs`` requests, ``L`` draft positions (block_size - 1), ``K`` top-k per position, ``V`` vocab.
* ``B`` = budget = number of draft nodes; ``N = B + 1`` verify tokens per request.
* A *verify index* is a node's row inside a request's verify block: 0 is the root (the bonus
  token from the previous round), draft node ``j`` (0-based, in output order) has index ``j + 1``.
* A *prefix* is a path ``(r_1, ..., r_d)`` of per-depth ranks into the top-k lists; its token at
  depth ``i`` is ``topk_ids[:, i-1, r_i]`` and its score is ``log q(prefix)``, accumulated in
  float32 left to right: ``s_1 = lp[0, r_1]``, ``s_i = s_{i-1} + lp[i-1, r_i]``.

Tie rule (both builders follow it bit for bit): prefixes are ordered by

    (score descending, depth ascending, rank tuple lexicographically ascending)

and the tree is the first ``B`` prefixes in that order whose score is finite; output nodes are
listed in that order. Ancestors always precede descendants (an ancestor's score is >= and its
depth is smaller), also when probabilities are exactly 1. Zero-probability prefixes (score
``-inf``) do not exist: the corresponding output slots have ``node_valid = False``.

Performance notes (H200 and CPU numbers in BENCHMARKS.md): on CUDA, :func:`build_tree` and
:func:`compile_tree` run one fused Triton kernel each (one program per request; about 0.08 ms
for both at bs = 32, B = 64 when replayed from a CUDA graph, 0.2-0.5 ms eager) and
:func:`draft_topk_logprobs` computes its normaliser with one Triton kernel after ``torch.topk``.
Triton ships with CUDA builds of torch and is imported optionally: without it, or with
``backend="torch"``, the same results come from plain torch ops (which want a CUDA graph: eager
dispatch costs 2-5 ms a call). On the CPU ``ddtree_reference.build_tree_reference`` is the faster
builder.
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "accept_plan",
    "accept_tree_greedy",
    "AcceptPlan",
    "build_tree",
    "compile_tree",
    "CompiledTree",
    "DDTree",
    "draft_topk_logprobs",
    "kv_move_locs",
    "kv_path_locs",
    "kv_rows",
    "KVRows",
    "merge_shard_topk",
    "move_kv_rows",
    "restore_true_mask",
    "sample_from_logits",
    "sample_tree_targets",
    "sample_tree_targets_from_batch",
    "shard_topk_stats",
    "tree_arrays_from_parents",
    "tree_commit_layout",
    "tree_custom_mask",
    "tree_custom_mask_index",
    "tree_verify_attention",
    "tree_verify_rows",
    "tree_verify_splits",
    "verify_greedy_reference",
    "verify_slots",
]

_NEG_INF = float("-inf")
_LOW32 = 0xFFFFFFFF
_MAG31 = 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------
# Draft top-k with full-vocabulary log-probabilities
# ----------------------------------------------------------------------------------------------


_SUMEXP = None


def _fused_sumexp(x: Tensor, shift: Tensor) -> Tensor:
    """``sum(exp(x - shift))`` in float32 as one fused kernel (torch.compile; compiled once)."""
    global _SUMEXP
    if _SUMEXP is None:

        def sumexp(v: Tensor, s: Tensor) -> Tensor:
            return torch.exp(v.float() - s).sum(dim=-1, keepdim=True)

        _SUMEXP = torch.compile(sumexp, dynamic=True)
    return _SUMEXP(x, shift)


def _chunked_logsumexp(
    logits: Tensor,
    chunk_size: int,
    peak: Tensor | None = None,
    fused: bool = False,
    kernel: bool = False,
) -> Tensor:
    """float32 logsumexp over the last dim, reading ``chunk_size`` columns at a time.

    ``peak`` (``[..., 1]``, e.g. the top-1 logit from a top-k) is the shift; without it the row
    maximum is computed. Temporaries stay at ``rows * chunk_size`` float32. Rows of all ``-inf``
    give ``-inf``; NaN propagates; ``+inf`` gives ``+inf``.
    """
    if peak is None:
        peak = logits.amax(dim=-1, keepdim=True)
    peak = peak.float()
    shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    if fused:
        return (shift + _fused_sumexp(logits, shift).log_()).squeeze(-1)
    if kernel and logits.numel():
        return _logsumexp_triton(logits, shift)
    total = None
    for start in range(0, logits.shape[-1], chunk_size):
        part = (
            (logits[..., start : start + chunk_size] - shift)
            .exp_()
            .sum(dim=-1, keepdim=True)
        )
        total = part if total is None else total.add_(part)
    assert total is not None
    return (shift + total.log_()).squeeze(-1)


def _check_lse(lse: Tensor) -> None:
    """Raise ValueError when a row's normaliser is NaN or +inf (NaN / +inf logits). Host sync."""
    bad = ~(lse < math.inf) & ~(lse == _NEG_INF)
    if bool(bad.any()):
        rows = bad.reshape(-1).nonzero()[:3].flatten().tolist()
        raise ValueError(
            f"draft logits contain NaN or +inf (flat rows {rows}); cannot build a tree"
        )


def _logp_from(vals: Tensor, lse: Tensor) -> Tensor:
    """log-probabilities ``vals - lse`` with -inf rows kept at -inf and -0.0 normalised to +0.0."""
    logp = vals.float() - lse.unsqueeze(-1)
    logp = torch.where(
        torch.isneginf(vals) | torch.isneginf(lse).unsqueeze(-1), _NEG_INF, logp
    )
    return logp.clamp_max(0.0) + 0.0


def draft_topk_logprobs(
    logits: Tensor,
    k: int,
    *,
    chunk_size: int = 32768,
    validate: bool = True,
    fused: bool = False,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Per-position top-k token ids and log-probabilities under the full-vocabulary log-softmax.

    Args:
        logits: ``[bs, L, V]`` any float dtype (not modified).
        k: requested top-k; the result has ``K = min(k, V)`` columns.
        chunk_size: vocabulary columns per logsumexp pass (bounds temporaries).
        validate: raise ``ValueError`` on NaN/+inf logits (one host sync); pass False inside
            CUDA graphs.
        fused: compute the normaliser with a torch.compile-generated kernel that reads the
            logits once (needs a working torch.compile backend; overrides ``backend``).
        backend: how the normaliser is computed after ``torch.topk``: ``"auto"`` = the
            Triton kernel on CUDA (one read of the logits, no torch.compile), else chunked
            torch ops; ``"torch"``: chunked torch ops; ``"triton"``: the kernel (CUDA, or the
            CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``(topk_logp [bs, L, K] float32 sorted descending, topk_ids [bs, L, K] int64)``.
        Rows whose logits are all ``-inf`` get ``-inf`` log-probabilities.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [bs, L, V], got shape {tuple(logits.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    vocab = logits.shape[-1]
    kk = min(k, vocab)
    if logits.numel() == 0:
        shape = (*logits.shape[:2], kk)
        return (
            torch.empty(shape, dtype=torch.float32, device=logits.device),
            torch.empty(shape, dtype=torch.int64, device=logits.device),
        )
    vals, ids = torch.topk(logits, kk, dim=-1, largest=True, sorted=True)
    kernel = not fused and _triton_ok(logits.device, backend)
    lse = _chunked_logsumexp(
        logits, chunk_size, vals[..., :1], fused=fused, kernel=kernel
    )
    if validate:
        _check_lse(lse)
    return _logp_from(vals, lse), ids


def shard_topk_stats(
    logits_shard: Tensor, k: int, vocab_offset: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One tensor-parallel rank's share: raw top-k logits, global ids and the shard's logsumexp.

    Args:
        logits_shard: ``[bs, L, V_s]`` this rank's vocabulary columns.
        k: requested top-k (``K = min(k, V_s)``; stack shards padded to a common K with -inf).
        vocab_offset: global id of the shard's first column.

    Returns:
        ``(vals [bs, L, K] float32, ids [bs, L, K] int64 global, lse [bs, L] float32)``.
    """
    kk = min(k, logits_shard.shape[-1])
    vals, ids = torch.topk(logits_shard, kk, dim=-1, largest=True, sorted=True)
    lse = _chunked_logsumexp(logits_shard, 32768, vals[..., :1])
    return vals.float(), ids + vocab_offset, lse


def merge_shard_topk(
    vals: Tensor, ids: Tensor, lse: Tensor, k: int, *, validate: bool = True
) -> tuple[Tensor, Tensor]:
    """Merge stacked per-shard statistics into the full-vocabulary top-k log-probabilities.

    Args:
        vals, ids: ``[S, bs, L, K_s]`` from :func:`shard_topk_stats` (e.g. after all_gather).
        lse: ``[S, bs, L]``.
        k: requested top-k; the result has ``min(k, S * K_s)`` columns.

    Returns the same as :func:`draft_topk_logprobs` on the concatenated vocabulary (up to the
    order of exactly tied logits).
    """
    shards, bs, positions, ks = vals.shape
    total = _chunked_logsumexp(lse.permute(1, 2, 0), max(shards, 1))
    if validate and total.numel():
        _check_lse(total)
    flat_vals = vals.permute(1, 2, 0, 3).reshape(bs, positions, shards * ks)
    flat_ids = ids.permute(1, 2, 0, 3).reshape(bs, positions, shards * ks)
    kk = min(k, shards * ks)
    top, where = torch.topk(flat_vals, kk, dim=-1, largest=True, sorted=True)
    return _logp_from(top, total), flat_ids.gather(-1, where)


# ----------------------------------------------------------------------------------------------
# Tree construction
# ----------------------------------------------------------------------------------------------


class DDTree(NamedTuple):
    """A draft tree per request. Node ``j`` (0..B-1) is verify index ``j + 1``; index 0 = root."""

    tokens: Tensor  # [bs, B] int64 (0 for nonexistent nodes)
    parents: Tensor  # [bs, B] int64 verify index of the parent (0 = root); parents[b, j] <= j
    depth: Tensor  # [bs, B] int64 in 1..L (1 for nonexistent nodes)
    score: Tensor  # [bs, B] float32 log q(prefix); -inf for nonexistent nodes
    node_valid: Tensor  # [bs, B] bool


def _effective_k(topk_logp: Tensor, budget: int, topk_cap: int | None) -> int:
    """Ranks >= B can never be selected (their B lower-ranked siblings come first)."""
    kk = min(topk_logp.shape[-1], budget)
    if topk_cap is not None:
        if topk_cap < 1:
            raise ValueError(f"topk_cap must be >= 1, got {topk_cap}")
        kk = min(kk, topk_cap)
    return kk


def _check_tree_inputs(topk_logp: Tensor, topk_ids: Tensor, budget: int) -> None:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if topk_logp.dim() != 3 or topk_ids.shape != topk_logp.shape:
        raise ValueError(
            f"topk_logp and topk_ids must both be [bs, L, K]; got {tuple(topk_logp.shape)} "
            f"and {tuple(topk_ids.shape)}"
        )
    if topk_logp.shape[1] < 1 or topk_logp.shape[2] < 1:
        raise ValueError(f"need L >= 1 and K >= 1, got shape {tuple(topk_logp.shape)}")


def _empty_tree(bs: int, budget: int, device: torch.device) -> DDTree:
    zeros = torch.zeros(bs, budget, dtype=torch.int64, device=device)
    return DDTree(
        tokens=zeros,
        parents=zeros.clone(),
        depth=torch.ones_like(zeros),
        score=torch.full((bs, budget), _NEG_INF, dtype=torch.float32, device=device),
        node_valid=torch.zeros(bs, budget, dtype=torch.bool, device=device),
    )


def _high_words(keys: Tensor) -> Tensor:
    """Strided int32 view of the high 32 bits of a contiguous int64 tensor (little-endian).

    Writing the magnitude bits of a non-positive float32 score there and keeping a tie index
    (< 2**31) in the low word makes ascending int64 order = (score descending, tie ascending):
    for non-positive floats (and -inf) the magnitude bits grow as the value falls.
    """
    pairs = keys.view(torch.int32).view(*keys.shape, 2)
    return pairs[..., 1 if sys.byteorder == "little" else 0]


# Per-depth selection kernel: "topk" | "sort" | "threshold" give identical results; "auto"
# picks by candidate width (H200, CUDA graph replay: a full sort wins at 4096 candidates per
# request, topk at 256 and at >= 16384; see BENCHMARKS.md).
_BEAM_SELECT = "auto"


def _select_lexicographic(
    cand: Tensor, keys: Tensor, high: Tensor, budget: int, out: Tensor, scratch: Tensor
) -> None:
    """Write into ``out [bs, B]`` the flat indices of the first B candidates in the order
    (score desc, flat index asc), sorted ascending by flat index. ``keys`` holds the flat index
    in its low words; ``high`` is the view of its high words."""
    method = _BEAM_SELECT
    if method == "auto":
        method = "sort" if 1024 <= cand.shape[1] <= 4096 else "topk"
    if method == "threshold":
        # B-th largest score t; take every score > t and the first (B - #greater) equal to t
        t = torch.topk(cand, budget, dim=1, sorted=False).values.amin(
            dim=1, keepdim=True
        )
        above = cand > t
        tied = cand == t
        room = budget - above.sum(dim=1, keepdim=True)
        take = above | (tied & (tied.cumsum(dim=1) <= room))
        dest = torch.where(take, take.cumsum(dim=1) - 1, budget)
        full = torch.empty(
            cand.shape[0], budget + 1, dtype=torch.int64, device=cand.device
        )
        full.scatter_(1, dest, keys)  # keys still hold the bare flat index here
        out.copy_(full[:, :budget])
        return
    torch.bitwise_and(
        cand.view(torch.int32), _MAG31, out=high
    )  # high words: score order
    if method == "sort":
        chosen = torch.sort(keys, dim=1).values[:, :budget]
    else:
        chosen = torch.topk(keys, budget, dim=1, largest=False, sorted=False).values
    torch.sort(chosen & _LOW32, dim=1, out=(out, scratch))


def build_tree(
    topk_logp: Tensor,
    topk_ids: Tensor,
    budget: int,
    *,
    valid: Tensor | None = None,
    topk_cap: int | None = None,
    backend: str = "auto",
) -> DDTree:
    """Batched exact DDTree: identical output to ``ddtree_reference.build_tree_reference``.

    No host synchronisation and fixed shapes (all loops run over the static L), so it can be
    captured in a CUDA graph. Inputs as in ``ddtree_reference.build_tree_reference`` (not validated here:
    NaN or positive log-probabilities give an unspecified tree). Output on the inputs' device.

    Method: a per-depth beam of width B, each beam kept in lexicographic rank-tuple order, then
    a global top-B over the union of the beams.

    Exactness proof. Let T be the first B finite prefixes in the tie order (score desc, depth
    asc, ranks lex asc). (i) T is prefix-closed: an ancestor has score >= (log-probs <= 0 and
    float32 rounding is monotone) and smaller depth, so it precedes its descendants. (ii) Claim:
    every u in T with depth d lies in beam_d. Depth 1: beam_1 holds the top-B depth-1 prefixes
    in the tie order restricted to depth 1, and fewer than B prefixes of any depth precede u.
    Step d > 1: u's parent p is in T by (i), hence in beam_{d-1} by induction, so u is a
    candidate at depth d. Candidates are ranked by (score desc, flat index asc) where the flat
    index p_pos * K + r follows the lexicographic order of rank tuples, because beam_{d-1} is
    stored in that order and a child's rank tuple is its parent's plus r. This is the tie order
    restricted to depth d; fewer than B depth-d prefixes precede u overall, so fewer than B
    candidates do, and u is kept. (iii) Hence T is contained in the union of the beams, which
    is a subset of all prefixes, so T is the top-B of the union in the same order; the final
    top-B ranks by (score desc, depth asc, beam position asc) = the tie order. Scores are the
    same float32 left-to-right sums as in the heap, so both builders agree bit for bit.
    Ranks >= B never matter (B siblings of lower rank precede them), so K is capped at B.

    ``backend``: ``"auto"`` runs the fused Triton kernel (one program per request, one launch;
    the pruned-grid proof is above ``ddtree_build_kernel`` in ddtree_triton.py) for CUDA inputs
    when Triton imports and the
    per-program sorts fit, else the torch ops below; ``"torch"`` forces the torch ops;
    ``"triton"`` forces the kernel (also on the CPU when ``TRITON_INTERPRET=1``). The kernel's
    pruned-grid table is created on first use: make one call before CUDA-graph capture.
    """
    _check_tree_inputs(topk_logp, topk_ids, budget)
    bs, depth_limit, _ = topk_logp.shape
    device = topk_logp.device
    if bs == 0:
        return _empty_tree(0, budget, device)
    kk = _effective_k(topk_logp, budget, topk_cap)
    lp = topk_logp[:, :, :kk].float() + 0.0
    if valid is not None:
        lp = torch.where(
            valid.to(device=device, dtype=torch.bool).view(bs, 1, 1), lp, _NEG_INF
        )
    ids = topk_ids[:, :, :kk].to(torch.int64)
    if _triton_ok(device, backend):
        tree = _build_tree_triton(lp.contiguous(), ids.contiguous(), budget)
        if tree is not None:
            return tree

    # depth 1: ranks 0..kk-1 are already in lexicographic (= rank) order; pad the beam to B.
    # Beams live in [L, bs, B] buffers: scores, and flat candidate index parent_pos * kk + rank.
    scores = torch.full((depth_limit, bs, budget), _NEG_INF, device=device)
    scores[0, :, :kk] = lp[:, 0, :]
    flats = torch.empty(depth_limit, bs, budget, dtype=torch.int64, device=device)
    flats[0] = torch.arange(budget, device=device)
    keys = torch.arange(budget * kk, device=device).repeat(
        bs, 1
    )  # low word: flat index
    high = _high_words(keys)
    scratch = torch.empty(bs, budget, dtype=torch.int64, device=device)
    for d in range(1, depth_limit):
        cand = (scores[d - 1].unsqueeze(2) + lp[:, d, :].unsqueeze(1)).view(bs, -1)
        _select_lexicographic(cand, keys, high, budget, flats[d], scratch)
        torch.gather(cand, 1, flats[d], out=scores[d])

    # global top-B over the union: key = (score desc, depth asc, lexicographic position asc)
    all_score = scores.transpose(0, 1).reshape(bs, depth_limit * budget)
    gkeys = torch.arange(depth_limit * budget, device=device).repeat(bs, 1)
    torch.bitwise_and(all_score.view(torch.int32), _MAG31, out=_high_words(gkeys))
    slot = torch.topk(gkeys, budget, dim=1, largest=False, sorted=True).values & _LOW32
    node_score = all_score.gather(1, slot)
    node_valid = node_score != _NEG_INF
    node_depth0 = slot // budget
    flat = flats.transpose(0, 1).reshape(bs, depth_limit * budget).gather(1, slot)
    rank = torch.where(node_depth0 > 0, flat % kk, flat)
    token = ids.reshape(bs, -1).gather(
        1, (node_depth0 * kk + rank).clamp_max(depth_limit * kk - 1)
    )

    # verify index of every beam slot that became a node (0 = not a node / the root)
    verify_of_slot = torch.zeros(
        bs, depth_limit * budget + 1, dtype=torch.int64, device=device
    )
    verify_of_slot.scatter_(
        1, slot, torch.arange(1, budget + 1, device=device).expand(bs, budget)
    )
    parent_slot = torch.where(
        node_depth0 > 0, (node_depth0 - 1) * budget + flat // kk, depth_limit * budget
    )
    parent = verify_of_slot.gather(1, parent_slot)

    zero = torch.zeros_like(token)
    return DDTree(
        tokens=torch.where(node_valid, token, zero),
        parents=torch.where(node_valid, parent, zero),
        depth=torch.where(node_valid, node_depth0 + 1, zero + 1),
        score=torch.where(node_valid, node_score, _NEG_INF),
        node_valid=node_valid,
    )


# ----------------------------------------------------------------------------------------------
# Fused Triton kernels for build_tree / compile_tree (optional: used on CUDA when Triton imports;
# the kernels and the pruned-grid proof of the beam step are in ddtree_triton.py)
# ----------------------------------------------------------------------------------------------

try:  # Triton ships with CUDA builds of torch; without it the torch builders are used.
    import triton
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
if triton is None:  # pragma: no cover
    ddtree_triton = None
elif __package__:  # shipped: sglang.srt.speculative.ddtree_triton
    from . import ddtree_triton
else:  # the repository's top-level module
    import ddtree_triton

# Largest per-program sort (elements) the kernels are launched with, and the compile kernel's
# widest ancestor table (tree depth bound + 1); beyond them the torch ops run.
_TRITON_MAX_SORT = 16384
_TRITON_MAX_DEPTH_TABLE = 64
_PRUNED_GRID: dict = {}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pruned_grid(budget: int, kk: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Cells (j, r) with (j + 1) * (r + 1) <= B, j < B, r < kk: two int32 tensors (cached,
    created on first use: call once outside CUDA-graph capture)."""
    key = (budget, kk, str(device))
    if key not in _PRUNED_GRID:
        js, rs = [], []
        for j in range(budget):
            for r in range(min(kk, budget // (j + 1))):
                js.append(j)
                rs.append(r)
        _PRUNED_GRID[key] = (
            torch.tensor(js, dtype=torch.int32, device=device),
            torch.tensor(rs, dtype=torch.int32, device=device),
        )
    return _PRUNED_GRID[key]


def _num_warps(elements: int) -> int:
    return 4 if elements <= 1024 else (8 if elements <= 4096 else 16)


def _logsumexp_triton(logits: Tensor, shift: Tensor) -> Tensor:
    """float32 ``shift + log(sum(exp(logits - shift)))`` over the last dim: one Triton kernel
    reads the logits once (a grid of rows x vocabulary chunks), then the chunk sums are added.
    ``logits [..., V]``, ``shift [..., 1]`` f32 (finite)."""
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    chunk = min(8192, _pow2(vocab))
    nc = triton.cdiv(vocab, chunk)
    part = torch.empty(rows, nc, dtype=torch.float32, device=logits.device)
    flat_shift = shift.reshape(rows).contiguous()
    ddtree_triton.sumexp_partial_kernel[(rows, nc)](
        x, flat_shift, part, vocab, x.stride(0), nc, CHUNK=chunk, num_warps=8
    )
    return (flat_shift + part.sum(dim=1).log_()).view(logits.shape[:-1])


def _triton_ok(device: torch.device, backend: str) -> bool:
    """Whether to run the fused kernels: ``auto`` on CUDA tensors; ``triton`` also on any
    device under ``TRITON_INTERPRET=1`` (Triton's interpreter, used by the CPU tests)."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return triton is not None and device.type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is None or not (device.type == "cuda" or interpreted):
        raise RuntimeError(
            "backend='triton' needs Triton and a CUDA tensor (or TRITON_INTERPRET=1)"
        )
    return True


def _build_tree_triton(lp: Tensor, ids: Tensor, budget: int) -> DDTree | None:
    """The fused kernel; ``lp [bs, L, kk]`` f32 contiguous (invalid rows already -inf, -0.0
    normalised), ``ids [bs, L, kk]`` int64. None when the sizes exceed what it is launched with."""
    bs, depth_limit, kk = lp.shape
    # block sizes >= 2: no single-element blocks (padding lanes are masked)
    bb, lb = max(2, _pow2(budget)), max(2, _pow2(depth_limit))
    pj, pr = _pruned_grid(budget, kk, lp.device)
    pb = max(2, _pow2(pj.numel()))
    if max(lb * bb, pb) > _TRITON_MAX_SORT:
        return None
    device = lp.device
    wsf = torch.empty(bs, (depth_limit + 1) * bb, dtype=torch.float32, device=device)
    wsi = torch.empty(
        bs, 2 * depth_limit * bb + 2 * bb + lb * bb, dtype=torch.int32, device=device
    )
    wsk = torch.empty(bs, lb * bb, dtype=torch.int64, device=device)
    tokens = torch.empty(bs, budget, dtype=torch.int64, device=device)
    parents = torch.empty_like(tokens)
    depth = torch.empty_like(tokens)
    score = torch.empty(bs, budget, dtype=torch.float32, device=device)
    valid = torch.empty(bs, budget, dtype=torch.int8, device=device)
    ddtree_triton.ddtree_build_kernel[(bs,)](
        lp, ids, pj, pr, wsf, wsi, wsk, tokens, parents, depth, score, valid,
        depth_limit, kk, budget, pj.numel(),
        BB=bb, LB=lb, PB=pb, LOGK=kk.bit_length(),
        num_warps=_num_warps(max(lb * bb, pb)),
    )  # fmt: skip
    return DDTree(tokens, parents, depth, score, valid.view(torch.bool))


def _compile_tree_triton(
    tree: DDTree, bonus: Tensor, seq_lens: Tensor, bound: int
) -> tuple[Tensor, ...] | None:
    """The fused compile kernel: (tokens, positions, parents, depth, next_token, next_sibling,
    tree_mask), all ``[bs, N]`` / ``[bs, N, N]``; None when the depth bound is too large."""
    bs, budget = tree.tokens.shape
    n = budget + 1
    nb, db = max(2, _pow2(n)), max(2, _pow2(bound + 1))
    if db > _TRITON_MAX_DEPTH_TABLE or nb * db > _TRITON_MAX_SORT * 4:
        return None
    device = tree.tokens.device
    outs = [torch.empty(bs, n, dtype=torch.int64, device=device) for _ in range(6)]
    mask = torch.empty(bs, n, n, dtype=torch.int8, device=device)
    ws = torch.empty(bs, 3 * nb + nb * db, dtype=torch.int32, device=device)
    rows = max(
        1, min(nb, 8192 // nb)
    )  # mask rows per tile: tiles of about 8192 entries
    ddtree_triton.ddtree_compile_kernel[(bs,)](
        tree.tokens.to(torch.int64).contiguous(),
        tree.parents.to(torch.int64).contiguous(),
        tree.depth.to(torch.int64).contiguous(),
        tree.node_valid.contiguous().view(torch.int8),  # bool -> int8 without a copy
        bonus.reshape(bs).to(device=device, dtype=torch.int64).contiguous(),
        seq_lens.reshape(bs).to(device=device, dtype=torch.int64).contiguous(),
        ws, *outs, mask, budget, bound,
        NB=nb, DB=db, RB=rows, num_warps=_num_warps(nb * max(db, rows)),
    )  # fmt: skip
    return (*outs, mask.view(torch.bool))


# ----------------------------------------------------------------------------------------------
# Tree compilation for SGLang's TARGET_VERIFY
# ----------------------------------------------------------------------------------------------


class CompiledTree(NamedTuple):
    """Verify inputs in SGLang's layout; ``N = B + 1`` tokens per request, root first."""

    draft_tokens: Tensor  # [bs*N] int64
    positions: Tensor  # [bs*N] int64 = seq_lens[b] + depth
    custom_mask: Tensor  # flat bool, sum_b N*(seq_lens[b]+N) (empty if not built)
    retrieve_index: Tensor  # [bs, N] int64 = b*N + i
    retrieve_next_token: Tensor  # [bs, N] int64 first child's verify index or -1
    retrieve_next_sibling: Tensor  # [bs, N] int64 next sibling's verify index or -1
    parents: Tensor  # [bs, N] int64, -1 for the root
    depth: Tensor  # [bs, N] int64
    tree_mask: Tensor  # [bs, N, N] bool ancestor-or-self


def tree_arrays_from_parents(
    parents_full: Tensor, node_valid_full: Tensor, max_depth: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Ancestor-or-self mask and first-child / next-sibling arrays from parent pointers.

    Args:
        parents_full: ``[bs, N]`` int64 parent verify index, -1 for the root; parents precede
            children.
        node_valid_full: ``[bs, N]`` bool; invalid nodes are left out of the child/sibling lists
            (unreachable by a walk) and only see the root and themselves.
        max_depth: an upper bound on the tree depth (L), for pointer jumping.

    Returns ``(tree_mask [bs,N,N] bool, next_token [bs,N] int64, next_sibling [bs,N] int64)``.
    Children of a node are listed in verify-index order. No host sync.
    """
    bs, n = parents_full.shape
    device = parents_full.device
    idx = torch.arange(n, device=device)
    up = parents_full.clamp_min(0)
    mask = (idx.view(1, n, 1) == idx.view(1, 1, n)).expand(bs, n, n).clone()
    reach = 1
    while reach < max_depth + 1:  # mask[i] = ancestors within distance < 2*reach
        mask |= mask.gather(1, up.unsqueeze(2).expand(bs, n, n))
        up = up.gather(1, up)
        reach *= 2
    mask[:, :, 0] = True

    live = node_valid_full.clone()
    live[:, 0] = False  # the root is nobody's child
    big = n
    # first child: the smallest verify index among a node's live children
    child_par = torch.where(live, parents_full, torch.full_like(parents_full, n))
    first = torch.full((bs, n + 1), big, dtype=torch.int64, device=device)
    first.scatter_reduce_(
        1, child_par, idx.expand(bs, n), reduce="amin", include_self=True
    )
    next_token = first[:, :n]
    next_token = torch.where(next_token == big, -1, next_token)
    # next sibling: sort by (parent, index); consecutive entries with the same parent are siblings
    order = torch.sort(child_par * (n + 1) + idx, dim=1).values
    sorted_par, sorted_idx = order // (n + 1), order % (n + 1)
    same = (sorted_par[:, 1:] == sorted_par[:, :-1]) & (sorted_par[:, 1:] < n)
    nxt = torch.where(same, sorted_idx[:, 1:], -1)
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, sorted_idx[:, :-1], nxt)
    next_sibling = torch.where(live, next_sibling, -1)
    return mask, next_token, next_sibling


def tree_custom_mask(tree_mask: Tensor, seq_lens: Tensor | list[int]) -> Tensor:
    """SGLang's flat FULL custom mask: per request N rows of ``[True]*seq_len ++ tree_mask row``.

    Args:
        tree_mask: ``[bs, N, N]`` bool ancestor-or-self.
        seq_lens: ``[bs]`` prefix lengths; a list or CPU tensor avoids a host sync (a CUDA tensor
            is copied to the host because the output length depends on it).

    Returns a flat bool tensor of length ``sum_b N * (seq_lens[b] + N)`` on tree_mask's device.
    """
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    lens = seq_lens.tolist() if isinstance(seq_lens, Tensor) else list(seq_lens)
    if len(lens) != bs:
        raise ValueError(f"seq_lens has {len(lens)} entries for {bs} requests")
    if bs == 0:
        return torch.zeros(0, dtype=torch.bool, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    sizes = (lens_t + n) * n
    total = sum((s + n) * n for s in lens)
    out = torch.ones(total, dtype=torch.bool, device=device)
    # only the bs*N*N tree-block entries differ from True: scatter them into place
    offset = (torch.cumsum(sizes, 0) - sizes + lens_t).view(bs, 1, 1)
    i = torch.arange(n, device=device).view(1, n, 1)
    j = torch.arange(n, device=device).view(1, 1, n)
    where = offset + i * (lens_t.view(bs, 1, 1) + n) + j
    out[where.reshape(-1)] = tree_mask.reshape(-1)
    return out


def compile_tree(
    tree: DDTree,
    bonus_tokens: Tensor,
    seq_lens: Tensor,
    *,
    build_custom_mask: bool = True,
    seq_lens_cpu: list[int] | Tensor | None = None,
    max_depth: int | None = None,
    backend: str = "auto",
) -> CompiledTree:
    """Turn a :class:`DDTree` into SGLang verify inputs (see :class:`CompiledTree`).

    Args:
        tree: from :func:`build_tree` (or ``ddtree_reference.build_tree_reference``).
        bonus_tokens: ``[bs]`` the root token per request.
        seq_lens: ``[bs]`` committed length per request (the root's position).
        build_custom_mask: also build the flat FULL mask. Its length depends on ``seq_lens``, so
            this needs them on the host: pass ``seq_lens_cpu`` to avoid a device sync. Without
            it nothing here synchronises and ``custom_mask`` is an empty tensor (build it later
            with :func:`tree_custom_mask`).
        seq_lens_cpu: host copy of ``seq_lens`` for the custom mask.
        max_depth: static bound on the tree depth (L); fewer pointer-jumping steps. Default B.
        backend: as in :func:`build_tree`; the fused kernel needs ``max_depth`` < 64.
    """
    bs, budget = tree.tokens.shape
    n = budget + 1
    device = tree.tokens.device
    bound = budget if max_depth is None else min(max_depth, budget)
    fused = None
    if bs > 0 and _triton_ok(device, backend):
        fused = _compile_tree_triton(tree, bonus_tokens, seq_lens, bound)
    if fused is not None:
        tokens, positions, parents, depth, next_token, next_sibling, tree_mask = fused
    else:
        root = torch.zeros(bs, 1, dtype=torch.int64, device=device)
        tokens = torch.cat(
            [
                bonus_tokens.view(bs, 1).to(device=device, dtype=torch.int64),
                tree.tokens,
            ],
            1,
        )
        depth = torch.cat([root, tree.depth], 1)
        parents = torch.cat([root - 1, tree.parents], 1)
        valid = torch.cat(
            [torch.ones(bs, 1, dtype=torch.bool, device=device), tree.node_valid], 1
        )
        tree_mask, next_token, next_sibling = tree_arrays_from_parents(
            parents, valid, bound
        )
        positions = seq_lens.view(bs, 1).to(device=device, dtype=torch.int64) + depth
    if build_custom_mask:
        custom = tree_custom_mask(
            tree_mask, seq_lens if seq_lens_cpu is None else seq_lens_cpu
        )
    else:
        custom = torch.zeros(0, dtype=torch.bool, device=device)
    return CompiledTree(
        draft_tokens=tokens.reshape(-1),
        positions=positions.reshape(-1),
        custom_mask=custom,
        retrieve_index=torch.arange(bs * n, device=device).view(bs, n),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        parents=parents,
        depth=depth,
        tree_mask=tree_mask,
    )


# ----------------------------------------------------------------------------------------------
# Reference verification (oracle for sgl_kernel, CPU fallback)
# ----------------------------------------------------------------------------------------------


def _walk(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    chosen: Tensor,
    max_accept: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Follow, from the root, the child whose token equals ``chosen[node]`` (sgl_kernel order)."""
    bs, _ = candidates.shape
    device = candidates.device
    cand = candidates.tolist()
    first, sib, pick = next_token.tolist(), next_sibling.tolist(), chosen.tolist()
    rows, lens, bonus = [], [], []
    for b in range(bs):
        cur, path = 0, [0]
        for _ in range(max_accept):
            child = first[b][cur]
            while child != -1 and cand[b][child] != pick[b][cur]:
                child = sib[b][child]
            if child == -1:
                break
            cur = child
            path.append(cur)
        lens.append(len(path) - 1)
        bonus.append(pick[b][cur])
        rows.append(path + [-1] * (max_accept + 1 - len(path)))
    accept_index = torch.tensor(rows, dtype=torch.int64).view(bs, max_accept + 1)
    accept_len = torch.tensor(lens, dtype=torch.int64)
    bonus_t = torch.tensor(bonus, dtype=torch.int64)
    return accept_index.to(device), accept_len.to(device), bonus_t.to(device)


def verify_greedy_reference(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_predict: Tensor,
    max_accept: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree walk, the semantics of ``sgl_kernel.verify_tree_greedy``.

    Args:
        candidates: ``[bs, N]`` verify tokens (root first).
        next_token / next_sibling: ``[bs, N]`` from :func:`compile_tree`.
        target_predict: ``[bs, N]`` int64 target argmax at every node.
        max_accept: the most draft nodes that may be accepted (e.g. L).

    Returns ``(accept_index [bs, max_accept+1] int64 within-request verify indices in path order,
    root first, -1 padded; accept_len [bs] int64 accepted draft nodes; bonus [bs] int64)``.
    """
    return _walk(candidates, next_token, next_sibling, target_predict, max_accept)


# ----------------------------------------------------------------------------------------------
# Target sampling: SGLang's plain sampler, one draw per row, bounded memory, no host sync
# ----------------------------------------------------------------------------------------------
#
# Semantics (SGLang's own sampler with its default joint top-k/top-p rule; see docs/DDTREE.md):
# with s = logits / temperature (float32) and p = softmax(s), token i is kept iff
#
#     #{j : s_j > s_i} < top_k  and  sum{p_j : s_j > s_i} < top_p  and  s_i >= max(s) + log(min_p)
#
# (top_k <= 0 or >= V: no limit; top_p >= 1: no limit, exactly; min_p <= 0: no limit), and the
# sample is drawn from p restricted to the kept tokens, renormalised. Every condition is monotone
# in s_i, so the kept set is {s >= t} for one threshold t per row, and tokens tied at t are all
# kept. Greedy rows (temperature < 1e-6, SGLang's _SAMPLING_EPS, or top_k == 1, which is how
# SGLang stores a greedy request) give the argmax, the lowest index among equal maxima.
#
# Finding t without sorting. Order floats by their "ordered key" (the int32 bit pattern with the
# magnitude bits flipped for negatives, -0.0 normalised to +0.0), so key order is value order.
# Q(v) = #{s > v} < top_k and mass{s > v} < top_p is monotone, t = the smallest token value with
# Q true. The Triton kernel keeps two keys lo < hi with Q(lo) false (or lo below every candidate)
# and Q(hi) true, and each pass over the row evaluates Q at NP keys spread over [lo, hi]
# (count and mass strictly above each), moving lo and hi to the tightest ones; it stops when no
# token lies strictly between lo and hi, and then the kept set is {s >= hi} exactly. The keys
# are spread linearly in value (a flat row's bracket then holds about 15-fold fewer tokens each
# pass), or linearly in key after a value pass that shrank the bracket less than 4-fold (a few
# far outliers): a key pass shrinks hi - lo at least 15-fold, so the search always ends (at most
# about twenty passes; six to eight on random float32 logits). A pass streams the row in BLOCK
# steps: tokens above hi count for every key and were counted by the last pass (hi only moves
# down), tokens below lo count for none, so only steps holding a token in [lo, hi] (all of them
# in the first pass) redo their columns in SBLOCK sub-steps into [NP, SBLOCK] per-column
# partials, reduced once per pass. Once [lo, hi] holds at most about V / 4 tokens, they are
# copied to a buffer and the later passes read that copy instead of the row (a top_p bracket on
# a flat row otherwise touches every BLOCK step for three or four passes); the buffer keeps only
# [lo, hi] again whenever that shrinks four-fold. A launch that may search runs a few programs
# per multiprocessor, each taking the next untaken row until none is left and owning one buffer,
# so the buffer's memory does not grow with the batch. Rows without top-k / top-p skip the
# search (and a launch known to have none compiles it out, with a program per row). Masses are float64 throughout,
# exp(s - max) / sum with the sum taken in the first pass, as the dense reference's softmax:
# the kept set is the float64 rule's, also for a top_p within float32 rounding of a token's
# mass (a float32 logsumexp, as before, misjudged 10 to 13 of the tests' 24 such rows). The torch path
# finds the same set with a 4-level 8-bit radix select on the keys (per-row histograms of count
# and float64 mass).
#
# Sampling: inverse CDF of the kept mass in vocabulary order, float64: the mass of each BLOCK step
# (sum of exp(s - max) over its kept tokens), one 53-bit uniform u per row, the step where the
# running mass first exceeds u times the total, then that step's token where it does. An exact
# draw from the renormalised kept distribution up to float64 rounding of the sums (a kept token
# whose exp(s - max) underflows float64, below exp(-745), is never drawn).

_SAMPLING_EPS = (
    1e-6  # SGLang's sampling_params._SAMPLING_EPS: temperature below it is greedy
)
_SAMPLE_BLOCK = 1024  # vocabulary columns per step of the linear passes (Triton, V >= 1024)
_SAMPLE_SBLOCK = 128  # columns per per-pivot sub-step of a search pass (divides BLOCK; H200 A/B: 128 beats 256)
_SAMPLE_PIVOTS = 16  # keys evaluated per search pass (lo, hi and 14 between)
_SAMPLE_WARPS = 4  # num_warps of the kernel with the search (also tests/triton_aot.py)
_SAMPLE_WARPS_NO_SEARCH = 4  # num_warps of the kernel compiled without it (H200 A/B: 4 beats 8)
_SAMPLE_MAX_PASSES = 48  # guard only: a key pass shrinks hi - lo >= 15-fold, 2**32 keys
_SAMPLE_BUFFER_DIV = 4  # a search copies a row's bracket once it holds <= V / 4 tokens (f32 each)
_SAMPLE_PROGRAMS_PER_SM = 4  # programs of a launch per multiprocessor (each with a buffer; sm_90
#   holds four at 128 registers x 128 threads, three without the cap: 166-168 registers)
_SAMPLE_MAXNREG: int | None = 128  # register cap of the search kernel (spills 32 B; H200 A/B:
#   128 with 4 programs per multiprocessor runs top-p rows in 0.70x the time of no cap with 3)
_TORCH_WORK_ELEMS = 1 << 20  # torch path: rows per chunk = this // V (at least one)


def _per_row(
    v: Tensor | float | None,
    rows: int,
    fill: float,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """``[rows]`` tensor from a scalar, a ``[rows]`` tensor or None (``fill``)."""
    if v is None:
        return torch.full((rows,), fill, dtype=dtype, device=device)
    t = torch.as_tensor(v, device=device).to(dtype)
    if t.dim() == 0:
        return t.expand(rows)
    if t.numel() != rows:
        raise ValueError(
            f"per-row sampling parameter has {t.numel()} values for {rows} rows"
        )
    return t.reshape(rows)


def _sampling_rows(
    rows: int,
    vocab: int,
    device: torch.device,
    temperature: Tensor | float,
    top_k: Tensor | int | None,
    top_p: Tensor | float | None,
    min_p: Tensor | float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Normalised per-row parameters: ``(temp f32 (1 for greedy rows), k i64 in 1..V,
    p f32 (+inf = no top-p), log_min_p f32 (-inf = no min-p), greedy bool)``. No host sync."""
    temp = _per_row(temperature, rows, 1.0, torch.float32, device)
    kk = _per_row(top_k, rows, 0, torch.int64, device)
    pp = _per_row(top_p, rows, 1.0, torch.float32, device)
    mp = _per_row(min_p, rows, 0.0, torch.float32, device)
    greedy = (temp < _SAMPLING_EPS) | (kk == 1)
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    kk = torch.where((kk <= 0) | (kk >= vocab), torch.full_like(kk, vocab), kk)
    pp = torch.where(pp >= 1.0, torch.full_like(pp, math.inf), pp)
    log_mp = torch.where(
        mp > 0, torch.log(mp.clamp_min(1e-38)), torch.full_like(mp, _NEG_INF)
    )
    return temp, kk, pp, log_mp, greedy


def _ordered_keys(s: Tensor) -> Tensor:
    """int32 keys whose order is the float32 order of ``s`` (no NaN; -0.0 already +0.0)."""
    bits = s.view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ _MAG31)


def _from_ordered_keys(keys: Tensor) -> Tensor:
    return torch.where(keys >= 0, keys, keys ^ _MAG31).view(torch.float32)


def _sample_rows_torch(
    x: Tensor,
    temp: Tensor,
    kk: Tensor,
    pp: Tensor,
    log_mp: Tensor,
    greedy: Tensor,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """One chunk of rows: ``x [r, V]`` -> ``(token [r] int64, threshold [r] f32)`` (kept set
    ``s >= threshold``). Radix select (4 levels of 8 bits) for the top-k/top-p threshold, then
    inverse-CDF sampling of the kept mass with one float64 uniform per row."""
    r, vocab = x.shape
    device = x.device
    s = x.float() / temp.view(r, 1)
    s.add_(0.0)  # -0.0 -> +0.0, so key order equals value order
    peak = s.amax(dim=1)
    key = _ordered_keys(s)  # [r, V] int32, signed order = value order
    # float64 softmax as the dense reference's (exp(s - max) / sum): a float32 logsumexp moves
    # every probability by up to ~1e-6 relative, enough to flip rows at a top-p boundary
    prob = (s.double() - peak.double().view(r, 1)).exp_()  # [r, V] float64
    prob.div_(prob.sum(dim=1, keepdim=True))
    base = torch.arange(r, device=device).view(r, 1) * 256
    bins = torch.arange(256, device=device).view(1, 256)
    prefix = torch.zeros(r, 1, dtype=torch.int64, device=device)  # key >> (shift + 8)
    above_n = torch.zeros(r, 1, dtype=torch.float64, device=device)
    above_m = torch.zeros(r, 1, dtype=torch.float64, device=device)
    ones = torch.ones(1, dtype=torch.float64, device=device).expand(r * vocab)
    for shift in (24, 16, 8, 0):
        digit = (key >> shift) & 255
        if shift == 24:
            digit ^= 128  # the top byte is signed: unsigned digit = byte + 128
        idx = digit.to(torch.int64).add_(base)
        del digit
        if shift < 24:  # only the tokens inside the bucket chosen so far
            idx.masked_fill_((key >> (shift + 8)) != prefix, r * 256)
        flat = idx.view(-1)
        if (
            device.type == "cpu"
        ):  # same sums; bincount is faster there (it syncs on CUDA)
            cnt = torch.bincount(flat, minlength=r * 256 + 1).double()
            mass = torch.bincount(flat, prob.view(-1), minlength=r * 256 + 1)
        else:
            cnt = torch.zeros(r * 256 + 1, dtype=torch.float64, device=device)
            cnt.scatter_add_(0, flat, ones)
            mass = torch.zeros(r * 256 + 1, dtype=torch.float64, device=device)
            mass.scatter_add_(0, flat, prob.view(-1))
        del idx, flat
        cnt, mass = cnt[: r * 256].view(r, 256), mass[: r * 256].view(r, 256)
        # strictly above bin b: the bins above it in this bucket plus everything above the bucket
        cnt_above = above_n + (cnt.flip(1).cumsum(1).flip(1) - cnt)
        mass_above = above_m + (mass.flip(1).cumsum(1).flip(1) - mass)
        ok = (
            (cnt > 0)
            & (cnt_above < kk.view(r, 1))
            & (mass_above < pp.double().view(r, 1))
        )
        pick = torch.where(ok, bins, 256).amin(dim=1, keepdim=True).clamp_max(255)
        above_n = cnt_above.gather(1, pick)
        above_m = mass_above.gather(1, pick)
        prefix = prefix * 256 + (pick - 128 if shift == 24 else pick)
    del key
    t_kp = _from_ordered_keys(prefix.view(r).to(torch.int32))
    thr = torch.maximum(t_kp, peak + log_mp)
    empty = greedy | torch.isneginf(peak)
    thr = torch.where(empty, peak, thr)
    # inverse CDF over the kept mass in vocabulary order
    cdf = torch.where(s >= thr.view(r, 1), prob, 0.0)
    del prob
    cdf = cdf.cumsum_(dim=1)
    u = torch.rand(r, 1, dtype=torch.float64, device=device, generator=generator)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).view(r)
    token = torch.where(empty, s.argmax(dim=1), drawn.clamp_max(vocab - 1))
    return token, thr


def _sample_launch_options(search: bool) -> dict:
    """Launch options of the sampling kernel with / without the search: its num_warps and, with
    the search, the register cap (also what tests/triton_aot.py compiles)."""
    if not search:
        return {"num_warps": _SAMPLE_WARPS_NO_SEARCH}
    return {"num_warps": _SAMPLE_WARPS, **({"maxnreg": _SAMPLE_MAXNREG} if _SAMPLE_MAXNREG else {})}


def _sample_programs(device: torch.device) -> int:
    """Programs of one sampling launch (at most one per row): _SAMPLE_PROGRAMS_PER_SM per
    multiprocessor on CUDA (what fits at once at the kernel's registers), else one per row."""
    if device.type != "cuda":
        return 1 << 30
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return _SAMPLE_PROGRAMS_PER_SM * sms


def _sample_buffer_cap(vocab: int, sblock: int) -> int:
    """Columns of the search buffer of one program: about V / _SAMPLE_BUFFER_DIV, whole sub-steps."""
    per = -(-vocab // _SAMPLE_BUFFER_DIV)
    return sblock * -(-per // sblock)


def _sample_blocks(vocab: int) -> tuple[int, int]:
    """``(BLOCK, SBLOCK)`` of the sampling kernel for ``V`` columns: the GPU configuration
    (1024, 128) from V = 1024 on, powers of two just covering V below it (the interpreter tests
    use V = 5..40; there SBLOCK == BLOCK, one level, no band test or re-read per step)."""
    block = min(_SAMPLE_BLOCK, max(16, 1 << (vocab - 1).bit_length()))
    return block, min(_SAMPLE_SBLOCK, block)


def _may_filter(top_k: Tensor | int | None, top_p: Tensor | float | None, vocab: int) -> bool:
    """False when the host already knows that no row has a top-k or top-p limit (None or
    Python numbers meaning "no limit"), so the kernel is compiled without the search."""
    no_k = top_k is None or (
        not isinstance(top_k, Tensor) and (int(top_k) <= 1 or int(top_k) >= vocab)
    )
    no_p = top_p is None or (not isinstance(top_p, Tensor) and float(top_p) >= 1.0)
    return not (no_k and no_p)


def _sample_rows_triton(
    logits: Tensor,
    temp: Tensor,
    kk: Tensor,
    pp: Tensor,
    log_mp: Tensor,
    greedy: Tensor,
    generator: torch.Generator | None,
    search: bool = True,
    buffer_cap: int | None = None,
    programs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The sampling kernel over ``logits`` [R, V]. ``buffer_cap``: columns of the search's
    buffer per program (default :func:`_sample_buffer_cap`; 0: no buffer, every pass reads the
    row). ``programs``: how many programs share the rows (default :func:`_sample_programs`)."""
    rows, vocab = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    device = x.device
    seed = torch.randint(
        0, 1 << 62, (1,), dtype=torch.int64, device=device, generator=generator
    )
    token = torch.empty(rows, dtype=torch.int64, device=device)
    thr = torch.empty(rows, dtype=torch.float32, device=device)
    block, sblock = _sample_blocks(vocab)
    if -(-vocab // sblock) >= 1 << 16:  # a search column's count of #gt + 65536 * #eq
        raise ValueError(f"vocabulary {vocab} too large for the sampling kernel")
    cap = 0 if not search else _sample_buffer_cap(vocab, sblock) if buffer_cap is None else buffer_cap
    # a search buffer per program: a bounded grid; without one, a program per row as usual
    grid = max(1, min(rows, programs or (_sample_programs(device) if cap else rows)))
    buf = torch.empty((grid, cap) if cap else (1,), dtype=torch.float32, device=device)
    ddtree_triton.sample_rows_kernel[(grid,)](
        x, temp.contiguous(), kk.contiguous(), pp.contiguous(), log_mp.contiguous(),
        greedy.to(torch.int8), seed, token, thr, buf,
        torch.zeros(1, dtype=torch.int32, device=device), rows, vocab, x.stride(0),
        BLOCK=block, SBLOCK=sblock, NP=_SAMPLE_PIVOTS,
        MAX_PASSES=_SAMPLE_MAX_PASSES, SEARCH=search, CAP=cap, NS=_pow2(-(-vocab // block)),
        **_sample_launch_options(search),
    )  # fmt: skip
    return token, thr


def _sample_with_threshold(
    logits: Tensor,
    temperature: Tensor | float,
    top_k: Tensor | int | None,
    top_p: Tensor | float | None,
    min_p: Tensor | float | None,
    generator: torch.Generator | None,
    backend: str,
    any_top_k_top_p: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`sample_from_logits` plus each row's threshold in ``s = logits / temperature``
    (the kept set is ``s >= threshold``; for greedy rows the threshold is the maximum)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    rows, vocab = logits.shape
    device = logits.device
    if vocab < 1:
        raise ValueError("logits must have at least one column")
    if generator is not None and generator.device.type != device.type:
        raise ValueError(
            f"generator is on {generator.device}, logits on {device}: they must match"
        )
    params = _sampling_rows(rows, vocab, device, temperature, top_k, top_p, min_p)
    if rows == 0:
        return (
            torch.zeros(0, dtype=torch.int64, device=device),
            torch.zeros(0, dtype=torch.float32, device=device),
        )
    if _triton_ok(device, backend):
        if any_top_k_top_p is None:
            any_top_k_top_p = _may_filter(top_k, top_p, vocab)
        return _sample_rows_triton(logits, *params, generator, any_top_k_top_p)
    step = max(1, _TORCH_WORK_ELEMS // vocab)
    tokens, thrs = [], []
    for start in range(0, rows, step):
        part = slice(start, start + step)
        token, thr = _sample_rows_torch(
            logits[part], *(p[part] for p in params), generator
        )
        tokens.append(token)
        thrs.append(thr)
    return torch.cat(tokens), torch.cat(thrs)


def sample_from_logits(
    logits: Tensor,
    temperature: Tensor | float,
    top_k: Tensor | int | None,
    top_p: Tensor | float | None,
    min_p: Tensor | float | None = None,
    *,
    max_top_k: int | None = None,
    any_top_k_top_p: bool | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> Tensor:
    """One draw per row from SGLang's plain target sampler, without dense probabilities.

    Args:
        logits: ``[R, V]`` float (fp32/bf16/fp16; not modified), after penalties/bias.
        temperature: ``[R]`` float32 (or a float); below 1e-6 (SGLang's ``_SAMPLING_EPS``)
            means greedy.
        top_k: ``[R]`` int (or an int/None); <= 0 or >= V (SGLang's unset 1 << 30) means no
            limit; 1 means greedy (SGLang stores greedy requests as top_k = 1).
        top_p: ``[R]`` float32 (or a float/None) in (0, 1]; >= 1 keeps every token, exactly.
        min_p: ``[R]`` float32 (or a float/None); <= 0 means no limit.
        max_top_k: an optional host-side upper bound on the finite top_k values. Neither backend
            needs it (top-k is a count in the threshold search, whatever its size); accepted so
            callers can pass what they know.
        any_top_k_top_p: False promises that no row has a top-k (2..V-1) or top-p (< 1) limit
            (SGLang: ``not (sampling_info.need_top_k_sampling or need_top_p_sampling)``); the
            Triton kernel is then compiled without the threshold search (min_p still applies).
            None (default): False only when ``top_k`` and ``top_p`` are None or Python numbers
            meaning no limit, else True (the kernel skips the search per row anyway; the
            specialisation only spares the search's registers). A wrong False drops the
            top-k / top-p limits.
        generator: optional ``torch.Generator`` on the logits' device (the Triton kernel draws
            one Philox seed from it per call, the torch path its uniforms).
        backend: ``"auto"`` = one Triton kernel on CUDA (a row at a time per program), else chunked
            torch ops; ``"torch"``; ``"triton"`` (CUDA, or the CPU under TRITON_INTERPRET=1).

    Returns ``[R]`` int64 token ids. Semantics (module comment above and docs/DDTREE.md): keep
    token i iff fewer than top_k tokens have a strictly larger ``s = logits / temperature``, the
    probability mass of the strictly larger tokens is below top_p, and ``p_i >= min_p * p_max``;
    draw from the kept tokens renormalised. Ties at the threshold are all kept; greedy rows
    give the first argmax. No host synchronisation and fixed shapes on either backend (CUDA
    graph capturable; the Triton path allocates ``O(R)`` plus, when it may search, a buffer of
    about V / 4 float32 per program (four programs per multiprocessor: 80 MB on an H200 at
    V = 151936, whatever R), the torch path works on at most
    ``max(1, 2**20 // V)`` rows at a time). Rows whose logits are all -inf give token 0; NaN or
    +inf logits are not supported.
    """
    if max_top_k is not None and max_top_k < 1:
        raise ValueError(f"max_top_k must be >= 1 when given, got {max_top_k}")
    token, _ = _sample_with_threshold(
        logits, temperature, top_k, top_p, min_p, generator, backend, any_top_k_top_p
    )
    return token


def sample_tree_targets(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor | None,
    n_per_req: int,
    *,
    max_top_k: int | None = None,
    any_top_k_top_p: bool | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> Tensor:
    """One target sample per tree node, for the sampling verify.

    Args:
        logits: ``[bs * N, V]`` verify logits, request-major (row ``b * N + i`` = node ``i`` of
            request ``b``), after penalties/bias.
        temperature, top_k, top_p, min_p: ``[bs]`` per-request parameters (SGLang's
            ``sampling_info.temperatures`` (may be ``[bs, 1]``), ``top_ks``, ``top_ps``,
            ``min_ps``); expanded to rows with ``repeat_interleave`` by the static ``N`` (no
            host sync).
        n_per_req: ``N = B + 1`` verify tokens per request.
        any_top_k_top_p: as in :func:`sample_from_logits`.

    Returns ``[bs, N]`` int64: pass it as ``target_predict`` to ``sgl_kernel.verify_tree_greedy``
    (or :func:`verify_greedy_reference`), or as ``samples=`` to
    ``ddtree_reference.verify_sampling_reference``; the walk is then lossless target sampling.
    """
    if n_per_req < 1:
        raise ValueError(f"n_per_req must be >= 1, got {n_per_req}")
    rows = logits.shape[0]
    if rows % n_per_req:
        raise ValueError(
            f"logits has {rows} rows, not a multiple of n_per_req = {n_per_req}"
        )
    bs = rows // n_per_req

    def expand(v: Tensor | None) -> Tensor | None:
        if v is None:
            return None
        v = torch.as_tensor(v, device=logits.device).reshape(-1)
        if v.numel() != bs:
            raise ValueError(
                f"per-request parameter has {v.numel()} values for {bs} requests"
            )
        return v.repeat_interleave(n_per_req)

    token = sample_from_logits(
        logits,
        expand(temperature),
        expand(top_k),
        expand(top_p),
        expand(min_p),
        max_top_k=max_top_k,
        any_top_k_top_p=any_top_k_top_p,
        generator=generator,
        backend=backend,
    )
    return token.view(bs, n_per_req)


def sample_tree_targets_from_batch(logits: Tensor, sampling_info, n_per_req: int) -> Tensor:
    """:func:`sample_tree_targets` with the per-request parameters of an SGLang
    ``SamplingBatchInfo`` (what both pins' sampled verify pass): ``temperatures``, ``top_ks``,
    ``top_ps``, ``min_ps`` only when ``need_min_p_sampling`` (SGLang's own sampler ignores them
    otherwise), and ``any_top_k_top_p`` from ``need_top_k_sampling`` / ``need_top_p_sampling``
    (True when the object lacks them). Returns ``[bs, N]`` int64; greedy requests get each
    node's first argmax."""
    need_min_p = getattr(sampling_info, "need_min_p_sampling", False)
    return sample_tree_targets(
        logits,
        sampling_info.temperatures,
        sampling_info.top_ks,
        sampling_info.top_ps,
        sampling_info.min_ps if need_min_p else None,
        n_per_req,
        any_top_k_top_p=bool(
            getattr(sampling_info, "need_top_k_sampling", True)
            or getattr(sampling_info, "need_top_p_sampling", True)
        ),
    )


# ----------------------------------------------------------------------------------------------
# Accept plan and metrics
# ----------------------------------------------------------------------------------------------


class AcceptPlan(NamedTuple):
    """What to keep after verify. Flat rows are ``b*N + i``."""

    keep_slots: Tensor  # [sum(commit_lens)] int64 KV slots kept, path order per request
    free_mask: Tensor  # [bs*N] bool: slots of out_cache_loc to free
    hidden_index: Tensor  # [sum(commit_lens)] int64 verify hidden rows, path order
    last_node: Tensor  # [bs] int64 last accepted node's within-request verify index
    commit_lens: Tensor  # [bs] int64 = accept_len + 1


def accept_plan(
    accept_index: Tensor,
    accept_len: Tensor,
    out_cache_loc: Tensor,
    *,
    flat_index: bool = False,
) -> AcceptPlan:
    """KV keep/free sets and gather indices from the accepted paths.

    Args:
        accept_index: ``[bs, M]`` accepted verify indices in path order (root first, -1 padded);
            within-request (0..N-1) as returned by the references, or flat ``b*N + i`` (as
            ``sgl_kernel.verify_tree_greedy`` writes with ``retrieve_index``) when
            ``flat_index=True``.
        accept_len: ``[bs]`` accepted draft nodes.
        out_cache_loc: ``[bs*N]`` KV slots of the verify tokens.

    ``keep_slots`` / ``hidden_index`` have a data-dependent length (one host sync).
    """
    bs, width = accept_index.shape
    n = out_cache_loc.numel() // bs if bs else 0
    device = accept_index.device
    idx = accept_index.to(torch.int64)
    commit = accept_len.to(device=device, dtype=torch.int64) + 1
    base = torch.arange(bs, device=device).view(bs, 1) * n
    within = idx - base if flat_index else idx
    flat = within + base
    used = torch.arange(width, device=device).view(1, width) < commit.view(bs, 1)
    rows = flat[used]
    free = torch.ones(bs * n, dtype=torch.bool, device=device)
    free[rows] = False
    last = within.gather(1, (commit - 1).view(bs, 1)).view(bs) if bs else commit.clone()
    return AcceptPlan(
        keep_slots=out_cache_loc.to(device)[rows],
        free_mask=free,
        hidden_index=rows,
        last_node=last,
        commit_lens=commit,
    )


# ----------------------------------------------------------------------------------------------
# Sync-free round pieces for an overlapped scheduler (SGLang spec-v2 workers)
# ----------------------------------------------------------------------------------------------
# One round of the 0.5.16 worker, in order: the verify slots (:func:`verify_slots`), the FULL
# mask positions (:func:`tree_custom_mask_index`, :func:`restore_true_mask`), the accept
# (:func:`accept_tree_greedy`), the commit layout (:func:`tree_commit_layout`) and the KV move
# of the accepted path (:func:`kv_path_locs` / :func:`kv_move_locs`, :func:`move_kv_rows`).
#
# Slot layout per request and round (p = committed prefix, N = budget + 1 verify tokens,
# D = max depth): the DFlash draft block at req_to_token[p : p + block] (draft pool), tree node
# j at req_to_token[p + j], j < N, and the KV move's staging slots at
# req_to_token[p + N : p + N + D + 1]. After verify the accepted path's target KV moves to
# req_to_token[p : p + D + 1]; req_to_token itself is never rewritten (the schedule stream may
# read it).


def verify_slots(
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    prefix_lens: Tensor,
    width: int,
) -> Tensor:
    """``req_to_token[req, p : p + width]`` per request: ``[bs, width]`` int64, no sync."""
    cols = prefix_lens.to(torch.int64).view(-1, 1) + torch.arange(
        width, device=prefix_lens.device
    ).view(1, -1)
    rows = req_pool_indices.to(torch.int64).view(-1, 1)
    return req_to_token[rows, cols].to(torch.int64)


def accept_tree_greedy(
    candidates: Tensor,
    target_predict: Tensor,
    retrieve_index: Tensor,
    retrieve_next_token: Tensor,
    retrieve_next_sibling: Tensor,
    max_depth: int,
    kernel=None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy tree walk following ``target_predict`` (argmax, or one sample per node).

    Args:
        candidates, target_predict, retrieve_next_token, retrieve_next_sibling: ``[bs, N]``.
        retrieve_index: ``[bs, N]`` flat verify rows ``b * N + i``.
        kernel: ``sgl_kernel.verify_tree_greedy`` (the caller imports it), used for CUDA
            tensors; without it, or off CUDA, :func:`verify_greedy_reference`.

    Returns ``(accept_index [bs, D+1] int64 within-request, -1 padded; accept_len [bs] int64;
    bonus [bs] int64)``. Sync-free with the kernel.
    """
    bs, n = candidates.shape
    if kernel is None or not candidates.is_cuda:
        return verify_greedy_reference(
            candidates, retrieve_next_token, retrieve_next_sibling, target_predict, max_depth
        )
    device = candidates.device
    predicts = torch.empty((bs * n,), dtype=torch.int32, device=device)
    accept_index = torch.full((bs, max_depth + 1), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros((bs,), dtype=torch.int32, device=device)
    kernel(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrive_index=retrieve_index,
        retrive_next_token=retrieve_next_token,
        retrive_next_sibling=retrieve_next_sibling,
        target_predict=target_predict,
    )
    rows = torch.arange(bs, device=device)
    accept_len = accept_token_num.to(torch.int64)
    last_flat = accept_index[rows, accept_len].to(torch.int64)
    bonus = predicts[last_flat].to(torch.int64)
    local = accept_index.to(torch.int64) - (rows * n)[:, None]
    local = torch.where(accept_index >= 0, local, torch.full_like(local, -1))
    return local, accept_len, bonus


def kv_path_locs(slots: Tensor, path: Tensor, n: int, depth: int) -> tuple[Tensor, Tensor]:
    """``(committed, path_slots)`` ``[bs, D + 1]`` int64: the slots the accepted path's KV
    goes to and the verify slots it is in (a request's targets may be its own sources).

    Args:
        slots: ``[bs, >= N]`` from :func:`verify_slots`.
        path: ``[bs, >= D + 1]`` verify index of the i-th committed token (any value past
            the committed length: those moves only touch slots past it), as
            :func:`tree_commit_layout` returns.
        n: N; depth: D.
    """
    k = depth + 1
    return slots[:, :k], slots[:, :n].gather(1, path[:, :k].to(torch.int64))


def kv_move_locs(
    slots: Tensor, path: Tensor, n: int, depth: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """The same move as two (tgt, src) copies through the staging slots, for a pool's
    own ``move_kv_cache`` (which may not read all sources before it writes).

    Args: as :func:`kv_path_locs`, with ``slots`` of width N + D + 1.

    Returns ``((staging, path_slots), (committed, staging))`` flat int64 tensors of
    ``bs * (D + 1)`` entries each; within each copy, targets and sources are disjoint.
    """
    k = depth + 1
    committed, path_slots = kv_path_locs(slots, path, n, depth)
    staging = slots[:, n : n + k]
    return (
        (staging.reshape(-1), path_slots.reshape(-1)),
        (committed.reshape(-1), staging.reshape(-1)),
    )


def tree_custom_mask_index(seq_lens: Tensor, n: int) -> Tensor:
    """Flat positions of the tree blocks inside SGLang's FULL custom mask, on the device.

    Args:
        seq_lens: ``[bs]`` prefix lengths (any device; not copied to the host).
        n: verify tokens per request ``N``.

    Returns ``[bs, N, N]`` int64: entry ``(b, i, j)`` is where row ``i``, key ``seq_lens[b] + j``
    of request ``b`` lives in the flat mask of :func:`tree_custom_mask` (requests concatenated,
    each ``N`` rows of ``seq_lens[b] + N``). Every other entry of that mask is True, so a
    buffer kept all True outside these positions holds the FULL mask after
    ``buf[index] = tree_mask`` (and is restored by :func:`restore_true_mask`). No host sync.
    """
    lens = seq_lens.to(torch.int64).view(-1)
    bs = lens.numel()
    device = lens.device
    sizes = (lens + n) * n
    start = torch.cumsum(sizes, 0) - sizes + lens  # [bs] first tree-block entry of row 0
    i = torch.arange(n, device=device).view(1, n, 1)
    j = torch.arange(n, device=device).view(1, 1, n)
    return start.view(bs, 1, 1) + i * (lens.view(bs, 1, 1) + n) + j


def tree_commit_layout(
    accept_index: Tensor,
    accept_len: Tensor,
    bonus: Tensor,
    candidates: Tensor,
    width: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Fixed-shape commit of accepted tree paths (no host sync).

    Args:
        accept_index: ``[bs, M]`` within-request verify indices of the accepted path in path
            order, root first, -1 padded (as :func:`verify_greedy_reference` returns).
        accept_len: ``[bs]`` accepted draft nodes (root excluded); ``accept_len < width``.
        bonus: ``[bs]`` the token sampled after the last accepted node.
        candidates: ``[bs, N]`` verify tokens (root first).
        width: row width of the outputs (e.g. the DFlash block size), ``>= M``.

    Returns:
        ``out_tokens [bs, width] int64``: the accepted draft tokens in path order, then the
        bonus at index ``accept_len``, zeros after (SGLang spec-v2 ``next_token_ids`` rows).
        ``commit_lens [bs] int32 = accept_len + 1``.
        ``path [bs, width] int64``: verify index of the i-th committed token (0 past
        ``commit_lens``): row ``b`` gathers the committed tokens' KV / hidden states.
    """
    bs, m = accept_index.shape
    device = accept_index.device
    if m > width:
        raise ValueError(f"accept_index has {m} columns for rows of width {width}")
    acc = accept_len.to(device=device, dtype=torch.int64).view(bs)
    path = torch.zeros(bs, width, dtype=torch.int64, device=device)
    path[:, :m] = accept_index.to(torch.int64).clamp_min(0)
    cols = torch.arange(width, device=device).view(1, width)
    path = torch.where(cols <= acc.view(bs, 1), path, 0)
    # token committed at step i is the node at path position i + 1 (the root is last round's)
    nxt = torch.cat([path[:, 1:], torch.zeros_like(path[:, :1])], 1)
    tokens = candidates.to(torch.int64).gather(1, nxt)
    out = torch.where(cols < acc.view(bs, 1), tokens, 0)
    out = torch.where(cols == acc.view(bs, 1), bonus.to(torch.int64).view(bs, 1), out)
    return out, (acc + 1).to(torch.int32), path


def restore_true_mask(buf: Tensor, index: Tensor) -> Tensor:
    """``buf[index] = True`` without waiting for the GPU: ``buf`` flat bool, ``index`` int64
    of any shape (e.g. :func:`tree_custom_mask_index`). Returns ``buf``.

    Indexed assignment of a Python scalar to a CUDA tensor stages the scalar as a CPU tensor
    and copies it to the device with a blocking copy, so the host waits for all queued GPU
    work (measured on an H200: 86 ms behind a queued 211 ms matmul, against 0.13 ms for a
    tensor value), a wait torch's sync debug mode does not report. ``index_fill_`` passes
    the value to the kernel by value.
    """
    return buf.index_fill_(0, index.reshape(-1), True)


class KVRows(NamedTuple):
    """The KV cache as rows of bytes, one row per slot and buffer, for :func:`move_kv_rows`.

    ``buffers``: per-layer cache tensors indexed by slot in dim 0 (K, V, and any per-slot
    scale buffers); ``ptrs`` ``[L]`` int64 their data pointers and ``row_bytes`` ``[L]``
    int64 their slot-row sizes, on the buffers' device; ``max_row_bytes`` the largest.
    """

    buffers: tuple
    ptrs: Tensor
    row_bytes: Tensor
    max_row_bytes: int


def kv_rows(buffers) -> KVRows | None:
    """:class:`KVRows` of ``buffers`` (tensors on one device), or None when a buffer's slot
    row is not one contiguous run of bytes (then move rows another way). No host sync."""
    buffers = tuple(buffers)
    if not buffers or len({b.device for b in buffers}) != 1:
        return None
    sizes = []
    for b in buffers:
        if b.dim() < 1 or not b[:1].is_contiguous():
            return None
        sizes.append(b[:1].numel() * b.element_size())
        if b.dim() > 1 and b.stride(0) * b.element_size() != sizes[-1]:
            return None
    device = buffers[0].device
    host = torch.tensor([[b.data_ptr() for b in buffers], sizes], dtype=torch.int64)
    if device.type == "cuda":  # an asynchronous copy: no host wait, also inside a round
        host = host.pin_memory()
    table = host.to(device, non_blocking=True)
    return KVRows(buffers, table[0], table[1], max(sizes))


# Bytes of a slot row one program of the row-move kernel copies.
_KV_MOVE_TILE = 256


def move_kv_rows(rows: KVRows, tgt: Tensor, src: Tensor, backend: str = "auto") -> None:
    """Per request ``b`` and buffer: ``buf[tgt[b, i]] = buf[src[b, i]]`` for every ``i``, all
    reads of a request before its writes. No host sync.

    Args:
        rows: from :func:`kv_rows`.
        tgt, src: ``[bs, K]`` int slots; a request's targets may be its own sources (the
            accepted path moved onto the committed slots), requests share no slot.

    One Triton launch on CUDA (grid buffers x requests x byte tiles); otherwise, or with
    ``backend="torch"``, one gather + scatter per buffer (the same result).
    """
    if tgt.shape != src.shape or tgt.dim() != 2:
        raise ValueError(f"tgt and src must be [bs, K], got {tuple(tgt.shape)}, {tuple(src.shape)}")
    bs, k = tgt.shape
    if bs == 0 or k == 0:
        return
    if _triton_ok(tgt.device, backend):
        tiles = triton.cdiv(rows.max_row_bytes, _KV_MOVE_TILE)
        ddtree_triton.move_kv_rows_kernel[(len(rows.buffers), bs, tiles)](
            rows.ptrs,
            rows.row_bytes,
            tgt.to(torch.int64).contiguous(),
            src.to(torch.int64).contiguous(),
            k,
            KP=_pow2(k),
            TILE=_KV_MOVE_TILE,
            num_warps=4,
        )
        return
    t, s = tgt.reshape(-1).to(torch.int64), src.reshape(-1).to(torch.int64)
    for b in rows.buffers:
        b[t] = b[s]


# ----------------------------------------------------------------------------------------------
# Tree-verify attention: split-KV over the shared prefix, the masked tree block, one merge
# ----------------------------------------------------------------------------------------------
# A verify forward has N tree tokens per request and a prefix of p tokens that every tree node
# sees whole. SGLang's Triton extend kernel runs one program per (request, head) over the whole
# prefix, which leaves most of the GPU idle at small batches (H200, Qwen3-8B shape, 512-token
# prefix, batch 16: 6 ms of a 14 ms verify round, against 0.7 ms for the same prefix in the
# decode kernel). Here the prefix is split across programs (flash-decode), every program handles
# the N x G query rows of one KV head (G = query heads per KV head), and a second kernel adds the
# tree block under the ancestor mask and merges the partial softmaxes by log-sum-exp.

_TREE_ATTN_ROWS = 64  # query rows (tree nodes x heads of a KV head) per program
# ... and when that gives fewer programs than half the SMs (batch 1-2 at Qwen3-8B's heads): twice
# the programs, 13.9 against 15.7 us a layer at batch 1 and a 128-key prefix, 41.8 against 48.7
# at 3000 keys, while at batch 4 and 16 64 rows stay faster (26.3 / 86.3 against 31.2 / 111.6;
# H100, bench/tree_attn_bench.py, BENCHMARKS.md fourteenth session).
_TREE_ATTN_ROWS_SMALL = 32
_TREE_ATTN_KEYS = 64  # keys per step
_TREE_ATTN_MAX_SPLITS = 16
# Warps per program. At 4 both kernels spill on sm_90 (255 registers and 280 / 928 bytes of
# stack a thread; at 8 the prefix kernel needs no stack), yet 4 measured faster in every case on
# an H100 (8: 16.8 against 15.7 us a layer at batch 1, 132.8 against 86.3 at batch 16).
_TREE_ATTN_WARPS = 4
# Fewest prefix keys per split. The split count is fixed per batch size (a CUDA graph holds it),
# but the prefix grows from a few dozen keys: at batch 1 (9 splits on 132 SMs) a 200-key prefix
# split 9 ways gives programs of about 22 keys each plus a 9-step merge per row block, which
# measured 27 us a layer on an H100 against 14 for SGLang's extend kernel (BENCHMARKS.md,
# fourteenth session). Splits of at least two key steps each keep the split-KV gain for long
# prefixes and skip the idle splits and their merge for short ones (decided on the device).
_TREE_ATTN_MIN_SPLIT_KEYS = 2 * _TREE_ATTN_KEYS
_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    key = str(device)
    if key not in _SM_COUNT:
        _SM_COUNT[key] = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 8
        )
    return _SM_COUNT[key]


def tree_verify_rows(bs: int, kv_heads: int, q_rows: int, device: torch.device) -> int:
    """Query rows per program: ``_TREE_ATTN_ROWS``, or ``_TREE_ATTN_ROWS_SMALL`` when that gives
    fewer programs than half the device's SMs (``q_rows``: tree nodes x query heads of a KV
    head; host arithmetic, fixed per batch size like the split count)."""
    programs = bs * kv_heads * -(-q_rows // _TREE_ATTN_ROWS)
    return _TREE_ATTN_ROWS_SMALL if 2 * programs <= _sm_count(device) else _TREE_ATTN_ROWS


def tree_verify_splits(bs: int, kv_heads: int, row_blocks: int, device: torch.device) -> int:
    """Prefix splits per (request, KV head, row block): enough programs for about two waves
    of the device's SMs, at most ``_TREE_ATTN_MAX_SPLITS`` (host arithmetic; a CUDA graph of
    a given batch size always gets the same number)."""
    programs = max(1, bs * kv_heads * row_blocks)
    return max(1, min(_TREE_ATTN_MAX_SPLITS, -(-2 * _sm_count(device) // programs)))


def tree_verify_attention(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    k_tree: Tensor,
    v_tree: Tensor,
    mask: Tensor,
    mask_indptr: Tensor,
    n: int,
    sm_scale: float,
    out: Tensor | None = None,
    splits: int | None = None,
    min_split_keys: int = _TREE_ATTN_MIN_SPLIT_KEYS,
) -> Tensor:
    """Attention of a tree verify, as ``ddtree_reference.tree_verify_attention_reference`` (same arguments),
    with two Triton kernels and no host sync (capturable in a CUDA graph): split-KV over the
    prefix, then the masked tree block and a log-sum-exp merge. ``out``: ``[bs * N, Hq, D]``
    to write into (else allocated); ``splits``: prefix splits (default
    :func:`tree_verify_splits`), of which a request uses as many as give each at least
    ``min_split_keys`` keys (at least one split for a non-empty prefix; the kernels decide this
    from the prefix length on the device). Needs Triton (CUDA, or the CPU under
    ``TRITON_INTERPRET=1``).
    """
    if triton is None:
        raise RuntimeError("tree_verify_attention needs Triton")
    bs = kv_indptr.numel() - 1
    hq, dim = q.shape[1], q.shape[2]
    hkv = k_tree.shape[1]
    if hq % hkv or q.shape[0] != bs * n or k_tree.shape[0] != bs * n:
        raise ValueError(
            f"q {tuple(q.shape)} / k_tree {tuple(k_tree.shape)} do not fit bs={bs}, N={n}"
        )
    if min_split_keys < 1:
        raise ValueError(f"min_split_keys={min_split_keys}: give 1 or more")
    g = hq // hkv
    rows = tree_verify_rows(bs, hkv, n * g, q.device)
    rb = -(-(n * g) // rows)
    s = splits or tree_verify_splits(bs, hkv, rb, q.device)
    bd = max(16, _pow2(dim))  # tl.dot needs K >= 16
    if out is None:
        out = torch.empty_like(q)
    if bs == 0:
        return out
    ws_o = torch.empty((bs, hkv, rb, s, rows, bd), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((bs, hkv, rb, s, rows), dtype=torch.float32, device=q.device)
    common = {"BLOCK_R": rows, "BLOCK_N": _TREE_ATTN_KEYS, "BLOCK_D": bd, "num_warps": _TREE_ATTN_WARPS}
    ddtree_triton.tree_attn_prefix_kernel[(bs, hkv * rb, s)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, ws_o, ws_lse,
        n, g, dim, s, rb, min_split_keys,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        float(sm_scale), **common,
    )  # fmt: skip
    ddtree_triton.tree_attn_tree_kernel[(bs, hkv * rb)](
        q, k_tree, v_tree, kv_indptr, mask, mask_indptr, ws_o, ws_lse, out,
        n, g, dim, s, rb, min_split_keys,
        q.stride(0), q.stride(1), k_tree.stride(0), k_tree.stride(1),
        v_tree.stride(0), v_tree.stride(1), out.stride(0), out.stride(1),
        float(sm_scale), **common,
    )  # fmt: skip
    return out
