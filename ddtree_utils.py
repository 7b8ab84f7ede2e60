"""DDTree core: draft top-k, exact draft-tree construction, tree compilation, reference verification.

Depends only on torch and the standard library; Triton, which every CUDA build of torch
installs, is imported when present for three fused kernels (see the performance notes below).
Shipped verbatim into SGLang as ``sglang/srt/speculative/ddtree_utils.py``.

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
dispatch costs 2-5 ms a call). On the CPU :func:`build_tree_reference` is the faster builder.
"""

from __future__ import annotations

import heapq
import math
import os
import struct
import sys
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AcceptPlan",
    "CompiledTree",
    "DDTree",
    "accept_plan",
    "build_tree",
    "build_tree_reference",
    "compile_tree",
    "draft_topk_logprobs",
    "merge_shard_topk",
    "shard_topk_stats",
    "target_probs_from_logits",
    "tree_arrays_from_parents",
    "tree_commit_layout",
    "tree_custom_mask",
    "tree_custom_mask_index",
    "tree_metrics",
    "verify_greedy_reference",
    "verify_sampling_reference",
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


def _f32(x: float) -> float:
    """Round a Python float to float32 (exact emulation of a float32 add of float32 operands)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def build_tree_reference(
    topk_logp: Tensor,
    topk_ids: Tensor,
    budget: int,
    *,
    valid: Tensor | None = None,
    topk_cap: int | None = None,
) -> DDTree:
    """The paper's best-first heap, one request at a time on the CPU (the oracle).

    Args:
        topk_logp: ``[bs, L, K]`` log-probabilities, each row sorted descending, all <= 0.
        topk_ids: ``[bs, L, K]`` token ids (int32/int64).
        budget: B, the number of draft nodes (root excluded).
        valid: optional ``[bs]`` bool; invalid rows get an empty tree.
        topk_cap: optional per-depth cap on the ranks considered.

    Returns a :class:`DDTree` on the inputs' device. Raises ``ValueError`` on NaN, positive or
    unsorted log-probabilities.
    """
    _check_tree_inputs(topk_logp, topk_ids, budget)
    bs, depth_limit, _ = topk_logp.shape
    device = topk_logp.device
    out = _empty_tree(bs, budget, torch.device("cpu"))
    if bs == 0:
        return DDTree(*(t.to(device) for t in out))
    kk = _effective_k(topk_logp, budget, topk_cap)
    lp_all = topk_logp[:, :, :kk].detach().float().cpu() + 0.0
    if bool(torch.isnan(lp_all).any()) or bool((lp_all > 0).any()):
        raise ValueError("topk_logp must hold log-probabilities (no NaN, all <= 0)")
    if kk > 1 and bool((lp_all[..., 1:] > lp_all[..., :-1]).any()):
        raise ValueError(
            "topk_logp must be sorted in descending order along the last dim"
        )
    ids_all = topk_ids[:, :, :kk].detach().to(torch.int64).cpu().tolist()
    lp_list = lp_all.tolist()
    rows = [True] * bs if valid is None else valid.detach().cpu().bool().tolist()
    tokens = [[0] * budget for _ in range(bs)]
    parents = [[0] * budget for _ in range(bs)]
    depth = [[1] * budget for _ in range(bs)]
    score = [[_NEG_INF] * budget for _ in range(bs)]
    count = [0] * bs
    for b in range(bs):
        if not rows[b]:
            continue
        lp, ids = lp_list[b], ids_all[b]
        tok_b, par_b, dep_b, sco_b = tokens[b], parents[b], depth[b], score[b]
        # heap entry: (-score, depth, rank tuple, parent score, parent verify index)
        heap: list[tuple[float, int, tuple[int, ...], float, int]] = []
        if lp[0][0] != _NEG_INF:
            heap.append((-lp[0][0], 1, (0,), 0.0, 0))
        n = 0
        while heap and n < budget:
            neg, d, ranks, base, par = heapq.heappop(heap)
            s, r = -neg, ranks[-1]
            tok_b[n], par_b[n], dep_b[n], sco_b[n] = ids[d - 1][r], par, d, s
            n += 1
            if r + 1 < kk:
                sib = _f32(base + lp[d - 1][r + 1])
                if sib != _NEG_INF:
                    heapq.heappush(heap, (-sib, d, ranks[:-1] + (r + 1,), base, par))
            if d < depth_limit:
                child = _f32(s + lp[d][0])
                if child != _NEG_INF:
                    heapq.heappush(heap, (-child, d + 1, ranks + (0,), s, n))
        count[b] = n
    filled = torch.tensor(count).view(bs, 1) > torch.arange(budget).view(1, budget)
    out = DDTree(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depth=torch.tensor(depth, dtype=torch.int64),
        score=torch.tensor(score, dtype=torch.float32),
        node_valid=filled,
    )
    return DDTree(*(t.to(device) for t in out))


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
    """Batched exact DDTree: identical output to :func:`build_tree_reference`.

    No host synchronisation and fixed shapes (all loops run over the static L), so it can be
    captured in a CUDA graph. Inputs as in :func:`build_tree_reference` (not validated here:
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
    see the proof above ``_ddtree_build_kernel``) for CUDA inputs when Triton imports and the
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
# Fused Triton kernels for build_tree / compile_tree (optional: used on CUDA when Triton imports)
# ----------------------------------------------------------------------------------------------
#
# One program per request runs the whole per-depth beam (build) or the whole compilation, with
# a small global-memory workspace for the few steps that need a scatter or an index shift.
# Both produce exactly the torch builders' output (tested on the CPU under TRITON_INTERPRET=1
# against build_tree_reference, on the GPU against both).
#
# Beam step without sorting all B*K candidates. Order the parents of beam_{d-1} by score
# (descending, any order among equal scores) as j = 0..B-1 and let c(j, r) = fl(s_j + lp_d[r]).
# c is non-increasing in j and in r (float rounding is monotone), so for any t the set
# {c >= t} is a down-set of the (j, r) grid. Let t be the B-th largest candidate. The down-set
# {c > t} has < B elements, and {c >= t} contains a down-set of exactly B elements; every
# element of a down-set of size m has (j + 1) * (r + 1) <= m. Hence the pruned grid
# P = {(j, r) : (j + 1) * (r + 1) <= B} (about B * ln B cells) holds every candidate > t and at
# least B candidates >= t, so t is also the B-th largest over P. The beam then takes, per
# parent in lexicographic order, its children with c > t (a prefix of its ranks, found by
# binary search) plus the children tied at t in (parent, rank) order until B are taken: the
# tie order of build_tree. Candidates tied at t may lie outside P; they are counted per parent,
# not enumerated.

try:  # Triton ships with CUDA builds of torch; without it the torch builders are used.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None

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


