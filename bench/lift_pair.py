#!/usr/bin/env python3
"""Lift a trained tiny pair (bench/train_tiny_pair.py) into a pair of a real model's shape that
computes the same function.

    python3 bench/lift_pair.py --pair PAIR --out OUT [--shape qwen3-8b] [--device cuda]

PAIR holds ``target/`` (Qwen3ForCausalLM, tied or untied), ``draft/`` (DFlashDraftModel) and
optionally ``prompts.jsonl`` / ``eval.json`` (copied). OUT gets ``target/`` (Qwen3-8B shape: 36
layers, hidden 4096, 32 query / 8 KV heads, head_dim 128, MLP 12288, untied, vocab 151936),
``draft/`` (DFlash of the same width, 5 layers, 5 context features, MLP 12288), both as
safetensors (sharded with an index above ``--shard-gb``) + config.json + the small tokenizer, and
``lift.json`` (where each trained piece went and the scale factors).

How the trained weights sit in the big model (small: h, d, nh, nkv, i, L; big: H, D, NH, NKV, I, L'):

* **Residual stream.** Small x in R^h is big X = c * [x, 0] (zero padding). Every writer
  (embedding, o_proj, down_proj) writes c * its small output in the first h coordinates; every
  reader reads only those. c is chosen for the RMSNorms below (c = sqrt(H/h) when eps is kept).
* **RMSNorm and eps.** Over the padded width, mean(X^2) = c^2 (h/H) mean(x^2). So
  RMSNorm_H(X; eps') = [sqrt(H/h) x / sqrt(mean(x^2) + eps'/(c^2 h/H)), 0]: with
  c^2 = eps' H / (eps h) the small eps is reproduced exactly whatever eps' the big config keeps,
  and weights sqrt(h/H) * w give back the small output y in the first h coordinates. The config
  has one eps for the hidden norms (width h -> H) and the per-head q_norm / k_norm (d -> D), whose
  ratios differ (256/4096 vs 64/128); the head norms get their own input scale s with
  s^2 = eps' D / (eps d), folded into q_proj / k_proj. So eps' is free (default: the small eps,
  Qwen3-8B's 1e-6).
* **Attention.** The logit scale 1/sqrt(D) replaces 1/sqrt(d): q_norm's weight is multiplied by
  sqrt(D/d) on top (so q_norm = w_q and k_norm = sqrt(d/D) w_k when eps is kept). V is zero padded.
  Small KV group g is big KV group g; small query head j (group j // rep) is big head
  (j // rep) * REP + j % rep. The other big heads have zero q/k/v rows and zero o_proj columns.
* **RoPE.** Qwen3 rotates coordinates (p, p + d/2) with frequency theta^(-2p/d). Small pair p goes
  to big pair P = p * D/d (D/d an integer) with the same theta: theta^(-2P/D) = theta^(-2p/d),
  bit for bit (2P/D and 2p/d are the same dyadic fraction). The config keeps the small theta.
* **MLP.** gate/up rows and down columns zero padded (silu(0) * 0 = 0), down_proj times c.
* **Layers.** Trained layer k sits at big layer floor(k L'/L); the others are extra layers:
  q/k/v/gate/up seeded random (std 0.02, real work), o_proj and down_proj zero, so they add
  nothing to the residual stream but cost a real layer's compute.
* **Drafter.** Same width rules (its residual stream starts from the target's embedding, so the
  same c). Small context layer s (residual after layer s) is read at a big layer K with
  m(s) <= K < m(s+1) (the residual there is unchanged); the public 8B drafters' ids
  [1, 9, 17, 25, 33] are used where they fall in those ranges. The big fc has one block per big
  feature id: the small block where the id carries a small feature, zeros elsewhere (so the
  feature capture and fc cost what a 5-feature drafter costs). fc keeps the small weights: its
  input and its output (read by hidden_norm) both carry the factor c.
* **Vocabulary.** Rows are copied; columns zero padded. The big vocabulary must equal the small
  one: train the pair with ``--vocab-size 151936`` (train_tiny_pair.py), so the rows the tokenizer
  never emits are learned unlikely and sampling over the full vocabulary is the small model's.
  ``--pad-vocab`` pads with zero rows instead (logit 0 for every extra token: NOT the small
  model's distribution; for cost-only runs).

All factors are computed in float64 and applied in float32; the saved dtype (``--dtype``,
bfloat16 by default) rounds them unless they are powers of two (lift.json says
``exact_in_saved_dtype``): with h=256 -> 4096 and d=32 -> 128 (or d=128) every factor is one.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "use_cache": True,
}
# the public Qwen3-8B DFlash drafters (z-lab Qwen3-8B-DFlash-b16, SpecForge qwen3-8b-dflash): 5 layers
# of the target's width, MLP 12288, 5 context features
QWEN3_8B_DRAFT = {"num_hidden_layers": 5, "intermediate_size": 12288, "num_context_features": 5}
SHAPES = {"qwen3-8b": (QWEN3_8B, QWEN3_8B_DRAFT)}

LAYER_KEYS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
              "mlp.up_proj.weight", "mlp.down_proj.weight")


def log(msg: str) -> None:
    print(f"[lift_pair {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The DFlash default context layers: [T // 2] for one, else n ids evenly rounded over [1, T-3]."""
    if n == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + k * (hi - lo) / (n - 1))) for k in range(n)]


