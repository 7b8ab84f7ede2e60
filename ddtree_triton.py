"""Triton kernels of ddtree_utils: draft-tree build and compile, the log-sum-exp partials of
the draft top-k, target sampling, the KV row move and the tree-verify attention.

Only Triton (no torch import): ddtree_utils imports this module when Triton imports (every CUDA
build of torch installs it) and launches the kernels; what each computes, its arguments and its
grid are documented at its launcher there (``_build_tree_triton``, ``_compile_tree_triton``,
``_logsumexp_triton``, ``_sample_rows_triton``, ``move_kv_rows``, ``tree_verify_attention``).
Shipped next to it as ``sglang/srt/speculative/ddtree_triton.py``. The kernels are compiled
ahead of time for the GPU targets by tests/triton_aot.py and run on the CPU under
``TRITON_INTERPRET=1`` by the ddtree_utils tests.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "ddtree_build_kernel",
    "ddtree_compile_kernel",
    "move_kv_rows_kernel",
    "sample_rows_kernel",
    "sumexp_partial_kernel",
    "tree_attn_prefix_kernel",
    "tree_attn_tree_kernel",
]



# ----------------------------------------------------------------------------------------------
# Draft tree: build and compile (one program per request)
# ----------------------------------------------------------------------------------------------
#
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


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)

@triton.jit
def ddtree_build_kernel(
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
def ddtree_compile_kernel(
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
def sumexp_partial_kernel(
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


# ----------------------------------------------------------------------------------------------
# Target sampling (module comment of ddtree_utils' sampling section)
# ----------------------------------------------------------------------------------------------


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
def sample_rows_kernel(
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


# ----------------------------------------------------------------------------------------------
# KV row move
# ----------------------------------------------------------------------------------------------


@triton.jit
def move_kv_rows_kernel(
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


# ----------------------------------------------------------------------------------------------
# Tree-verify attention: split-KV prefix, masked tree block, merge
# ----------------------------------------------------------------------------------------------


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
def _tree_attn_splits(plen, S, MINK):
    """(keys per split, splits used) of a prefix of plen keys: S splits, or fewer of at least
    MINK keys each when the prefix is short (none for an empty prefix)."""
    per = tl.maximum(tl.cdiv(plen, S), MINK)
    return per, tl.cdiv(plen, per)

@triton.jit
def tree_attn_prefix_kernel(
    q_ptr, k_ptr, v_ptr,  # q [bs*N, Hq, D]; k/v cache [slots, Hkv, D]
    indptr_ptr, indices_ptr,  # [bs+1] i32/i64; [*] slots
    ws_o_ptr, ws_lse_ptr,  # [bs, Hkv, RB, S, BLOCK_R, BLOCK_D] f32; [bs, Hkv, RB, S, BLOCK_R] f32
    N, G, D, S, RB, MINK,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1,
    sm_scale,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: request b, KV head kvh, row block rb, prefix split s. Writes the split's
    # normalised partial output and its log-sum-exp. The prefix is cut into splits of at least
    # MINK keys (_tree_attn_splits), so a short prefix uses fewer than S; a program past them
    # returns at once, and the merge does not read its slot.
    b = tl.program_id(0)
    kvh = tl.program_id(1) // RB
    rb = tl.program_id(1) % RB
    s = tl.program_id(2)
    Hkv = tl.num_programs(1) // RB
    start = tl.load(indptr_ptr + b).to(tl.int64)
    plen = tl.load(indptr_ptr + b + 1).to(tl.int64) - start
    per, used = _tree_attn_splits(plen, S, MINK)
    if s >= used:
        return
    q = _tree_attn_load_q(q_ptr, b, kvh, rb, N, G, q_s0, q_s1, D, BLOCK_R, BLOCK_D)[0]
    d = tl.arange(0, BLOCK_D)
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
def tree_attn_tree_kernel(
    q_ptr, kt_ptr, vt_ptr,  # q [bs*N, Hq, D]; tree k/v [bs*N, Hkv, D]
    indptr_ptr, mask_ptr, mask_indptr_ptr,  # prefix lengths; FULL mask (bool); [bs+1]
    ws_o_ptr, ws_lse_ptr, o_ptr,  # prefix partials; out [bs*N, Hq, D]
    N, G, D, S, RB, MINK,
    q_s0, q_s1, kt_s0, kt_s1, vt_s0, vt_s1, o_s0, o_s1,
    sm_scale,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: request b, KV head kvh, row block rb. The tree block under the ancestor
    # mask (a node always sees itself, so every row has a live key), then the merge with the
    # prefix partials.
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
    # merge: out = sum_k exp(lse_k - LSE) o_k over the tree part and the prefix splits the
    # prefix kernel wrote (`used` of the S slots)
    used = _tree_attn_splits(plen, S, MINK)[1]
    top = lse_t
    base = ((b * Hkv + kvh) * RB + rb) * S
    rows = tl.arange(0, BLOCK_R)
    for s in range(used):
        top = tl.maximum(top, tl.load(ws_lse_ptr + (base + s) * BLOCK_R + rows))
    w = tl.exp(lse_t - top)
    total = w
    out = out * w[:, None]
    for s in range(used):
        lse_s = tl.load(ws_lse_ptr + (base + s) * BLOCK_R + rows)
        w_s = tl.exp(lse_s - top)
        o_s = tl.load(ws_o_ptr + ((base + s) * BLOCK_R + rows)[:, None] * BLOCK_D + d[None, :])
        out += o_s * w_s[:, None]
        total += w_s
    out = out / total[:, None]
    optr = o_ptr + (b * N + node)[:, None] * o_s0 + head[:, None] * o_s1 + d[None, :]
    tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=live[:, None] & (d[None, :] < D))
