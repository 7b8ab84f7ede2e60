#!/usr/bin/env python3
"""Probe of upstream DFLASH's sampling verify on a mixed greedy + sampled batch (GPU).

Upstream DFLASH stalls on a mixed batch (vocab 32, greedy and T 0.7 / top-p 0.9 requests
together). A mixed batch is the only one where the verify takes the dense top-k path with
per-row k in {1, TOP_K_ALL}: the batch's max top_k is TOP_K_ALL (clamped to the vocab), so
build_dflash_verify_target_probs calls top_k_renorm_prob(probs, [1, 1 << 30, ...]).
This script runs the installed sglang's own functions on such inputs and on the all-sampled
and all-greedy-as-sampled controls, and reports for each: NaN / zero rows in the target
probabilities, their distance from a torch reference, and the accept lengths and bonus ids
(range, -1 / garbage) the chain kernel returns. One JSON line per case; exit 0 always.

  PYTHONPATH=/tmp/site python3 tests/gpu/probe_dflash_mixed.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

TOP_K_ALL = 1 << 30


def reference_probs(logits, temps, top_ks, top_ps):
    """top-k first, renormalise, then top-p (SGLang's order), dense torch."""
    scaled = logits.float() / temps[:, None]
    probs = torch.softmax(scaled, -1)
    out = torch.zeros_like(probs)
    for i in range(probs.shape[0]):
        k = min(int(top_ks[i]), probs.shape[1])
        v, idx = torch.sort(probs[i], descending=True)
        v = v[:k] / v[:k].sum()
        before = torch.cumsum(v, 0) - v
        keep = (before < float(top_ps[i])) | (torch.arange(k, device=v.device) == 0)
        v = torch.where(keep, v, 0.0)
        out[i, idx[:k]] = v / v.sum()
    return out


def case(name, rows_greedy, bs=8, block=16, vocab=32, seed=0):
    from sglang.srt.speculative.dflash_utils import (
        build_dflash_verify_target_probs,
        compute_dflash_sampling_correct_drafts_and_bonus,
    )

    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn((bs * block, vocab), device="cuda", generator=g).to(torch.bfloat16).float()
    greedy = torch.tensor(rows_greedy(bs), device="cuda")
    temps = torch.where(greedy, 1.0, 0.7).float()
    top_ks = torch.where(greedy, 1, TOP_K_ALL).to(torch.int32)
    top_ps = torch.where(greedy, 1.0, 0.9).float()
    info = SimpleNamespace(
        temperatures=temps.view(-1, 1),
        top_ks=top_ks,
        top_ps=top_ps,
        is_all_greedy=bool(greedy.all()),
        need_top_k_sampling=bool((top_ks != TOP_K_ALL).any()),
        need_top_p_sampling=bool((top_ps != 1.0).any()),
    )
    rec = {"case": name, "greedy_rows": int(greedy.sum()), "bs": bs}
    max_top_k = int(top_ks.max())  # what DFlashDraftInputV2.prepare_for_decode passes
    try:
        probs = build_dflash_verify_target_probs(
            next_token_logits=logits.clone(),
            sampling_info=info,
            draft_token_num=block,
            bs=bs,
            max_top_k=max_top_k,
            uniform_top_k_value=None if greedy.any() and not greedy.all() else int(top_ks[0]),
        ).view(bs * block, vocab)
        torch.cuda.synchronize()
        ref = reference_probs(
            logits,
            temps.repeat_interleave(block),
            top_ks.repeat_interleave(block),
            top_ps.repeat_interleave(block),
        )
        rec["nan_rows"] = int(torch.isnan(probs).any(-1).sum())
        rec["zero_rows"] = int((probs.sum(-1) == 0).sum())
        rec["max_abs_diff_vs_ref"] = float((probs - ref).abs().max())
        cand = torch.randint(0, vocab, (bs, block), device="cuda", generator=g)
        accept, bonus = compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=cand,
            next_token_logits=logits.clone(),
            sampling_info=info,
            max_top_k=max_top_k,
            uniform_top_k_value=None,
            threshold_single=1.0,
            threshold_acc=1.0,
        )
        torch.cuda.synchronize()
        rec["accept_min"], rec["accept_max"] = int(accept.min()), int(accept.max())
        rec["bonus_min"], rec["bonus_max"] = int(bonus.min()), int(bonus.max())
        rec["bonus_out_of_vocab"] = int(((bonus < 0) | (bonus >= vocab)).sum())
    except Exception as e:  # noqa: BLE001 - the probe reports whatever happens
        rec["error"] = repr(e)[:300]
    print(json.dumps(rec), flush=True)


def main() -> int:
    case("mixed", lambda bs: [i % 2 == 0 for i in range(bs)])
    case("all_sampled", lambda bs: [False] * bs)
    case("one_greedy", lambda bs: [i == 0 for i in range(bs)])
    case("all_greedy_rows_in_sampling_path", lambda bs: [True] * bs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
