"""Load a saved DFlash drafter (or Qwen3 target) into the real sglang 0.5.13.post1 model class on the CPU.

    python tests/tiny_pair_sglang_load.py MODEL_DIR [MODEL_DIR...]   ->  one JSON line per dir on stdout

``DFlashDraftModel`` or ``Qwen3ForCausalLM``, by the config's ``architectures``; the checkpoint is
``model.safetensors`` or the shards named by ``model.safetensors.index.json``.

Run in its own process (it initialises a 1-rank gloo process group). ``vllm._custom_ops`` is
stubbed: SGLang's RotaryEmbedding imports it on CPU, and it is never called here (no forward).
Builds the model from the drafter's config.json as SGLang does (``AutoConfig``), records every
parameter, calls ``load_weights`` with the safetensors items, then reports, per parameter,
whether it now equals the checkpoint tensors it should come from (q/k/v fused into qkv_proj and
gate/up into gate_up_proj, in that order; a vocabulary-padded embedding / lm_head is compared on
its first rows), and which checkpoint names no parameter took.
"""

import json
import socket
import sys
import types
from pathlib import Path

import torch

for name in ("vllm", "vllm._custom_ops"):
    sys.modules.setdefault(name, types.ModuleType(name))
sys.modules["vllm._custom_ops"].rotary_embedding = None
sys.modules["vllm"]._custom_ops = sys.modules["vllm._custom_ops"]


def setup(model_path: str) -> None:
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1)
    set_global_server_args_for_scheduler(ServerArgs(model_path=model_path, device="cpu"))


def main(draft: str) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(draft)
    if cfg.architectures[0] == "Qwen3ForCausalLM":
        from sglang.srt.layers import dp_attention as dpa
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM as cls

        # what initialize_dp_attention sets for one rank without DP attention (it needs a full
        # ModelConfig; the target's layers only read these)
        dpa._ATTN_DP_RANK, dpa._ATTN_DP_SIZE, dpa._LOCAL_ATTN_DP_RANK, dpa._LOCAL_ATTN_DP_SIZE = 0, 1, 0, 1
        dpa._ENABLE_DP_ATTENTION_FLAG = False
    else:
        from sglang.srt.models.dflash import DFlashDraftModel as cls
    model = cls(cfg)
    index = Path(draft) / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    sd = {}
    for f in files:
        sd.update(load_file(f"{draft}/{f}"))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything load_weights leaves alone stays NaN
    model.load_weights(list(sd.items()))
    fused = {"self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
             "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}
    used: set[str] = set()
    params = {}
    for name, p in model.named_parameters():
        srcs = [name]
        for suffix, parts in fused.items():
            if name.endswith(suffix):
                srcs = [name[: -len(suffix)] + x for x in parts]
        missing = [x for x in srcs if x not in sd]
        if missing:
            params[name] = {"ok": False, "why": f"no checkpoint tensor {missing}"}
            continue
        want = torch.cat([sd[x].float() for x in srcs], dim=0)
        used.update(srcs)
        got = p.detach().float()
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and got.shape[0] > want.shape[0]:
            got = got[: want.shape[0]]  # vocabulary padded to a multiple of 64 by VocabParallelEmbedding
        ok = tuple(want.shape) == tuple(got.shape) and bool(torch.equal(got, want))
        params[name] = {"ok": ok, "shape": list(p.shape), "from": srcs}
    return {"params": params, "unused_checkpoint_names": sorted(set(sd) - used), "class": cls.__name__,
            "block_size": getattr(model, "block_size", None), "num_context_features": getattr(model, "num_context_features", None)}


if __name__ == "__main__":
    setup(sys.argv[1])
    for d in sys.argv[1:]:
        print(json.dumps(main(d)), flush=True)
