"""Load a saved DFlash drafter into the real sglang 0.5.13.post1 ``DFlashDraftModel`` on the CPU.

    python tests/tiny_pair_sglang_load.py DRAFT_DIR   ->  one JSON line on stdout

Run in its own process (it initialises a 1-rank gloo process group). ``vllm._custom_ops`` is
stubbed: SGLang's RotaryEmbedding imports it on CPU, and it is never called here (no forward).
Builds the model from the drafter's config.json as SGLang does (``AutoConfig``), records every
parameter, calls ``load_weights`` with the safetensors items, then reports, per parameter,
whether it now equals the checkpoint tensors it should come from (q/k/v fused into qkv_proj and
gate/up into gate_up_proj, in that order), and which checkpoint names no parameter took.
"""

import json
import socket
import sys
import types

import torch

for name in ("vllm", "vllm._custom_ops"):
    sys.modules.setdefault(name, types.ModuleType(name))
sys.modules["vllm._custom_ops"].rotary_embedding = None
sys.modules["vllm"]._custom_ops = sys.modules["vllm._custom_ops"]


def main(draft: str) -> dict:
    from safetensors.torch import load_file
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import AutoConfig

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1)
    set_global_server_args_for_scheduler(ServerArgs(model_path=draft, device="cpu"))
    from sglang.srt.models.dflash import DFlashDraftModel

    cfg = AutoConfig.from_pretrained(draft)
    model = DFlashDraftModel(cfg)
    sd = load_file(f"{draft}/model.safetensors")
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
        ok = tuple(want.shape) == tuple(p.shape) and bool(torch.equal(p.detach().float(), want))
        params[name] = {"ok": ok, "shape": list(p.shape), "from": srcs}
    return {"params": params, "unused_checkpoint_names": sorted(set(sd) - used),
            "block_size": model.block_size, "num_context_features": model.num_context_features}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
