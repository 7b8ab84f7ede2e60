"""Torch-only model code for the tiny trained pair (bench/train_tiny_pair.py).

* :class:`Qwen3Target`: a Qwen3 decoder (HF ``Qwen3ForCausalLM`` math and parameter names, tied
  embeddings) for from-scratch next-token training, feature capture and KV-cached generation.
* :class:`DFlashDrafter`: the DFlash draft model's training forward, written to mirror SGLang
  0.5.13.post1 ``models/dflash.py`` + ``speculative/dflash_worker.py``:

  - context features: the target's residual stream after each layer in ``target_layer_ids``
    (ascending), concatenated, then ``ctx = hidden_norm(fc(feat))``; every draft layer turns ctx
    into its own K/V with ``k_norm(k_proj(ctx))`` + RoPE at the token's absolute position and
    ``v_proj(ctx)`` (no ``input_layernorm`` on ctx: ``_append_target_hidden_sequential``);
  - a block ``[x[a], MASK x (B-1)]`` at positions ``a..a+B-1`` is embedded with the target's
    embedding; pre-norm Qwen3 layers whose block queries see context keys ``j < a`` and every key
    of their own block (non-causal, ``AttentionType.ENCODER_ONLY``); final ``norm``; logits from
    the target's (tied) ``lm_head``;
  - slot ``k >= 1`` predicts ``x[a+k]`` (no shift).

Parameter names are the HF/SGLang checkpoint names (dflash_training.md section 1.3), so
``state_dict()`` is what gets saved.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: ``weight * (x / rms(x))`` computed in float32, cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [b, t] int -> cos, sin [b, 1, t, head_dim] (neox layout: halves repeated)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
    f = positions[..., None].float() * inv  # [b, t, hd/2]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def expand_kv(x: Tensor, n_rep: int) -> Tensor:
    """[b, nkv, t, hd] -> [b, nkv * n_rep, t, hd]: query head h uses kv head h // n_rep (HF repeat_kv)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, h, t, hd]: x * cos + rotate_half(x) * sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, self.nh, self.nkv, self.hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(self.hd, cfg["rms_norm_eps"])

    def q(self, x: Tensor) -> Tensor:  # [b, t, H] -> [b, nh, t, hd] (normed, no rope)
        b, t, _ = x.shape
        return self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)

    def kv(self, x: Tensor) -> tuple[Tensor, Tensor]:  # [b, t, H] -> 2 x [b, nkv, t, hd]
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return k, v

    def out(self, o: Tensor) -> Tensor:  # [b, nh, t, hd] -> [b, t, H]
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])


def init_weights(module: nn.Module, std: float = 0.02, seed_gen: torch.Generator | None = None) -> None:
    """HF Qwen3 init: normal(0, std) for linears and embeddings, ones for norms (in name order)."""
    for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        with torch.no_grad():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=seed_gen) * std)


