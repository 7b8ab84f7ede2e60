"""Oracles of ddtree_utils, for tests, benchmarks and gate 6 only (never shipped into a build).

* :func:`build_tree_reference`: the paper's best-first heap, one request at a time on the CPU;
  ``ddtree_utils.build_tree`` (torch ops and the Triton kernel) equals it bit for bit.
* :func:`verify_sampling_reference`: the lossless sampling walk from dense target
  distributions (or given draws).
* :func:`target_probs_from_logits`: the dense filtered distributions that
  ``ddtree_utils.sample_from_logits`` draws from without materialising them.
* :func:`tree_verify_attention_reference`: the definition of ``ddtree_utils.tree_verify_attention``
  in float32, request by request.
* :func:`tree_metrics`: tree shape and acceptance statistics as Python numbers.

Depends on torch, the standard library and ddtree_utils (whose vocabulary it uses: ``bs``, ``L``,
``K``, ``B``, ``N``, verify indices; see its module docstring).
"""

from __future__ import annotations

import heapq
import struct

import torch
from torch import Tensor

from ddtree_utils import (
    DDTree,
    _check_tree_inputs,
    _effective_k,
    _empty_tree,
    _sampling_rows,
    _walk,
)

__all__ = [
    "build_tree_reference",
    "target_probs_from_logits",
    "tree_metrics",
    "tree_verify_attention_reference",
    "verify_sampling_reference",
]

_NEG_INF = float("-inf")


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