if triton is not None:

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _ddtree_build_kernel(
        lp_ptr,  # [bs, L, kk] f32, rows sorted descending, <= 0, -inf for invalid requests
        ids_ptr,  # [bs, L, kk] int64
        pj_ptr,  # [P] int32 pruned grid: parent rank in score order
        pr_ptr,  # [P] int32 pruned grid: child rank
        wsf_ptr,  # [bs, (L + 1) * BB] f32: beam scores [L, BB], sorted parent scores [BB]
        wsi_ptr,  # [bs, 2 * L * BB + 2 * BB + LB * BB] int32: beam parent, beam rank,
        #                                    offsets, markers, verify index of each beam slot
        wsk_ptr,  # [bs, LB * BB] int64: the sorted global keys
        tok_ptr,  # [bs, B] int64 out
        par_ptr,  # [bs, B] int64 out
        dep_ptr,  # [bs, B] int64 out
        score_ptr,  # [bs, B] f32 out
        valid_ptr,  # [bs, B] int8 out
        L,
        kk,
        B,
        P,
        BB: tl.constexpr,  # pow2 >= B
        LB: tl.constexpr,  # pow2 >= L
        PB: tl.constexpr,  # pow2 >= P
        LOGK: tl.constexpr,  # binary-search steps over 0..kk
    ):
        NEG = float("-inf")
        b = tl.program_id(0).to(tl.int64)
        q = tl.arange(0, BB)
        in_beam = q < B
        lp_row = lp_ptr + b * L * kk
        beam_s = wsf_ptr + b * (L + 1) * BB
        sorted_s = beam_s + L * BB
        beam_par = wsi_ptr + b * (2 * L * BB + 2 * BB + LB * BB)
        beam_rank = beam_par + L * BB
        offs_ws = beam_rank + L * BB
        mark_ws = offs_ws + BB
        vmap_ws = mark_ws + BB

        # depth 1: ranks 0..kk-1 in order (kk <= B), padded with -inf
        tl.store(beam_s + q, tl.load(lp_row + q, mask=q < kk, other=NEG))
        tl.store(beam_par + q, tl.zeros([BB], tl.int32))
        tl.store(beam_rank + q, q)
        tl.debug_barrier()

        p_idx = tl.arange(0, PB)
        p_ok = p_idx < P
        pj = tl.load(pj_ptr + p_idx, mask=p_ok, other=0)
        pr = tl.load(pr_ptr + p_idx, mask=p_ok, other=0)
        for d in range(1, L):
            lp_d = lp_row + d * kk
            s = tl.load(beam_s + (d - 1) * BB + q, mask=in_beam, other=NEG)  # lex order
            tl.store(sorted_s + q, tl.sort(s, descending=True))
            tl.debug_barrier()
            # t = the B-th largest candidate, found on the pruned grid
            cand = tl.load(sorted_s + pj, mask=p_ok, other=NEG) + tl.load(
                lp_d + pr, mask=p_ok, other=NEG
            )
            cand = tl.where(p_ok, cand, NEG)
            top = tl.sort(cand, descending=True)
            t = tl.min(tl.where(p_idx < B, top, float("inf")), axis=0)
            # per parent: #children > t and #children >= t (binary search over its ranks)
            lo_g = tl.zeros([BB], tl.int32)
            hi_g = tl.where(in_beam, kk, 0).to(tl.int32)
            lo_e = lo_g
            hi_e = hi_g
            for _ in tl.static_range(LOGK):
                act = lo_g < hi_g
                mid = (lo_g + hi_g) // 2
                above = (s + tl.load(lp_d + mid, mask=act, other=NEG)) > t
                lo_g = tl.where(act & above, mid + 1, lo_g)
                hi_g = tl.where(act & ~above, mid, hi_g)
                act = lo_e < hi_e
                mid = (lo_e + hi_e) // 2
                atleast = (s + tl.load(lp_d + mid, mask=act, other=NEG)) >= t
                lo_e = tl.where(act & atleast, mid + 1, lo_e)
                hi_e = tl.where(act & ~atleast, mid, hi_e)
            need = B - tl.sum(lo_g, axis=0)
            tie = lo_e - lo_g
            tie_before = tl.cumsum(tie, axis=0) - tie
            take = lo_g + tl.minimum(tl.maximum(need - tie_before, 0), tie)
            offs = tl.cumsum(take, axis=0) - take
            # new beam slot q -> (parent, rank): scatter each parent at its first slot, scan max
            tl.store(offs_ws + q, offs)
            tl.store(mark_ws + q, tl.full([BB], -1, tl.int32))
            tl.debug_barrier()
            tl.store(mark_ws + offs, q, mask=take > 0)
            tl.debug_barrier()
            parent = tl.maximum(
                tl.associative_scan(tl.load(mark_ws + q), 0, _max_combine), 0
            )
            rank = q - tl.load(offs_ws + parent)
            ok = in_beam & (rank < kk)
            new_s = tl.load(beam_s + (d - 1) * BB + parent) + tl.load(
                lp_d + rank, mask=ok, other=NEG
            )
            tl.store(beam_s + d * BB + q, new_s, mask=in_beam)
            tl.store(beam_par + d * BB + q, parent, mask=in_beam)
            tl.store(beam_rank + d * BB + q, rank, mask=in_beam)
            tl.debug_barrier()

        # global top-B over the union: key = (score desc, depth asc, lexicographic position asc)
        row = tl.arange(0, LB)[:, None]
        col = q[None, :]
        here = (row < L) & (col < B)
        sc = tl.load(beam_s + row * BB + col, mask=here, other=NEG)
        mag = (sc.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
        keys = tl.where(
            here, (mag << 32) | (row * BB + col).to(tl.int64), 0x7FFFFFFFFFFFFFFF
        )
        keys = tl.sort(tl.reshape(keys, [LB * BB]))
        key_ws = wsk_ptr + b * LB * BB
        tl.store(key_ws + tl.arange(0, LB * BB), keys)
        tl.debug_barrier()
        slot = (tl.load(key_ws + q, mask=in_beam, other=0) & 0xFFFFFFFF).to(tl.int32)
        tl.store(vmap_ws + slot, q + 1, mask=in_beam)
        tl.debug_barrier()
        depth0 = slot // BB
        score = tl.load(beam_s + slot, mask=in_beam, other=NEG)
        rank = tl.load(beam_rank + slot, mask=in_beam, other=0)
        ppos = tl.load(beam_par + slot, mask=in_beam, other=0)
        node = in_beam & (score != NEG)
        pv = tl.load(
            vmap_ws + (depth0 - 1) * BB + ppos, mask=node & (depth0 > 0), other=0
        )
        token = tl.load(ids_ptr + b * L * kk + depth0 * kk + rank, mask=node, other=0)
        out = b * B + q
        tl.store(tok_ptr + out, tl.where(node, token, 0), mask=in_beam)
        tl.store(par_ptr + out, tl.where(node, pv, 0).to(tl.int64), mask=in_beam)
        tl.store(
            dep_ptr + out, tl.where(node, depth0 + 1, 1).to(tl.int64), mask=in_beam
        )
        tl.store(score_ptr + out, tl.where(node, score, NEG), mask=in_beam)
        tl.store(valid_ptr + out, node.to(tl.int8), mask=in_beam)

    @triton.jit
    def _ddtree_compile_kernel(
        tok_ptr,  # [bs, B] int64 tree tokens
        par_ptr,  # [bs, B] int64 parent verify index
        dep_ptr,  # [bs, B] int64 depth
        valid_ptr,  # [bs, B] int8 node_valid
        bonus_ptr,  # [bs] int64 root tokens
        seq_ptr,  # [bs] int64 seq_lens
        ws_ptr,  # [bs, 3 * NB + NB * DB] int32: sorted keys, parents, depths, ancestor table
        out_tok_ptr,  # [bs, N] int64
        out_pos_ptr,  # [bs, N] int64
        out_par_ptr,  # [bs, N] int64
        out_dep_ptr,  # [bs, N] int64
        out_next_ptr,  # [bs, N] int64
        out_sib_ptr,  # [bs, N] int64
        mask_ptr,  # [bs, N, N] int8
        B,
        STEPS,  # depth bound: ancestor walk length
        NB: tl.constexpr,  # pow2 >= N
        DB: tl.constexpr,  # pow2 >= STEPS + 1
        RB: tl.constexpr,  # mask rows per tile
    ):
        b = tl.program_id(0).to(tl.int64)
        n = B + 1
        i = tl.arange(0, NB)
        inb = i < n
        node = (i >= 1) & inb
        src = b * B + i - 1
        par = tl.where(node, tl.load(par_ptr + src, mask=node, other=0), -1)
        dep = tl.where(node, tl.load(dep_ptr + src, mask=node, other=1), 0)
        live = node & (tl.load(valid_ptr + src, mask=node, other=0) != 0)
        tok = tl.where(
            node, tl.load(tok_ptr + src, mask=node, other=0), tl.load(bonus_ptr + b)
        )
        row = b * n + i
        tl.store(out_tok_ptr + row, tok, mask=inb)
        tl.store(out_pos_ptr + row, tl.load(seq_ptr + b) + dep, mask=inb)
        tl.store(out_par_ptr + row, par, mask=inb)
        tl.store(out_dep_ptr + row, dep, mask=inb)
        tl.store(out_next_ptr + row, tl.full([NB], -1, tl.int64), mask=inb)
        tl.store(out_sib_ptr + row, tl.full([NB], -1, tl.int64), mask=inb)

        ws = ws_ptr + b * (3 * NB + NB * DB)
        par_ws = ws + NB
        dep_ws = par_ws + NB
        anc_ws = dep_ws + NB
        # children grouped by parent, in verify-index order: sort (parent, index)
        child_of = tl.where(live, par, n).to(tl.int32)
        sk = tl.sort(child_of * NB + i)
        tl.store(ws + i, sk)
        tl.store(par_ws + i, tl.maximum(par, 0).to(tl.int32))
        tl.store(dep_ws + i, dep.to(tl.int32))
        col = tl.arange(0, DB)
        tl.store(
            anc_ws + i[:, None] * DB + col[None, :], tl.full([NB, DB], -1, tl.int32)
        )
        tl.debug_barrier()
        nk = tl.load(ws + i + 1, mask=i + 1 < NB, other=(n + 1) * NB)
        pk = tl.load(ws + i - 1, mask=i >= 1, other=0)
        sp = sk // NB
        si = sk % NB
        child = sp < n
        sib = tl.where(nk // NB == sp, nk % NB, -1).to(tl.int64)
        tl.store(out_sib_ptr + b * n + si, sib, mask=child)
        first = child & ((i == 0) | (pk // NB != sp))
        tl.store(out_next_ptr + b * n + sp, si.to(tl.int64), mask=first)
        # ancestor table: anc[i, k] = the ancestor of i at depth k (walk up STEPS + 1 times)
        a = i
        for _ in range(STEPS + 1):
            tl.store(
                anc_ws + i * DB + tl.minimum(tl.load(dep_ws + a), DB - 1), a, mask=inb
            )
            a = tl.load(par_ws + a)
        tl.debug_barrier()
        # mask[i, j] = j is an ancestor-or-self of i  <=>  anc[i, depth(j)] == j
        dep_j = tl.load(dep_ws + i)
        for r0 in range(0, n, RB):
            ri = r0 + tl.arange(0, RB)
            both = (ri[:, None] < n) & inb[None, :]
            anc = tl.load(
                anc_ws + ri[:, None] * DB + dep_j[None, :], mask=both, other=-1
            )
            hit = (anc == i[None, :]).to(tl.int8)
            tl.store(
                mask_ptr + b * n * n + ri[:, None] * n + i[None, :], hit, mask=both
            )

    @triton.jit
    def _sumexp_partial_kernel(
        x_ptr,  # [rows, V] logits, any float dtype, row stride x_stride
        shift_ptr,  # [rows] f32 shift (the row's top-1 logit when finite, else 0)
        out_ptr,  # [rows, NC] f32 out: sum(exp(x - shift)) over chunk c
        V,
        x_stride,
        NC,
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * x_stride + cols, mask=cols < V, other=float("-inf"))
        s = tl.sum(tl.exp(x.to(tl.float32) - tl.load(shift_ptr + row)), axis=0)
        tl.store(out_ptr + row * NC + c, s)


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
    _sumexp_partial_kernel[(rows, nc)](
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
    _ddtree_build_kernel[(bs,)](
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
    _ddtree_compile_kernel[(bs,)](
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
        tree: from :func:`build_tree` / :func:`build_tree_reference`.
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


def verify_sampling_reference(
    candidates: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    target_probs: Tensor | None,
    max_accept: int,
    generator: torch.Generator | None = None,
    *,
    samples: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Lossless sampling walk: one target sample per node, followed when it is a child.

    Either ``target_probs [bs, N, V]`` float32, the target's (already filtered) distributions at
    every node, from which one token per node is drawn with ``torch.multinomial``; or
    ``samples [bs, N]`` int64, one draw per node already made (:func:`sample_tree_targets`), in
    which case ``target_probs`` may be None. The bonus is the sample at the last accepted node, so
    the emitted tokens are distributed exactly as target decoding: the draft tree is a
    deterministic function of the drafter, and each visited node's sample is an independent draw
    from the target's conditional there. Returns the same triple as
    :func:`verify_greedy_reference` (which, given ``samples`` as ``target_predict``, is the same
    walk; so is ``sgl_kernel.verify_tree_greedy`` on CUDA).
    """
    bs, n = candidates.shape
    if samples is not None:
        if tuple(samples.shape) != (bs, n):
            raise ValueError(
                f"samples must be [bs, N] = {(bs, n)}, got {tuple(samples.shape)}"
            )
        return _walk(candidates, next_token, next_sibling, samples, max_accept)
    if target_probs is None:
        raise ValueError("verify_sampling_reference needs target_probs or samples")
    if bs == 0:
        return _walk(candidates, next_token, next_sibling, candidates, max_accept)
    probs = target_probs.reshape(bs * n, -1).float()
    sample = torch.multinomial(probs, 1, generator=generator).view(bs, n)
    return _walk(candidates, next_token, next_sibling, sample, max_accept)


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


if triton is not None:

    @triton.jit
    def _key_of(s):
        b = s.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _load_scaled(x_row, cols, V, temp):
        """s = logits / temperature of the columns `cols` (-inf past V), -0.0 as +0.0; IEEE
        division (tl.math.div_rn) so that s, and a threshold taken from it, equal torch's x / temp."""
        s = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        return tl.math.div_rn(s, temp) + 0.0

    @triton.jit
    def _value_of(k):
        b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _search_step(ss, sk, lo, hi, piv2, peak64, a_n, a_m, a_z):
        """One sub-step of a search pass: the values ``ss`` (keys ``sk``) counted against every
        pivot of ``piv2`` ([NP, 1]) into a_n (#gt + 65536 * #eq) and a_m (float64 mass strictly
        above), keys outside [lo, hi] for none; a_z sums exp(s - peak) of every column."""
        e = tl.exp(ss.to(tl.float64) - peak64)  # 0 for -inf (past V)
        kb = tl.where((sk >= lo) & (sk <= hi), sk, lo - 1)[None, :]
        gt = kb > piv2  # lo - 1 (outside the band) counts for no pivot
        a_n += tl.where(gt, 1, tl.where(kb == piv2, 65536, 0))
        a_m += tl.where(gt, e[None, :], 0.0)
        return a_n, a_m, a_z + e

    @triton.jit
    def _sample_rows_kernel(
        x_ptr,  # [R, V] logits, any float dtype, row stride x_stride
        temp_ptr,  # [R] f32 temperature (1 for greedy rows)
        k_ptr,  # [R] i64 top_k in 1..V
        p_ptr,  # [R] f32 top_p (+inf: no limit)
        lmp_ptr,  # [R] f32 log(min_p) (-inf: no limit)
        greedy_ptr,  # [R] i8
        seed_ptr,  # [1] i64 Philox seed of this call
        out_ptr,  # [R] i64 out: the sampled token
        thr_ptr,  # [R] f32 out: the kept set is s >= thr
        buf_ptr,  # [programs, CAP] f32 scratch: a row's bracketed values once they fit (CAP > 0)
        next_ptr,  # [1] i32, zero at launch: the next row to take
        R,
        V,
        x_stride,
        BLOCK: tl.constexpr,
        SBLOCK: tl.constexpr,
        NP: tl.constexpr,
        MAX_PASSES: tl.constexpr,
        SEARCH: tl.constexpr,
        CAP: tl.constexpr,
        NS: tl.constexpr,  # pow2 >= the count of BLOCK steps (ceil(V / BLOCK))
    ):
        # R rows, min(R, a few per SM) programs: each program takes the next untaken row until
        # none is left (rows cost unequal amounts) and owns one buffer row, so the buffer is
        # sized by the GPU, not by the batch. A draw depends on (seed, row) only.
        buf_row = buf_ptr + tl.program_id(0).to(tl.int64) * CAP
        row = tl.atomic_add(next_ptr, 1)
        while row < R:
            _sample_row(
                row.to(tl.int64), x_ptr, temp_ptr, k_ptr, p_ptr, lmp_ptr, greedy_ptr,
                seed_ptr, out_ptr, thr_ptr, buf_row, V, x_stride,
                BLOCK, SBLOCK, NP, MAX_PASSES, SEARCH, CAP, NS,
            )  # fmt: skip
            row = tl.atomic_add(next_ptr, 1)

    @triton.jit
    def _sample_row(
        row,  # i64 the row this call samples
        x_ptr,
        temp_ptr,
        k_ptr,
        p_ptr,
        lmp_ptr,
        greedy_ptr,
        seed_ptr,
        out_ptr,
        thr_ptr,
        buf_row,  # [CAP] f32 this program's buffer
        V,
        x_stride,
        BLOCK: tl.constexpr,
        SBLOCK: tl.constexpr,
        NP: tl.constexpr,
        MAX_PASSES: tl.constexpr,
        SEARCH: tl.constexpr,
        CAP: tl.constexpr,
        NS: tl.constexpr,
    ):
        NEG = float("-inf")
        x_row = x_ptr + row * x_stride
        temp = tl.load(temp_ptr + row)
        greedy = tl.load(greedy_ptr + row) != 0
        offs = tl.arange(0, BLOCK)
        # pass 1: max, smallest finite value, first argmax (the search sums its own float64
        # softmax denominator, so no sum of exp here: rows without top-k / top-p never need it)
        m_v = tl.full([BLOCK], NEG, tl.float32)
        lo_v = tl.full([BLOCK], float("inf"), tl.float32)
        arg_v = tl.full([BLOCK], V, tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            s = _load_scaled(x_row, cols, V, temp)
            arg_v = tl.where(s > m_v, cols, arg_v)
            m_v = tl.maximum(m_v, s)
            lo_v = tl.minimum(lo_v, tl.where(s > NEG, s, float("inf")))
        peak = tl.max(m_v, axis=0)
        s_min = tl.min(lo_v, axis=0)
        arg = tl.min(tl.where(m_v == peak, arg_v, V), axis=0)
        arg = tl.where(arg >= V, 0, arg)
        sample = ~greedy & (peak > NEG)

        kk = tl.load(k_ptr + row)
        pp = tl.load(p_ptr + row)
        t_lo = tl.maximum(peak + tl.load(lmp_ptr + row), s_min)
        lo = (
            _key_of(t_lo) - 1
        )  # Q(lo) is taken as false: no candidate lies at or below lo
        hi = _key_of(peak)  # Q(max) is true: nothing lies strictly above the max
        thr_key = lo + 1  # min-p (or no limit) only
        peak64 = peak.to(tl.float64)  # masses are exp(s - peak) in float64 (search and draw)
        if SEARCH:  # compiled out when the caller knows that no row has top-k / top-p
            search = sample & ((kk < V) | (pp < float("inf")))
            inside = tl.where(search, 1, 0)
            passes = 0
            c = tl.arange(0, NP)
            soffs = tl.arange(0, SBLOCK)
            pp64 = pp.to(tl.float64)
            n_hi = 0  # count strictly above hi (carried: hi only moves down)
            m_hi = tl.full([], 0.0, tl.float64)  # mass strictly above hi, unnormalised
            z = tl.full([], 1.0, tl.float64)  # sum of exp(s - peak), float64 (first pass)
            # Pivots: linear in value between the bracket's ends (a flat row's bracket shrinks
            # about NP - 1-fold a pass), or linear in key (the bracket's key range shrinks
            # NP - 1-fold, whatever the values: the guard against a few far outliers, where
            # value-linear pivots crawl). Value-linear after a value pass that shrank the
            # bracket's count at least 4-fold, or after a key pass.
            use_value = s_min > NEG
            before = V  # tokens in the bracket before this pass (an upper bound at first)
            n_buf = -1  # values copied to buf_ptr (-1: not yet; later passes read only those)
            while (inside > 0) & (passes < MAX_PASSES):
                lo64 = lo.to(tl.int64)
                hi64 = hi.to(tl.int64)
                piv = lo64 + ((hi64 - lo64) * c) // (NP - 1)
                v_lo = _value_of(lo).to(tl.float64)
                v_hi = _value_of(hi).to(tl.float64)
                by_value = use_value & (v_lo > NEG) & (v_hi < float("inf"))
                if by_value:
                    pv = (v_lo + (v_hi - v_lo) * c.to(tl.float64) / (NP - 1)).to(tl.float32)
                    piv = _key_of(pv).to(tl.int64)
                mid = (c > 0) & (c < NP - 1)
                piv = tl.where(c == 0, lo64, tl.where(c == NP - 1, hi64, piv))
                piv = tl.where(mid, tl.minimum(tl.maximum(piv, lo64 + 1), hi64 - 1), piv)
                piv = piv.to(tl.int32)  # [NP] keys, lo = piv[0] <= ... <= piv[NP - 1] = hi
                piv2 = piv[:, None]
                # Tokens above hi count for every pivot (all <= hi) and are carried from the
                # last pass; tokens below lo count for none. Only BLOCK steps holding a token
                # in [lo, hi] (all of them in the first pass, which also sums z) redo their
                # columns in SBLOCK sub-steps into [NP, SBLOCK] partials, reduced once. With
                # SBLOCK == BLOCK (V <= 256) a step is its own sub-step: no band test, no
                # re-read (the interpreter's cost is mostly nested jit calls and reductions).
                # Once the bracket's tokens fit in CAP they are copied to buf_ptr and the
                # later passes read that copy instead of the row.
                first = passes == 0
                a_n = tl.full([NP, SBLOCK], 0, tl.int32)  # per column: #gt + 65536 * #eq
                a_m = tl.full([NP, SBLOCK], 0.0, tl.float64)
                a_z = tl.full([SBLOCK], 0.0, tl.float64)
                if n_buf >= 0:
                    for start in range(0, n_buf, SBLOCK):
                        idx = start + soffs
                        ss = tl.load(buf_row + idx, mask=idx < n_buf, other=float("-inf"))
                        a_n, a_m, a_z = _search_step(
                            ss, _key_of(ss), lo, hi, piv2, peak64, a_n, a_m, a_z
                        )
                else:
                    for start in range(0, V, BLOCK):
                        s = _load_scaled(x_row, start + offs, V, temp)  # [BLOCK]
                        key = _key_of(s)
                        go = passes >= 0
                        if SBLOCK < BLOCK:
                            band = (key >= lo) & (key <= hi)
                            go = first | (tl.max(band.to(tl.int32), axis=0) > 0)
                        if go:
                            for sub in range(0, BLOCK, SBLOCK):
                                if SBLOCK < BLOCK:
                                    ss = _load_scaled(x_row, start + sub + soffs, V, temp)
                                    sk = _key_of(ss)  # [SBLOCK]
                                else:
                                    ss = s
                                    sk = key
                                a_n, a_m, a_z = _search_step(
                                    ss, sk, lo, hi, piv2, peak64, a_n, a_m, a_z
                                )
                if first:
                    z = tl.sum(a_z, axis=0)
                n_gt = n_hi + tl.sum(a_n & 65535, axis=1)  # [NP] count strictly above each
                n_eq = tl.sum(a_n >> 16, axis=1)  # [NP] count equal to each pivot
                m_gt = m_hi + tl.sum(a_m, axis=1)  # [NP] unnormalised mass strictly above
                q = (n_gt < kk) & (m_gt / z < pp64)
                q = (q & (c > 0)) | (c == NP - 1)
                new_lo = tl.max(tl.where(q, -2147483647 - 1, piv), axis=0)
                new_hi = tl.min(tl.where(q, piv, 2147483647), axis=0)
                gt_lo = tl.min(tl.where(q, 2147483647, n_gt), axis=0)
                ge_lo = tl.min(tl.where(q, 2147483647, n_gt + n_eq), axis=0)  # count >= new_lo
                ge_hi = tl.max(tl.where(q, n_gt + n_eq, 0), axis=0)
                # at new_hi: n_gt and m_gt fall with the pivot, so their largest over q
                n_hi = tl.max(tl.where(q, n_gt, 0), axis=0)
                m_hi = tl.max(tl.where(q, m_gt, 0.0), axis=0)
                inside = gt_lo - ge_hi
                use_value = (~by_value) | (4 * inside <= before)
                before = inside
                lo = new_lo
                hi = new_hi
                passes += 1
                if CAP > 0:
                    n_band = ge_lo - n_hi  # tokens with a key in [lo, hi]
                    if (n_buf < 0) & (inside > 0) & (n_band <= CAP):
                        n_buf = 0
                        for start in range(0, V, BLOCK):
                            s = _load_scaled(x_row, start + offs, V, temp)
                            key = _key_of(s)
                            band = (key >= lo) & (key <= hi)
                            nb = tl.sum(band.to(tl.int32), axis=0)
                            if nb > 0:
                                at = n_buf + tl.cumsum(band.to(tl.int32), axis=0) - 1
                                tl.store(buf_row + at, s, mask=band)
                                n_buf += nb
                        tl.debug_barrier()  # every warp's copy is in place before any reads it
                    elif (n_buf > SBLOCK) & (inside > 0) & (4 * n_band <= n_buf):
                        # the buffer's bracket shrank 4-fold: keep only [lo, hi], in place
                        # (a token moves only down; every warp reads a sub-step before any
                        # of them writes it)
                        n_keep = 0
                        for start in range(0, n_buf, SBLOCK):
                            idx = start + soffs
                            ss = tl.load(buf_row + idx, mask=idx < n_buf, other=NEG)
                            sk = _key_of(ss)
                            band = (sk >= lo) & (sk <= hi) & (idx < n_buf)
                            nb = tl.sum(band.to(tl.int32), axis=0)
                            tl.debug_barrier()
                            if nb > 0:
                                at = n_keep + tl.cumsum(band.to(tl.int32), axis=0) - 1
                                tl.store(buf_row + at, ss, mask=band)
                                n_keep += nb
                        n_buf = n_keep
                        tl.debug_barrier()
            thr_key = tl.where(search, hi, lo + 1)
        thr = tl.where(sample, _value_of(thr_key), peak)

        # last pass: inverse CDF of the kept mass in vocabulary order, float64. Each BLOCK step
        # holding a kept token adds its mass sum(exp(s - peak)) to its slot of w_steps; one
        # uniform picks the step where the running mass crosses u * total, and that step alone
        # is read again to find the token. One exp per kept column and one random number per
        # row (a Gumbel draw needs a Philox call and two float64 logs per column).
        steps = tl.arange(0, NS)
        w_steps = tl.zeros([NS], tl.float64)
        drawn = arg
        if sample:
            for start in range(0, V, BLOCK):
                cols = start + offs
                s = _load_scaled(x_row, cols, V, temp)
                keep = (s >= thr) & (cols < V)
                if tl.max(keep.to(tl.int32), axis=0) > 0:
                    w = tl.sum(tl.where(keep, tl.exp(s.to(tl.float64) - peak64), 0.0), axis=0)
                    w_steps = tl.where(steps == start // BLOCK, w, w_steps)
            cum = tl.cumsum(w_steps, axis=0)  # [NS] mass up to and including each step
            r0, r1, _, _ = tl.randint4x(tl.load(seed_ptr), row.to(tl.int32))
            u = ((r0 >> 5).to(tl.float64) * 67108864.0 + (r1 >> 6).to(tl.float64)) * (1.0 / 9007199254740992.0)  # fmt: skip
            target = u * tl.max(cum, axis=0)  # u in [0, 1): 53 random bits
            j = tl.min(tl.where(cum > target, steps, NS), axis=0)
            last = tl.max(tl.where(w_steps > 0.0, steps, 0), axis=0)
            j = tl.where(j >= NS, last, j)  # target rounded up to the total
            mass_before = tl.sum(tl.where(steps == j, cum - w_steps, 0.0), axis=0)
            cols = j * BLOCK + offs
            s = _load_scaled(x_row, cols, V, temp)
            keep = (s >= thr) & (cols < V)
            run = mass_before + tl.cumsum(tl.where(keep, tl.exp(s.to(tl.float64) - peak64), 0.0), axis=0)
            pick = tl.min(tl.where(keep & (run > target), cols, V), axis=0)
            fallback = tl.max(tl.where(keep, cols, -1), axis=0)  # rounding: the step's last kept
            drawn = tl.where(pick < V, pick, fallback)
            drawn = tl.where(drawn < 0, arg, drawn)
        tl.store(out_ptr + row, tl.where(sample, drawn, arg).to(tl.int64))
        tl.store(thr_ptr + row, thr)


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
    _sample_rows_kernel[(grid,)](
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
    :func:`verify_sampling_reference`; the walk is then lossless target sampling.
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


def target_probs_from_logits(
    logits: Tensor,
    temperature: Tensor | float,
    top_k: Tensor | int | None = None,
    top_p: Tensor | float | None = None,
    min_p: Tensor | float | None = None,
) -> Tensor:
    """Dense reference of :func:`sample_from_logits`: the filtered, renormalised distributions.

    Same semantics (SGLang's joint top-k/top-p rule on the unrenormalised probabilities, min-p
    relative to the largest probability, exact top_p = 1, greedy = one-hot at the first argmax),
    computed with a full sort and float64 masses. For tests and the CPU; it allocates several
    dense ``[..., V]`` tensors, so the verify uses :func:`sample_tree_targets` instead.

    Args:
        logits: ``[bs, N, V]`` (or ``[bs, V]``).
        temperature, top_k, top_p, min_p: a number or ``[bs]`` (one per request, shared by its N
            rows), as in :func:`sample_from_logits`.

    Returns float32 probabilities of the same shape.
    """
    squeeze = logits.dim() == 2
    x = logits.unsqueeze(1) if squeeze else logits
    bs, _, vocab = x.shape
    device = x.device
    temp, kk, pp, log_mp, greedy = (
        t.reshape(bs, 1, 1)
        for t in _sampling_rows(bs, vocab, device, temperature, top_k, top_p, min_p)
    )
    s = x.float() / temp + 0.0
    desc = torch.sort(s, dim=-1, descending=True).values
    prob = torch.softmax(desc.double(), dim=-1)
    # for every token: how many tokens, and how much mass, lie strictly above it
    n_gt = torch.searchsorted(-desc.contiguous(), -s.contiguous(), right=False)
    mass_before = torch.cat(
        [torch.zeros_like(prob[..., :1]), prob.cumsum(dim=-1)], dim=-1
    )
    m_gt = mass_before.gather(-1, n_gt)
    peak = desc[..., :1]
    keep = (n_gt < kk) & (m_gt < pp.double()) & (s >= peak + log_mp)
    p_all = torch.softmax(s.double(), dim=-1)
    kept = torch.where(keep, p_all, 0.0)
    kept = (kept / kept.sum(dim=-1, keepdim=True)).float()
    onehot = torch.zeros_like(s).scatter(-1, s.argmax(dim=-1, keepdim=True), 1.0)
    out = torch.where(greedy, onehot, kept)
    return out.squeeze(1) if squeeze else out


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


def tree_metrics(tree: DDTree, accept_len: Tensor | None = None) -> dict:
    """Debug statistics as Python numbers: tree shape and acceptance (if ``accept_len`` given)."""
    valid = tree.node_valid.detach().cpu()
    depth = tree.depth.detach().cpu()
    bs, _ = valid.shape
    max_depth = int(depth.max()) if depth.numel() else 0
    nodes = valid.sum(dim=1)
    width = [
        float(((depth == d) & valid).sum()) / bs if bs else 0.0
        for d in range(1, max_depth + 1)
    ]
    tree_depth = torch.where(valid, depth, 0).amax(dim=1) if bs else torch.zeros(0)
    out: dict = {
        "requests": bs,
        "mean_nodes": float(nodes.float().mean()) if bs else 0.0,
        "mean_tree_depth": float(tree_depth.float().mean()) if bs else 0.0,
        "max_tree_depth": int(tree_depth.max()) if bs else 0,
        "width_per_depth": width,
    }
    if accept_len is not None:
        acc = accept_len.detach().cpu().to(torch.int64)
        top = max(max_depth, int(acc.max()) if acc.numel() else 0)
        out["accept_hist"] = (
            torch.bincount(acc, minlength=top + 1).tolist() if acc.numel() else []
        )
        out["mean_accept_len"] = float(acc.float().mean()) if acc.numel() else 0.0
        out["mean_tokens_per_step"] = (
            out["mean_accept_len"] + 1.0 if acc.numel() else 0.0
        )
    return out


# ----------------------------------------------------------------------------------------------
# Sync-free round pieces for an overlapped scheduler (SGLang spec-v2 workers)
# ----------------------------------------------------------------------------------------------


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


if triton is not None:

    @triton.jit
    def _move_kv_rows_kernel(
        ptrs_ptr,  # [L] i64 buffer base addresses
        row_bytes_ptr,  # [L] i64 bytes per slot row
        tgt_ptr,  # [bs, K] i64 target slots
        src_ptr,  # [bs, K] i64 source slots
        K,
        KP: tl.constexpr,  # pow2 >= K
        TILE: tl.constexpr,
    ):
        # One program: one buffer, one request, one byte tile of its rows. It loads every
        # source row of its request before it stores any, so a request's moves may overlap
        # (a target that is another move's source) as long as requests do not share slots.
        buf = tl.program_id(0)
        req = tl.program_id(1)
        tile = tl.program_id(2)
        row = tl.load(row_bytes_ptr + buf)
        base = tl.load(ptrs_ptr + buf).to(tl.pointer_type(tl.uint8))
        off = tile * TILE + tl.arange(0, TILE)
        off = tl.multiple_of(off, 16)
        r = tl.arange(0, KP)
        live = r < K
        src = tl.load(src_ptr + req * K + r, mask=live, other=0)
        tgt = tl.load(tgt_ptr + req * K + r, mask=live, other=0)
        m = (live & (src != tgt))[:, None] & (off < row)[None, :]
        vals = tl.load(base + src[:, None] * row + off[None, :], mask=m)
        # Threads store what other threads load: every load of the program completes first.
        tl.debug_barrier()
        tl.store(base + tgt[:, None] * row + off[None, :], vals, mask=m)


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
        _move_kv_rows_kernel[(len(rows.buffers), bs, tiles)](
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
_TREE_ATTN_KEYS = 64  # keys per step
_TREE_ATTN_MAX_SPLITS = 16
_SM_COUNT: dict = {}


def tree_verify_attention_reference(
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
) -> Tensor:
    """The definition, request by request in float32 (for tests).

    Args:
        q: ``[bs * N, Hq, D]`` the tree tokens' queries (request-major, node order).
        k_buffer, v_buffer: ``[slots, Hkv, D]`` the KV cache holding each request's prefix.
        kv_indptr: ``[bs + 1]``; ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` are request
            ``b``'s prefix slots in order (``p_b`` of them).
        k_tree, v_tree: ``[bs * N, Hkv, D]`` the tree tokens' keys and values.
        mask: flat bool, SGLang's FULL custom mask: request ``b``'s row ``i`` starts at
            ``mask_indptr[b] + i * (p_b + N)``; its first ``p_b`` entries (the prefix) are not
            read (every node sees the whole prefix), entry ``p_b + j`` allows tree token ``j``.
        n: ``N``; sm_scale: the softmax scale.

    Returns ``[bs * N, Hq, D]`` in ``q``'s dtype.
    """
    bs = kv_indptr.numel() - 1
    hq, hkv = q.shape[1], k_tree.shape[1]
    g = hq // hkv
    out = torch.empty_like(q)
    for b in range(bs):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        p = hi - lo
        slots = kv_indices[lo:hi].long()
        keys = torch.cat([k_buffer[slots], k_tree[b * n : (b + 1) * n]]).float()  # [p+N, Hkv, D]
        vals = torch.cat([v_buffer[slots], v_tree[b * n : (b + 1) * n]]).float()
        start = int(mask_indptr[b])
        rows = torch.arange(n, device=mask.device).view(n, 1) * (p + n) + p
        tree = mask[start + rows + torch.arange(n, device=mask.device).view(1, n)].bool()
        allowed = torch.cat([torch.ones(n, p, dtype=torch.bool, device=mask.device), tree], 1)
        qb = q[b * n : (b + 1) * n].float()  # [N, Hq, D]
        kk = keys.repeat_interleave(g, dim=1)  # [p+N, Hq, D]
        vv = vals.repeat_interleave(g, dim=1)
        s = torch.einsum("nhd,khd->hnk", qb, kk) * sm_scale
        s = s.masked_fill(~allowed.unsqueeze(0), float("-inf"))
        out[b * n : (b + 1) * n] = torch.einsum("hnk,khd->nhd", s.softmax(-1), vv).to(q.dtype)
    return out


if triton is not None:

    @triton.jit
    def _tree_attn_load_q(q_ptr, b, kvh, rb, N, G, q_s0, q_s1, D, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        """Rows rb * BLOCK_R + [0, BLOCK_R) of KV head kvh: row r = node r // G, head r % G."""
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        node = r // G
        head = kvh * G + r % G
        d = tl.arange(0, BLOCK_D)
        live = r < N * G
        ptrs = q_ptr + (b * N + node)[:, None] * q_s0 + head[:, None] * q_s1 + d[None, :]
        q = tl.load(ptrs, mask=live[:, None] & (d[None, :] < D), other=0.0)
        return q, r, node, head, live

    @triton.jit
    def _tree_attn_step(q, k, v, allowed, sm_scale, m, acc_l, acc):
        """One online-softmax step over a block of keys: scores of the allowed (row, key)
        pairs, running max m, sum acc_l and unnormalised output acc (rows with no allowed
        key so far stay at -inf / 0)."""
        sc = tl.dot(q, tl.trans(k.to(q.dtype))) * sm_scale
        sc = tl.where(allowed, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        live = m_new > float("-inf")
        alpha = tl.where(live, tl.exp(m - m_new), 1.0)
        p = tl.where(live[:, None], tl.exp(sc - m_new[:, None]), 0.0)
        acc_l = acc_l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, acc_l, acc

    @triton.jit
    def _tree_attn_finish(m, acc_l, acc):
        """(normalised output, log-sum-exp) of an online softmax; -inf for rows without keys."""
        has = acc_l > 0
        lse = tl.where(has, m + tl.log(tl.where(has, acc_l, 1.0)), float("-inf"))
        return acc / tl.where(has, acc_l, 1.0)[:, None], lse

    @triton.jit
    def _tree_attn_prefix_kernel(
        q_ptr, k_ptr, v_ptr,  # q [bs*N, Hq, D]; k/v cache [slots, Hkv, D]
        indptr_ptr, indices_ptr,  # [bs+1] i32/i64; [*] slots
        ws_o_ptr, ws_lse_ptr,  # [bs, Hkv, RB, S, BLOCK_R, BLOCK_D] f32; [bs, Hkv, RB, S, BLOCK_R] f32
        N, G, D, S, RB,
        q_s0, q_s1, k_s0, k_s1, v_s0, v_s1,
        sm_scale,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program: request b, KV head kvh, row block rb, prefix split s. Writes the split's
        # normalised partial output and its log-sum-exp (-inf for an empty split).
        b = tl.program_id(0)
        kvh = tl.program_id(1) // RB
        rb = tl.program_id(1) % RB
        s = tl.program_id(2)
        Hkv = tl.num_programs(1) // RB
        q = _tree_attn_load_q(q_ptr, b, kvh, rb, N, G, q_s0, q_s1, D, BLOCK_R, BLOCK_D)[0]
        d = tl.arange(0, BLOCK_D)
        start = tl.load(indptr_ptr + b).to(tl.int64)
        plen = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
        per = tl.cdiv(plen, S)
        lo = s * per
        hi = tl.minimum(lo + per, plen)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        acc_l = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            cols = k0 + tl.arange(0, BLOCK_N)
            cm = cols < hi
            slot = tl.load(indices_ptr + start + cols, mask=cm, other=0).to(tl.int64)
            kmask = cm[:, None] & (d[None, :] < D)
            k = tl.load(k_ptr + slot[:, None] * k_s0 + kvh * k_s1 + d[None, :], mask=kmask, other=0.0)
            v = tl.load(v_ptr + slot[:, None] * v_s0 + kvh * v_s1 + d[None, :], mask=kmask, other=0.0)
            m, acc_l, acc = _tree_attn_step(q, k, v, cm[None, :], sm_scale, m, acc_l, acc)
        base = ((b * Hkv + kvh) * RB + rb) * S + s
        rows = tl.arange(0, BLOCK_R)
        o, lse = _tree_attn_finish(m, acc_l, acc)
        tl.store(ws_lse_ptr + base * BLOCK_R + rows, lse)
        tl.store(ws_o_ptr + (base * BLOCK_R + rows)[:, None] * BLOCK_D + d[None, :], o)

    @triton.jit
    def _tree_attn_tree_kernel(
        q_ptr, kt_ptr, vt_ptr,  # q [bs*N, Hq, D]; tree k/v [bs*N, Hkv, D]
        indptr_ptr, mask_ptr, mask_indptr_ptr,  # prefix lengths; FULL mask (bool); [bs+1]
        ws_o_ptr, ws_lse_ptr, o_ptr,  # prefix partials; out [bs*N, Hq, D]
        N, G, D, S, RB,
        q_s0, q_s1, kt_s0, kt_s1, vt_s0, vt_s1, o_s0, o_s1,
        sm_scale,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program: request b, KV head kvh, row block rb. The tree block under the ancestor
        # mask (a node always sees itself, so every row has a live key), then the merge with the
        # S prefix partials.
        b = tl.program_id(0)
        kvh = tl.program_id(1) // RB
        rb = tl.program_id(1) % RB
        Hkv = tl.num_programs(1) // RB
        q, _, node, head, live = _tree_attn_load_q(
            q_ptr, b, kvh, rb, N, G, q_s0, q_s1, D, BLOCK_R, BLOCK_D
        )
        d = tl.arange(0, BLOCK_D)
        plen = (tl.load(indptr_ptr + b + 1) - tl.load(indptr_ptr + b)).to(tl.int64)
        row0 = tl.load(mask_indptr_ptr + b).to(tl.int64) + node.to(tl.int64) * (plen + N) + plen
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        acc_l = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        for j0 in range(0, N, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < N
            tok = (b * N + j).to(tl.int64)
            kmask = jm[:, None] & (d[None, :] < D)
            k = tl.load(kt_ptr + tok[:, None] * kt_s0 + kvh * kt_s1 + d[None, :], mask=kmask, other=0.0)
            v = tl.load(vt_ptr + tok[:, None] * vt_s0 + kvh * vt_s1 + d[None, :], mask=kmask, other=0.0)
            allow = tl.load(mask_ptr + row0[:, None] + j[None, :], mask=live[:, None] & jm[None, :], other=0)
            m, acc_l, acc = _tree_attn_step(q, k, v, allow != 0, sm_scale, m, acc_l, acc)
        out, lse_t = _tree_attn_finish(m, acc_l, acc)
        # merge: out = sum_k exp(lse_k - LSE) o_k over the tree part and the S prefix splits
        top = lse_t
        base = ((b * Hkv + kvh) * RB + rb) * S
        rows = tl.arange(0, BLOCK_R)
        for s in range(S):
            top = tl.maximum(top, tl.load(ws_lse_ptr + (base + s) * BLOCK_R + rows))
        w = tl.exp(lse_t - top)
        total = w
        out = out * w[:, None]
        for s in range(S):
            lse_s = tl.load(ws_lse_ptr + (base + s) * BLOCK_R + rows)
            w_s = tl.exp(lse_s - top)
            o_s = tl.load(ws_o_ptr + ((base + s) * BLOCK_R + rows)[:, None] * BLOCK_D + d[None, :])
            out += o_s * w_s[:, None]
            total += w_s
        out = out / total[:, None]
        optr = o_ptr + (b * N + node)[:, None] * o_s0 + head[:, None] * o_s1 + d[None, :]
        tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=live[:, None] & (d[None, :] < D))


def tree_verify_splits(bs: int, kv_heads: int, row_blocks: int, device: torch.device) -> int:
    """Prefix splits per (request, KV head, row block): enough programs for about two waves
    of the device's SMs, at most ``_TREE_ATTN_MAX_SPLITS`` (host arithmetic; a CUDA graph of
    a given batch size always gets the same number)."""
    key = str(device)
    if key not in _SM_COUNT:
        _SM_COUNT[key] = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 8
        )
    programs = max(1, bs * kv_heads * row_blocks)
    return max(1, min(_TREE_ATTN_MAX_SPLITS, -(-2 * _SM_COUNT[key] // programs)))


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
) -> Tensor:
    """Attention of a tree verify, as :func:`tree_verify_attention_reference` (same arguments),
    with two Triton kernels and no host sync (capturable in a CUDA graph): split-KV over the
    prefix, then the masked tree block and a log-sum-exp merge. ``out``: ``[bs * N, Hq, D]``
    to write into (else allocated); ``splits``: prefix splits (default
    :func:`tree_verify_splits`). Needs Triton (CUDA, or the CPU under ``TRITON_INTERPRET=1``).
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
    g = hq // hkv
    rb = -(-(n * g) // _TREE_ATTN_ROWS)
    s = splits or tree_verify_splits(bs, hkv, rb, q.device)
    bd = max(16, _pow2(dim))  # tl.dot needs K >= 16
    if out is None:
        out = torch.empty_like(q)
    if bs == 0:
        return out
    ws_o = torch.empty((bs, hkv, rb, s, _TREE_ATTN_ROWS, bd), dtype=torch.float32, device=q.device)
    ws_lse = torch.empty((bs, hkv, rb, s, _TREE_ATTN_ROWS), dtype=torch.float32, device=q.device)
    common = {"BLOCK_R": _TREE_ATTN_ROWS, "BLOCK_N": _TREE_ATTN_KEYS, "BLOCK_D": bd, "num_warps": 4}
    _tree_attn_prefix_kernel[(bs, hkv * rb, s)](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, ws_o, ws_lse,
        n, g, dim, s, rb,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        float(sm_scale), **common,
    )  # fmt: skip
    _tree_attn_tree_kernel[(bs, hkv * rb)](
        q, k_tree, v_tree, kv_indptr, mask, mask_indptr, ws_o, ws_lse, out,
        n, g, dim, s, rb,
        q.stride(0), q.stride(1), k_tree.stride(0), k_tree.stride(1),
        v_tree.stride(0), v_tree.stride(1), out.stride(0), out.stride(1),
        float(sm_scale), **common,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Serving limits: server-argument numbers derived from the budget (shared by every pin)
# ----------------------------------------------------------------------------------------------
# Plain integer arithmetic on the values SGLang's server args and memory plan hold; the patches
# of each pin call these, so the rules stay the same across pins. Units are tokens (= KV slots
# at page size 1) unless a name says bytes.

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
    if repetition_penalty != 1.0:
        return f"repetition_penalty={repetition_penalty}"
    if frequency_penalty != 0.0:
        return f"frequency_penalty={frequency_penalty}"
    if presence_penalty != 0.0:
        return f"presence_penalty={presence_penalty}"
    if min_new_tokens and min_new_tokens > 0:
        return f"min_new_tokens={min_new_tokens}"
    if sampling_seed is not None:
        return f"sampling_seed={sampling_seed}"
    if custom_logit_processor:
        return "custom_logit_processor"
    return None