def placement(n_small: int, n_big: int) -> list[int]:
    """Big layer index of each trained layer: floor(k * n_big / n_small) (increasing, starts at 0)."""
    if n_big < n_small:
        raise ValueError(f"cannot lift {n_small} layers into {n_big}")
    return [k * n_big // n_small for k in range(n_small)]


def feature_ids(small_ids: list[int], place: list[int], n_big_layers: int, n_feat: int) -> tuple[list[int], dict[int, int]]:
    """Big context-layer ids (sorted, unique, <= L'-2, at least n_feat of them) and, for each small
    id, the big id that carries its feature: one K with place[s] <= K < place[s+1], a public
    default id when one falls there."""
    pref = default_layer_ids(n_big_layers, n_feat)
    chosen: dict[int, int] = {}
    for s in small_ids:
        if not 0 <= s <= len(place) - 2:
            raise ValueError(f"small target_layer_id {s} must be in 0..{len(place) - 2}")
        lo, hi = place[s], min(place[s + 1] - 1, n_big_layers - 2)
        fit = [f for f in pref if lo <= f <= hi and f not in chosen.values()]
        chosen[s] = fit[0] if fit else lo
    ids = set(chosen.values())
    for f in pref + list(range(n_big_layers - 1)):
        if len(ids) >= n_feat:
            break
        ids.add(f)
    return sorted(ids), chosen


class Lifter:
    """The mapping from a small Qwen3 (h, d, heads) to a big one; ``lift_layer`` turns one small
    layer's tensors (HF names without the prefix) into the big layer's, or makes an extra layer."""

    def __init__(self, small: dict, big: dict, eps_big: float, device: str, seed: int) -> None:
        self.h, self.H = small["hidden_size"], big["hidden_size"]
        self.d, self.D = small["head_dim"], big["head_dim"]
        self.nh, self.NH = small["num_attention_heads"], big["num_attention_heads"]
        self.nkv, self.NKV = small["num_key_value_heads"], big["num_key_value_heads"]
        self.eps, self.eps_big = float(small["rms_norm_eps"]), float(eps_big)
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        rep, REP = self.nh // self.nkv, self.NH // self.NKV
        checks = [(self.h <= self.H, "hidden"), (self.nkv <= self.NKV, "KV heads"), (rep <= REP, "query heads per KV group"),
                  (self.D % self.d == 0 and self.d % 2 == 0, "head_dim (D/d must be an integer)"),
                  (self.nh % self.nkv == 0 and self.NH % self.NKV == 0, "GQA groups")]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"cannot lift: {what} (small {small}, big {big})")
        r_h, r_d = self.h / self.H, self.d / self.D
        self.c = math.sqrt(self.eps_big / (self.eps * r_h))  # residual-stream scale
        self.s = math.sqrt(self.eps_big / (self.eps * r_d))  # q/k projection scale before the head norms
        self.w_hidden = math.sqrt(r_h)  # hidden RMSNorm weight factor
        self.w_q = math.sqrt(r_d) * math.sqrt(self.D / self.d)  # q_norm: undo the width, then 1/sqrt(d) -> 1/sqrt(D)
        self.w_k = math.sqrt(r_d)
        # head placement: small q head j -> big head (j // rep) * REP + j % rep; kv head g -> g
        self.q_heads = [(j // rep) * REP + j % rep for j in range(self.nh)]
        self.kv_heads = list(range(self.nkv))
        # coordinates inside a head: small p (< d/2) -> p * D/d, small d/2 + p -> D/2 + p * D/d
        k = self.D // self.d
        half = self.d // 2
        self.head_coords = torch.tensor([p * k for p in range(half)] + [self.D // 2 + p * k for p in range(half)])

    def factors(self) -> dict:
        return {"residual_scale": self.c, "qk_proj_scale": self.s, "hidden_norm_weight": self.w_hidden,
                "q_norm_weight": self.w_q, "k_norm_weight": self.w_k, "eps_small": self.eps, "eps_big": self.eps_big}

    def _t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, torch.float32)

    def rows_of_heads(self, heads: list[int]) -> torch.Tensor:
        """Big output rows of a per-head projection for the small heads' coordinates, in small order."""
        return torch.cat([h * self.D + self.head_coords for h in heads]).to(self.device)

    def hidden_norm(self, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.H, device=self.device)
        out[: self.h] = self._t(w) * self.w_hidden
        return out

    def head_norm(self, w: torch.Tensor, factor: float) -> torch.Tensor:
        out = torch.zeros(self.D, device=self.device)
        out[self.head_coords.to(self.device)] = self._t(w) * factor
        return out

    def proj_in(self, w: torch.Tensor, heads: list[int], n_heads_big: int, scale: float) -> torch.Tensor:
        """q/k/v_proj [heads * d, h] -> [n_heads_big * D, H]."""
        out = torch.zeros(n_heads_big * self.D, self.H, device=self.device)
        out[self.rows_of_heads(heads), : self.h] = self._t(w) * scale
        return out

    def o_proj(self, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.H, self.NH * self.D, device=self.device)
        out[: self.h, self.rows_of_heads(self.q_heads)] = self._t(w) * self.c
        return out

    def mlp(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, inter_big: int) -> tuple:
        i = gate.shape[0]
        if i > inter_big:
            raise ValueError(f"cannot lift intermediate {i} into {inter_big}")
        g = torch.zeros(inter_big, self.H, device=self.device)
        u = torch.zeros(inter_big, self.H, device=self.device)
        dn = torch.zeros(self.H, inter_big, device=self.device)
        g[:i, : self.h], u[:i, : self.h] = self._t(gate), self._t(up)
        dn[: self.h, :i] = self._t(down) * self.c
        return g, u, dn

    def lift_layer(self, sd: dict, inter_big: int) -> dict:
        g, u, dn = self.mlp(sd["mlp.gate_proj.weight"], sd["mlp.up_proj.weight"], sd["mlp.down_proj.weight"], inter_big)
        return {
            "input_layernorm.weight": self.hidden_norm(sd["input_layernorm.weight"]),
            "post_attention_layernorm.weight": self.hidden_norm(sd["post_attention_layernorm.weight"]),
            "self_attn.q_proj.weight": self.proj_in(sd["self_attn.q_proj.weight"], self.q_heads, self.NH, self.s),
            "self_attn.k_proj.weight": self.proj_in(sd["self_attn.k_proj.weight"], self.kv_heads, self.NKV, self.s),
            "self_attn.v_proj.weight": self.proj_in(sd["self_attn.v_proj.weight"], self.kv_heads, self.NKV, 1.0),
            "self_attn.o_proj.weight": self.o_proj(sd["self_attn.o_proj.weight"]),
            "self_attn.q_norm.weight": self.head_norm(sd["self_attn.q_norm.weight"], self.w_q),
            "self_attn.k_norm.weight": self.head_norm(sd["self_attn.k_norm.weight"], self.w_k),
            "mlp.gate_proj.weight": g, "mlp.up_proj.weight": u, "mlp.down_proj.weight": dn,
        }

    def extra_layer(self, inter_big: int, std: float = 0.02) -> dict:
        """A layer that passes the residual stream through: real q/k/v/gate/up work, zero o/down."""
        H, D = self.H, self.D

        def rnd(*shape):
            return torch.randn(*shape, generator=self.gen, device=self.device) * std

        return {
            "input_layernorm.weight": torch.ones(H, device=self.device),
            "post_attention_layernorm.weight": torch.ones(H, device=self.device),
            "self_attn.q_proj.weight": rnd(self.NH * D, H), "self_attn.k_proj.weight": rnd(self.NKV * D, H),
            "self_attn.v_proj.weight": rnd(self.NKV * D, H),
            "self_attn.o_proj.weight": torch.zeros(H, self.NH * D, device=self.device),
            "self_attn.q_norm.weight": torch.ones(D, device=self.device),
            "self_attn.k_norm.weight": torch.ones(D, device=self.device),
            "mlp.gate_proj.weight": rnd(inter_big, H), "mlp.up_proj.weight": rnd(inter_big, H),
            "mlp.down_proj.weight": torch.zeros(H, inter_big, device=self.device),
        }

    def exact_in(self, dtype: torch.dtype) -> bool:
        """Whether every factor is a power of two (so lifting bf16 weights into bf16 rounds nothing)."""
        vals = [self.c, self.s, self.w_hidden, self.w_q, self.w_k]  # embedding x c, o/down x c, q/k x s, norms
        return dtype == torch.float32 or all(math.log2(v) == round(math.log2(v)) for v in vals)


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``limit`` bytes (one model.safetensors when
    everything fits), plus model.safetensors.index.json for several."""

    def __init__(self, out: Path, dtype: torch.dtype, limit: int) -> None:
        self.out, self.dtype, self.limit = out, dtype, limit
        self.cur: dict[str, torch.Tensor] = {}
        self.cur_bytes = 0
        self.shards: list[dict[str, torch.Tensor] | Path] = []
        self.weight_map: dict[str, int] = {}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.to(self.dtype).contiguous().cpu()
        nb = t.numel() * t.element_size()
        if self.cur and self.cur_bytes + nb > self.limit:
            self._flush()
        self.cur[name] = t
        self.cur_bytes += nb
        self.weight_map[name] = len(self.shards)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"shard-{len(self.shards):05d}.tmp"
        save_file(self.cur, str(path), metadata={"format": "pt"})
        self.shards.append(path)
        self.cur, self.cur_bytes = {}, 0

    def close(self) -> list[str]:
        if self.cur:
            self._flush()
        n = len(self.shards)
        if n == 1:
            self.shards[0].rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        total = 0
        for p, nm in zip(self.shards, names):
            total += p.stat().st_size
            p.rename(self.out / nm)
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
        return names


def load_state(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    idx = d / "model.safetensors.index.json"
    if idx.exists():
        sd: dict[str, torch.Tensor] = {}
        for f in sorted(set(json.loads(idx.read_text())["weight_map"].values())):
            sd.update(load_file(str(d / f)))
        return sd
    return load_file(str(d / "model.safetensors"))


def lift(pair: Path, out: Path, big_target: dict, big_draft: dict, eps_big: float | None = None,
         device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0, pad_vocab: bool = False,
         shard_bytes: int = 4 << 30) -> dict:
    """Write OUT/target, OUT/draft and OUT/lift.json from PAIR/target and PAIR/draft; returns lift.json's dict."""
    t0 = time.time()
    tcfg = json.loads((pair / "target" / "config.json").read_text())
    dcfg = json.loads((pair / "draft" / "config.json").read_text())
    eps_big = float(tcfg["rms_norm_eps"] if eps_big is None else eps_big)
    if float(dcfg["rms_norm_eps"]) != float(tcfg["rms_norm_eps"]):
        raise ValueError("target and drafter have different rms_norm_eps")
    for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "rope_theta"):
        if dcfg[k] != tcfg[k]:
            raise ValueError(f"target and drafter differ in {k}: the lift maps one width for both")
    V, VB = tcfg["vocab_size"], big_target["vocab_size"]
    if V > VB or (V < VB and not pad_vocab):
        raise ValueError(f"small vocab {V} != big vocab {VB}: train the pair with --vocab-size {VB} "
                         "(or pass --pad-vocab for a cost-only pair whose extra tokens get logit 0)")
    L, LB = tcfg["num_hidden_layers"], big_target["num_hidden_layers"]
    lf = Lifter(tcfg, big_target, eps_big, device, seed)
    place_t = placement(L, LB)
    small_ids = list(dcfg["dflash_config"]["target_layer_ids"])
    n_feat = max(len(small_ids), int(big_draft.get("num_context_features", len(small_ids))))
    big_ids, id_map = feature_ids(small_ids, place_t, LB, n_feat)

    # ---- target
    sd = load_state(pair / "target")
    out_t = out / "target"
    if out_t.exists():
        shutil.rmtree(out_t)
    w = ShardWriter(out_t, dtype, shard_bytes)
    emb = sd["model.embed_tokens.weight"]
    lm = sd.get("lm_head.weight", emb)

    def rows(x: torch.Tensor, scale: float) -> torch.Tensor:
        o = torch.zeros(VB, lf.H, device=lf.device)
        o[:V, : lf.h] = lf._t(x) * scale
        return o

    w.add("model.embed_tokens.weight", rows(emb, lf.c))
    inv = {b: k for k, b in enumerate(place_t)}
    for i in range(LB):
        if i in inv:
            pre = f"model.layers.{inv[i]}."
            layer = lf.lift_layer({k: sd[pre + k] for k in LAYER_KEYS}, big_target["intermediate_size"])
        else:
            layer = lf.extra_layer(big_target["intermediate_size"])
        for k in LAYER_KEYS:
            w.add(f"model.layers.{i}.{k}", layer[k])
        del layer
    w.add("model.norm.weight", lf.hidden_norm(sd["model.norm.weight"]))
    w.add("lm_head.weight", rows(lm, 1.0))
    t_files = w.close()
    bcfg = dict(big_target)
    bcfg.update({"rms_norm_eps": eps_big, "rope_theta": tcfg["rope_theta"], "torch_dtype": str(dtype).split(".")[-1]})
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in tcfg:
            bcfg[k] = tcfg[k]
    (out_t / "config.json").write_text(json.dumps(bcfg, indent=1, sort_keys=True) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (pair / "target" / f).exists():
            shutil.copy(pair / "target" / f, out_t / f)
    del sd
    log(f"target: {L} -> {LB} layers, trained at {place_t}, files {t_files}")

    # ---- drafter
    sd = load_state(pair / "draft")
    out_d = out / "draft"
    if out_d.exists():
        shutil.rmtree(out_d)
    w = ShardWriter(out_d, dtype, shard_bytes)
    Ld, LdB = dcfg["num_hidden_layers"], int(big_draft["num_hidden_layers"])
    place_d = placement(Ld, LdB)
    inv_d = {b: k for k, b in enumerate(place_d)}
    for i in range(LdB):
        if i in inv_d:
            pre = f"layers.{inv_d[i]}."
            layer = lf.lift_layer({k: sd[pre + k] for k in LAYER_KEYS}, int(big_draft["intermediate_size"]))
        else:
            layer = lf.extra_layer(int(big_draft["intermediate_size"]))
        for k in LAYER_KEYS:
            w.add(f"layers.{i}.{k}", layer[k])
    fc = lf._t(sd["fc.weight"])  # [h, K * h], blocks in small id order
    fc_big = torch.zeros(lf.H, len(big_ids) * lf.H, device=lf.device)
    for q, s in enumerate(small_ids):
        p = big_ids.index(id_map[s])
        fc_big[: lf.h, p * lf.H : p * lf.H + lf.h] = fc[:, q * lf.h : (q + 1) * lf.h]
    w.add("fc.weight", fc_big)
    w.add("hidden_norm.weight", lf.hidden_norm(sd["hidden_norm.weight"]))
    w.add("norm.weight", lf.hidden_norm(sd["norm.weight"]))
    d_files = w.close()
    bd = dict(bcfg)
    bd.update({"architectures": ["DFlashDraftModel"], "num_hidden_layers": LdB,
               "intermediate_size": int(big_draft["intermediate_size"]), "num_target_layers": LB,
               "block_size": dcfg["block_size"], "layer_types": ["full_attention"] * LdB,
               "dflash_config": dict(dcfg["dflash_config"], target_layer_ids=big_ids)})
    bd.pop("num_context_features", None)
    (out_d / "config.json").write_text(json.dumps(bd, indent=1, sort_keys=True) + "\n")
    log(f"drafter: {Ld} -> {LdB} layers, trained at {place_d}; context ids {small_ids} -> {big_ids} "
        f"(small -> big {id_map}), files {d_files}")

    for f in ("prompts.jsonl", "eval.json", "split.json", "train_log.json"):
        if (pair / f).exists():
            shutil.copy(pair / f, out / f)
    info = {"pair": str(pair), "factors": lf.factors(), "exact_in_saved_dtype": lf.exact_in(dtype),
            "dtype": str(dtype).split(".")[-1], "target_layers": place_t, "draft_layers": place_d,
            "draft_context_ids": {"small": small_ids, "big": big_ids, "map": {str(k): v for k, v in id_map.items()}},
            "q_heads": lf.q_heads, "kv_heads": lf.kv_heads, "head_coords": lf.head_coords.tolist(),
            "vocab": {"small": V, "big": VB, "padded": V < VB}, "seconds": round(time.time() - t0, 1)}
    (out / "lift.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", required=True, type=Path, help="the small pair: target/ and draft/")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--shape", default="qwen3-8b", help=f"one of {sorted(SHAPES)}, or a JSON file "
                    "{\"target\": {...config fields...}, \"draft\": {num_hidden_layers, intermediate_size, num_context_features}}")
    ap.add_argument("--eps", type=float, default=None, help="the big config's rms_norm_eps (default: the small one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0, help="seed of the extra layers' random weights")
    ap.add_argument("--pad-vocab", action="store_true", help="pad a smaller vocabulary with zero rows (not exact: cost only)")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    a = ap.parse_args(argv)
    if a.shape in SHAPES:
        big_t, big_d = SHAPES[a.shape]
    else:
        spec = json.loads(Path(a.shape).read_text())
        big_t, big_d = dict(QWEN3_8B, **spec["target"]), spec["draft"]
    for sub in ("target", "draft"):
        if not (a.pair / sub / "config.json").exists():
            print(f"lift_pair: {a.pair / sub / 'config.json'} is missing (need a pair from train_tiny_pair.py)", file=sys.stderr)
            return 2
    try:
        info = lift(a.pair, a.out, big_t, big_d, a.eps, a.device, getattr(torch, a.dtype), a.seed, a.pad_vocab,
                    int(a.shard_gb * (1 << 30)))
    except ValueError as exc:
        print(f"lift_pair: {exc}", file=sys.stderr)
        return 2
    log(f"done in {info['seconds']} s: factors {info['factors']}, exact in {info['dtype']}: {info['exact_in_saved_dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
