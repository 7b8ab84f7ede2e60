"""bench/lift_pair.py on the CPU: a small pair lifted into a bigger shape computes the same function.

A random small pair (every weight random, norm weights too, and an eps large enough to matter) is
saved as train_tiny_pair.py saves a trained one, lifted, loaded again, and run through the same
torch forward (bench/tiny_models.py) at both sizes: the target's logits and context features and
the drafter's block logits must agree within float32 tolerance. The lifted target also goes
through transformers' Qwen3ForCausalLM, and the lifted drafter through sglang 0.5.13.post1's own
DFlashDraftModel.load_weights (tests/tiny_pair_sglang_load.py).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import lift_pair as lp  # noqa: E402
import tiny_models as tm  # noqa: E402
import train_tiny_pair as ttp  # noqa: E402

V = 96
SMALL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-2, "rope_theta": 10000.0,
         "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
SMALL_DRAFT = dict(SMALL, architectures=["DFlashDraftModel"], num_hidden_layers=2, intermediate_size=80, block_size=4,
                   num_target_layers=4, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": 2, "block_size": 4})
# hidden 64 -> 256, head_dim 16 -> 64, 4 -> 8 layers: every factor is a power of two (exact in bf16)
BIG_EXACT = {"target": {"vocab_size": V, "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 8,
                        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256},
             "draft": {"num_hidden_layers": 3, "intermediate_size": 320, "num_context_features": 3}}
# hidden 64 -> 192, head_dim 16 -> 32, another eps: irrational factors (lifted in float32)
BIG_ODD = {"target": {"vocab_size": V, "hidden_size": 192, "intermediate_size": 128, "num_hidden_layers": 7,
                      "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 256},
           "draft": {"num_hidden_layers": 2, "intermediate_size": 96, "num_context_features": 2}}


def _randomize(m: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(m.named_parameters()):
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("small")
    t, dr = tm.Qwen3Target(SMALL), tm.DFlashDrafter(SMALL_DRAFT)
    _randomize(t, 1)
    _randomize(dr, 2)
    ttp.save_model(t, SMALL, d / "target")  # bf16, as the training script saves
    ttp.save_model(dr, SMALL_DRAFT, d / "draft")
    return d


def _load(d: Path) -> tuple[tm.Qwen3Target, tm.DFlashDrafter]:
    tcfg = json.loads((d / "target" / "config.json").read_text())
    dcfg = json.loads((d / "draft" / "config.json").read_text())
    t, dr = tm.Qwen3Target(tcfg), tm.DFlashDrafter(dcfg)
    t.load_state_dict({k: v.float() for k, v in lp.load_state(d / "target").items()})
    dr.load_state_dict({k: v.float() for k, v in lp.load_state(d / "draft").items()})
    return t.eval(), dr.eval()


def _lift(small_pair: Path, out: Path, spec: dict, *extra: str) -> Path:
    (out.parent / f"{out.name}.json").write_text(json.dumps(spec))
    rc = lp.main(["--pair", str(small_pair), "--out", str(out), "--shape", str(out.parent / f"{out.name}.json"),
                  "--device", "cpu", *extra])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def lifted_exact(small_pair, tmp_path_factory) -> Path:
    return _lift(small_pair, tmp_path_factory.mktemp("big") / "exact", BIG_EXACT, "--shard-gb", "0.0005")


@pytest.fixture(scope="module")
def lifted_odd(small_pair, tmp_path_factory) -> Path:
    return _lift(small_pair, tmp_path_factory.mktemp("big") / "odd", BIG_ODD, "--dtype", "float32", "--eps", "3e-3")


def _inputs():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, V, (3, 24), generator=g)
    anchors = torch.tensor([[2, 9, 15], [5, 6, 19], [1, 11, 12]])
    return ids, anchors


def _compare(small_pair: Path, big: Path, tol: float) -> None:
    st, sd = _load(small_pair)
    bt, bd = _load(big)
    info = json.loads((big / "lift.json").read_text())
    ids, anchors = _inputs()
    with torch.no_grad():
        s_logits, s_feats = st(ids, capture=sd.target_layer_ids)
        b_logits, b_feats = bt(ids, capture=bd.target_layer_ids)
        torch.testing.assert_close(b_logits, s_logits, rtol=tol, atol=tol)
        # the features: each small context layer's residual, times c, in the first h coordinates
        h, H = st.cfg["hidden_size"], bt.cfg["hidden_size"]
        c = info["factors"]["residual_scale"]
        for q, s in enumerate(sd.target_layer_ids):
            p = bd.target_layer_ids.index(info["draft_context_ids"]["map"][str(s)])
            blk = b_feats[..., p * H : (p + 1) * H]
            torch.testing.assert_close(blk[..., :h], c * s_feats[..., q * h : (q + 1) * h], rtol=tol, atol=tol)
            assert float(blk[..., h:].abs().max()) == 0.0
        s_draft = tm.draft_logits(sd, st, ids, s_feats, anchors)
        b_draft = tm.draft_logits(bd, bt, ids, b_feats, anchors)
        torch.testing.assert_close(b_draft, s_draft, rtol=tol, atol=tol)
        # greedy generation with the KV cache too
        assert torch.equal(bt.generate(ids[:, :8], 6), st.generate(ids[:, :8], 6))


def test_lift_exact_shape_equals_small_pair(small_pair, lifted_exact):
    info = json.loads((lifted_exact / "lift.json").read_text())
    assert info["exact_in_saved_dtype"] and info["dtype"] == "bfloat16"
    assert info["target_layers"] == [0, 2, 4, 6] and info["draft_layers"] == [0, 1]
    # several shards and an index, as SGLang loads an 8B checkpoint
    assert (lifted_exact / "target" / "model.safetensors.index.json").exists()
    _compare(small_pair, lifted_exact, 2e-5)


def test_lift_odd_factors_and_another_eps_equal_small_pair(small_pair, lifted_odd):
    info = json.loads((lifted_odd / "lift.json").read_text())
    assert info["factors"]["eps_big"] == 3e-3 and not lp.Lifter(SMALL, dict(lp.QWEN3_8B, **BIG_ODD["target"]),
                                                                 3e-3, "cpu", 0).exact_in(torch.bfloat16)
    cfg = json.loads((lifted_odd / "target" / "config.json").read_text())
    assert cfg["rms_norm_eps"] == 3e-3 and cfg["tie_word_embeddings"] is False
    _compare(small_pair, lifted_odd, 2e-5)


def test_a_wrong_eps_is_caught(small_pair, lifted_exact):
    """The comparison is sensitive to the norms' eps: the lifted pair with its config's eps doubled
    no longer matches (so the eps rescaling above is what makes it match)."""
    st, _ = _load(small_pair)
    bt, _ = _load(lifted_exact)
    cfg = dict(bt.cfg, rms_norm_eps=2 * bt.cfg["rms_norm_eps"])
    wrong = tm.Qwen3Target(cfg)
    wrong.load_state_dict(bt.state_dict())
    ids, _ = _inputs()
    with torch.no_grad():
        diff = (wrong(ids)[0] - st(ids)[0]).abs().max()
    assert float(diff) > 1e-3


def test_lifted_target_through_transformers(small_pair, lifted_exact):
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(lifted_exact / "target"), dtype=torch.float32).eval()
    st, _ = _load(small_pair)
    ids, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, st(ids)[0], rtol=2e-5, atol=2e-5)


def test_extra_layers_pass_the_residual_through_but_are_not_empty(lifted_exact):
    sd = lp.load_state(lifted_exact / "target")
    info = json.loads((lifted_exact / "lift.json").read_text())
    for i in range(BIG_EXACT["target"]["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if i in info["target_layers"]:
            continue
        assert float(sd[pre + "self_attn.o_proj.weight"].abs().max()) == 0.0
        assert float(sd[pre + "mlp.down_proj.weight"].abs().max()) == 0.0
        assert float(sd[pre + "self_attn.q_proj.weight"].float().std()) > 0.01
        assert float(sd[pre + "mlp.gate_proj.weight"].float().std()) > 0.01


def test_qwen3_8b_placement_uses_the_public_context_layers():
    """6 trained layers in 36: at 0, 6, ..., 30; the small context layers [0, 2, 4] are read at
    1, 17 and 25 of the public drafters' [1, 9, 17, 25, 33] (9 and 33 get zero fc blocks)."""
    assert lp.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert lp.default_layer_ids(8, 3) == [1, 3, 5]
    place = lp.placement(6, 36)
    ids, m = lp.feature_ids([0, 2, 4], place, 36, 5)
    assert place == [0, 6, 12, 18, 24, 30] and ids == [1, 9, 17, 25, 33] and m == {0: 1, 2: 17, 4: 25}
    for s, k in m.items():  # the residual after big layer k is the small one after layer s
        assert place[s] <= k < place[s + 1]


