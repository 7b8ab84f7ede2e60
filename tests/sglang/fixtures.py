"""Tiny model config dirs for DDTREE tests: a Qwen3 target and a matching DFlash draft.

Configs only, no weights: CPU tests parse them with `prepare_server_args`; GPU tests serve them
with `--load-format dummy --skip-tokenizer-init` (random weights; greedy outputs must still match
the plain target exactly, acceptance is meaningless).

    python tests/sglang/fixtures.py OUTDIR [--block-size 16]   # writes OUTDIR/{target,draft}/config.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

VOCAB_SIZE = 2048
NUM_TARGET_LAYERS = 4


def target_config(vocab: int = VOCAB_SIZE) -> dict:
    """A 4-layer Qwen3 (MHA, GQA 4/2 heads) small enough for any GPU."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": NUM_TARGET_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def draft_config(block_size: int = 16, vocab: int = VOCAB_SIZE) -> dict:
    """A 1-layer DFlash draft for `target_config()`.

    `target_layer_ids` must stay below num_hidden_layers - 1 of the target (SGLang captures the
    hidden state "before layer id + 1"); the mask token is the last vocab id.
    """
    cfg = dict(target_config(vocab))
    cfg.update(
        architectures=["DFlashDraftModel"],
        num_hidden_layers=1,
        block_size=block_size,
        num_target_layers=NUM_TARGET_LAYERS,
        dflash_config={
            "target_layer_ids": [0, 2],
            "mask_token_id": vocab - 1,
            "block_size": block_size,
        },
    )
    return cfg


class ModelDirs(NamedTuple):
    target: Path
    draft: Path


def write_model_dirs(root: Path, *, block_size: int = 16) -> ModelDirs:
    """Write `root/target/config.json` and `root/draft/config.json`; return both dirs."""
    root = Path(root)
    dirs = ModelDirs(root / "target", root / "draft")
    for d, cfg in ((dirs.target, target_config()), (dirs.draft, draft_config(block_size))):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args()
    dirs = write_model_dirs(a.outdir, block_size=a.block_size)
    print(json.dumps({"target": str(dirs.target), "draft": str(dirs.draft)}))


if __name__ == "__main__":
    main()