class Qwen3Target(nn.Module):
    """HF Qwen3ForCausalLM: ``model.embed_tokens``, ``model.layers.i.*``, ``model.norm``, and
    ``lm_head`` when ``tie_word_embeddings`` is false (the tiny pair trains tied; bench/lift_pair.py
    writes untied)."""

    def __init__(self, cfg: dict, rows: int | None = None) -> None:
        """``rows`` < ``cfg["vocab_size"]``: the compact form of a vocabulary whose ids ``rows - 1 ..
        vocab_size - 1`` (never emitted by the tokenizer) share one embedding row, the last: their
        logits are equal, so a distribution over the full vocabulary is :meth:`dist` of the
        ``rows`` logits (the last one counted ``vocab_size - rows + 1`` times)."""
        super().__init__()
        self.cfg = cfg
        n = cfg["vocab_size"] if rows is None else rows
        if not 1 <= n <= cfg["vocab_size"]:
            raise ValueError(f"rows {n} must be in 1..vocab_size {cfg['vocab_size']}")
        self.log_shared = math.log(cfg["vocab_size"] - n + 1) if n < cfg["vocab_size"] else 0.0
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(n, cfg["hidden_size"])
        self.model.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.model.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        if not cfg.get("tie_word_embeddings", False):
            self.lm_head = nn.Linear(cfg["hidden_size"], n, bias=False)

    @property
    def lm_weight(self) -> Tensor:
        head = getattr(self, "lm_head", None)
        return self.model.embed_tokens.weight if head is None else head.weight

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(h, self.lm_weight)

    def dist(self, logits: Tensor) -> Tensor:
        """Logits -> the full vocabulary's softmax inputs (float32): the shared last row's logit
        + log(its id count), so softmax / cross-entropy / logsumexp over them are the full
        vocabulary's (the last entry is then the mass of all unused ids). Identity when not compact."""
        z = logits.float()
        if self.log_shared:
            z = torch.cat([z[..., :-1], z[..., -1:] + self.log_shared], dim=-1)
        return z

    def full_state_dict(self) -> dict[str, Tensor]:
        """state_dict() with the shared row repeated up to vocab_size (what a checkpoint holds)."""
        sd = self.state_dict()
        v = self.cfg["vocab_size"]
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            if k in sd and sd[k].shape[0] < v:
                w = sd[k]
                sd[k] = torch.cat([w, w[-1:].expand(v - w.shape[0], -1)], dim=0)
        return sd

    def forward(self, ids: Tensor, capture: tuple[int, ...] = (), kv_cache: list | None = None, pos0: int = 0):
        """ids [b, t] -> (logits [b, t, V], captured [b, t, len(capture)*H] or None).

        ``capture``: layer ids k whose output (residual stream after layer k, before the final
        norm; HF ``hidden_states[k+1]``) is concatenated in the given (ascending) order.
        ``kv_cache``: per layer a pair of ``[b, nkv, T, hd]`` buffers; the new K/V are written at
        ``pos0..pos0+t-1`` and the queries attend to ``0..pos0+t-1`` (causal).
        """
        b, t = ids.shape
        cfg = self.cfg
        pos = torch.arange(pos0, pos0 + t, device=ids.device)[None].expand(b, t)
        x = self.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(pos, cfg["head_dim"], cfg["rope_theta"], x.dtype)
        feats = []
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            hn = layer.input_layernorm(x)
            q = apply_rope(a.q(hn), cos, sin)
            k, v = a.kv(hn)
            k = apply_rope(k, cos, sin)
            if kv_cache is not None:
                kc, vc = kv_cache[i]
                kc[:, :, pos0 : pos0 + t] = k.to(kc.dtype)
                vc[:, :, pos0 : pos0 + t] = v.to(vc.dtype)
                k, v = kc[:, :, : pos0 + t], vc[:, :, : pos0 + t]
            rep = a.nh // a.nkv
            k, v = expand_kv(k.to(q.dtype), rep), expand_kv(v.to(q.dtype), rep)
            if t == 1:
                o = F.scaled_dot_product_attention(q, k, v)
            elif pos0 == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                raise ValueError("multi-token forward with pos0 > 0 is not needed here")
            x = x + a.out(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in capture:
                feats.append(x)
        h = self.model.norm(x)
        cap = torch.cat([feats[capture.index(k)] for k in capture], dim=-1) if capture else None
        return self.logits(h), cap

    def new_kv_cache(self, b: int, total: int, dtype: torch.dtype, device) -> list:
        cfg = self.cfg
        shape = (b, cfg["num_key_value_heads"], total, cfg["head_dim"])
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(cfg["num_hidden_layers"])]

    @torch.no_grad()
    def generate(self, prompts: Tensor, n_new: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """prompts [b, P] -> continuation [b, n_new] (greedy when temperature == 0; no EOS stop)."""
        b, p = prompts.shape
        cache = self.new_kv_cache(b, p + n_new, dtype, prompts.device)
        logits, _ = self.forward(prompts, kv_cache=cache, pos0=0)
        out = []
        for step in range(n_new):
            last = logits[:, -1].float()
            if temperature == 0.0:
                nxt = last.argmax(-1)
            else:
                z = last / temperature
                if self.log_shared:  # the shared row stands for vocab_size - rows + 1 ids at any temperature
                    z = torch.cat([z[:, :-1], z[:, -1:] + self.log_shared], dim=-1)
                probs = torch.softmax(z, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
            out.append(nxt)
            if step + 1 < n_new:
                logits, _ = self.forward(nxt[:, None], kv_cache=cache, pos0=p + step)
        return torch.stack(out, dim=1)


class DFlashDrafter(nn.Module):
    """SGLang ``DFlashDraftModel`` parameters (``layers.i.*``, ``fc``, ``hidden_norm``, ``norm``) + a training forward."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        dc = cfg["dflash_config"]
        self.target_layer_ids = tuple(dc["target_layer_ids"])
        self.mask_token_id = int(dc["mask_token_id"])
        self.block_size = int(cfg["block_size"])
        h = cfg["hidden_size"]
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])

    def forward(self, block_emb: Tensor, block_pos: Tensor, ctx_feat: Tensor, ctx_pos: Tensor, mask: Tensor) -> Tensor:
        """Draft hidden states after the final norm.

        block_emb [b, Q, H] (target embedding of the block ids), block_pos [b, Q] absolute positions,
        ctx_feat [b, S, K*H] target features, ctx_pos [b, S], mask [b, Q, S+Q] bool (True = attend;
        keys are the S context tokens, then the Q block tokens). Returns [b, Q, H].
        """
        cfg = self.cfg
        ctx = self.hidden_norm(self.fc(ctx_feat))
        cos_b, sin_b = rope_cos_sin(block_pos, cfg["head_dim"], cfg["rope_theta"], block_emb.dtype)
        cos_c, sin_c = rope_cos_sin(ctx_pos, cfg["head_dim"], cfg["rope_theta"], ctx.dtype)
        h = block_emb
        m = mask[:, None]
        for layer in self.layers:
            a = layer.self_attn
            hn = layer.input_layernorm(h)
            q = apply_rope(a.q(hn), cos_b, sin_b)
            kb, vb = a.kv(hn)
            kb = apply_rope(kb, cos_b, sin_b)
            kc, vc = a.kv(ctx)
            kc = apply_rope(kc, cos_c, sin_c)
            rep = a.nh // a.nkv
            k = expand_kv(torch.cat([kc.to(q.dtype), kb.to(q.dtype)], dim=2), rep)
            v = expand_kv(torch.cat([vc.to(q.dtype), vb.to(q.dtype)], dim=2), rep)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
            h = h + a.out(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)


def block_inputs(ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int, seq_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Blocks at the anchors: ids [b, S], anchors [b, N] -> (block_ids [b, N*B], block_pos [b, N*B],
    mask [b, N*B, S + N*B] bool): block n's queries see context keys j < anchors[n] and the keys of
    block n only (bidirectionally)."""
    b, n = anchors.shape
    bsz = block_size
    dev = ids.device
    block_ids = torch.full((b, n, bsz), mask_token_id, dtype=ids.dtype, device=dev)
    block_ids[:, :, 0] = torch.gather(ids, 1, anchors)
    offs = torch.arange(bsz, device=dev)
    block_pos = (anchors[:, :, None] + offs).reshape(b, n * bsz)
    ctx_vis = torch.arange(seq_len, device=dev)[None, None, :] < anchors[:, :, None]  # [b, N, S]
    ctx_vis = ctx_vis[:, :, None, :].expand(b, n, bsz, seq_len).reshape(b, n * bsz, seq_len)
    blk = torch.arange(n, device=dev).repeat_interleave(bsz)
    blk_vis = (blk[:, None] == blk[None, :])[None].expand(b, n * bsz, n * bsz)
    mask = torch.cat([ctx_vis, blk_vis], dim=-1)
    return block_ids.reshape(b, n * bsz), block_pos, mask


def draft_logits(drafter: DFlashDrafter, target: Qwen3Target, ids: Tensor, feats: Tensor, anchors: Tensor) -> Tensor:
    """Draft logits of slots 1..B-1 at each anchor: [b, N, B-1, V] (slot k predicts ids[a+k])."""
    b, s = ids.shape
    n = anchors.shape[1]
    bsz = drafter.block_size
    block_ids, block_pos, mask = block_inputs(ids, anchors, bsz, drafter.mask_token_id, s)
    emb = target.model.embed_tokens(block_ids)
    ctx_pos = torch.arange(s, device=ids.device)[None].expand(b, s)
    h = drafter(emb, block_pos, feats, ctx_pos, mask)
    h = h.view(b, n, bsz, -1)[:, :, 1:]
    return target.logits(h)


def dflash_loss(logits: Tensor, ids: Tensor, anchors: Tensor, loss_mask: Tensor, gamma: float,
                dist=None) -> tuple[Tensor, Tensor]:
    """Weighted CE over slots 1..B-1 (weight exp(-(k-1)/gamma); labels ids[a+k], masked past the
    sequence or where loss_mask is 0). ``dist``: the target's :meth:`Qwen3Target.dist` for a
    compact vocabulary (the CE is the full vocabulary's). Returns (loss, top-1 accuracy per slot [B-1])."""
    b, n, l, v = logits.shape
    s = ids.shape[1]
    k = torch.arange(1, l + 1, device=ids.device)
    pos = anchors[:, :, None] + k  # [b, N, L]
    inside = pos < s
    posc = pos.clamp_max(s - 1)
    labels = torch.gather(ids, 1, posc.view(b, -1)).view(b, n, l)
    valid = inside & torch.gather(loss_mask, 1, posc.view(b, -1)).view(b, n, l).bool()
    w = torch.exp(-(k - 1).float() / gamma)[None, None, :] * valid.float()
    z = logits.float() if dist is None else dist(logits)
    ce = F.cross_entropy(z.reshape(-1, v), labels.reshape(-1), reduction="none").view(b, n, l)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
        acc = hit.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp_min(1.0)
    return loss, acc


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def cosine_lr(step: int, total: int, peak: float, warmup_frac: float) -> float:
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))