def test_rope_frequencies_of_moved_pairs_are_bit_equal():
    small, big = 16, 64
    lf = lp.Lifter(SMALL, dict(lp.QWEN3_8B, **BIG_EXACT["target"]), SMALL["rms_norm_eps"], "cpu", 0)
    pos = torch.arange(300)[None]
    cs, ss = tm.rope_cos_sin(pos, small, SMALL["rope_theta"], torch.float32)
    cb, sb = tm.rope_cos_sin(pos, big, SMALL["rope_theta"], torch.float32)
    assert torch.equal(cb[..., lf.head_coords], cs) and torch.equal(sb[..., lf.head_coords], ss)
    assert big // small == 4 and lf.head_coords[: small // 2].tolist() == list(range(0, big // 2, 4))


def test_bad_input_is_one_clear_error(small_pair, tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"target": dict(BIG_EXACT["target"], vocab_size=2 * V), "draft": BIG_EXACT["draft"]}))
    assert lp.main(["--pair", str(small_pair), "--out", str(tmp_path / "o"), "--shape", str(spec), "--device", "cpu"]) == 2
    assert "--vocab-size" in capsys.readouterr().err
    spec.write_text(json.dumps({"target": dict(BIG_EXACT["target"], num_key_value_heads=1, num_attention_heads=8),
                                "draft": BIG_EXACT["draft"]}))
    assert lp.main(["--pair", str(small_pair), "--out", str(tmp_path / "o"), "--shape", str(spec), "--device", "cpu"]) == 2
    assert "cannot lift" in capsys.readouterr().err
    assert lp.main(["--pair", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.sglang
def test_lifted_pair_loads_into_sglang(lifted_exact, tmp_path):
    """sglang 0.5.13.post1's own classes (DFlashDraftModel, Qwen3ForCausalLM) and load_weights take
    every lifted tensor (the sharded target included) into a parameter, unchanged (one process
    for both: importing sglang is most of the time)."""
    if importlib.util.find_spec("sglang") is None:  # find, never import: the overlay tests need sglang unimported
        pytest.skip("sglang is not installed")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "tiny_pair_sglang_load.py"), str(lifted_exact / "draft"),
                        str(lifted_exact / "target")], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()[-2:]
    for part, line, cls in zip(("draft", "target"), lines, ("DFlashDraftModel", "Qwen3ForCausalLM")):
        res = json.loads(line)
        assert res["class"] == cls
        assert not {k: v for k, v in res["params"].items() if not v["ok"]}
        assert res["unused_checkpoint_names"] == []
        assert len(lp.load_state(lifted_exact / part)) == len({s for v in res["params"].values() for s in v["from"]})
    assert json.loads(lines[0])["num_context_features"] == BIG_EXACT["draft"]["num_context_features"]
