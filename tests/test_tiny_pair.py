"""bench/train_tiny_pair.py at micro scale on the CPU: split, determinism, and that the saved pair is
what transformers' Qwen3ForCausalLM and sglang 0.5.13.post1's DFlashDraftModel load.

The real run (bench/acceptance_run.sh, on a GPU) uses the same code at full size.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import tiny_models as tm  # noqa: E402
import train_tiny_pair as ttp  # noqa: E402

# --vocab-size 512 > the tokenizer's 300: the compact vocabulary path (ids 300..511 share one row)
MICRO = ["--device", "cpu", "--max-files", "12", "--vocab", "300", "--vocab-size", "512", "--hidden", "32", "--layers", "3",
         "--inter", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--seq-len", "32",
         "--target-steps", "3", "--target-batch", "4", "--draft-layers", "1", "--draft-inter", "32",
         "--block-size", "4", "--target-layer-ids", "0,1", "--draft-prompts", "8", "--prompt-len", "8",
         "--gen-len", "12", "--gen-batch", "8", "--draft-steps", "3", "--draft-batch", "4", "--anchors", "3",
         "--eval-prompts", "2", "--eval-gen-len", "12", "--bench-prompts", "4", "--budgets", "3,7"]


def _train(out: Path, seed: int = 0) -> Path:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "train_tiny_pair.py"), "--out", str(out),
                        "--seed", str(seed), *MICRO], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("pair-a"))


def test_split_is_disjoint_seeded_and_ten_percent():
    files = [f"pkg{i // 10}/m{i}.py" for i in range(95)]
    train, held = ttp.split_files(files, seed=3)
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(files)
    assert len(held) == round(0.1 * len(files))
    assert ttp.split_files(files, seed=3) == (train, held)
    assert ttp.split_files(files, seed=4)[1] != held


def test_saved_split_and_prompts(pair):
    split = json.loads((pair / "split.json").read_text())
    root = Path(split["root"])
    listed = ttp.corpus_files(root, 12)
    assert sorted(split["train"] + split["held_out"]) == listed
    assert not set(split["train"]) & set(split["held_out"])
    # the benchmark prompts are windows of the held-out files' token stream, never of the training one
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pair / "target" / "tokenizer.json"))
    held = ttp.token_stream(tok, ttp.read_texts(root, split["held_out"])).tolist()
    prompts = [json.loads(x)["input_ids"] for x in (pair / "prompts.jsonl").read_text().splitlines()]
    assert prompts
    for p in prompts:
        assert any(held[i : i + len(p)] == p for i in range(len(held) - len(p) + 1))


@pytest.mark.slow
def test_training_is_deterministic_from_the_seed(pair, tmp_path):
    again = _train(tmp_path / "pair-b")
    for name in ("target/model.safetensors", "target/tokenizer.json", "target/config.json",
                 "draft/model.safetensors", "draft/config.json", "split.json", "prompts.jsonl", "eval.json"):
        assert (pair / name).read_bytes() == (again / name).read_bytes(), name


def _load_ours(pair: Path) -> tuple[tm.Qwen3Target, tm.DFlashDrafter]:
    return ttp.load_pair(pair)


def test_target_loads_with_transformers_and_gives_our_logits(pair):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    ours, _ = _load_ours(pair)
    ids = torch.tensor([json.loads(x)["input_ids"] for x in (pair / "prompts.jsonl").read_text().splitlines()])
    with torch.no_grad():
        want = hf(ids).logits
        got, feats = ours(ids, capture=(0, 1))
        hs = hf(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # features: the residual stream after layer k is HF's hidden_states[k + 1]
    torch.testing.assert_close(feats, torch.cat([hs[1], hs[2]], -1), rtol=1e-4, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(str(pair / "target"))
    dcfg = json.loads((pair / "draft" / "config.json").read_text())
    assert tok.mask_token_id == dcfg["dflash_config"]["mask_token_id"] == ttp.MASK_ID
    assert tok.eos_token_id == ttp.EOS_ID


def test_model_vocabulary_past_the_tokenizer_is_one_shared_row_and_exact(pair):
    """--vocab-size 512 with a 300-token tokenizer: the checkpoint has 512 rows, ids 300..511 equal
    (they were trained as one row); the compact model's distribution (tiny_models.Qwen3Target.dist,
    what training and the offline evaluation use) is transformers' softmax over all 512 logits."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    sd = load_file(str(pair / "target" / "model.safetensors"))
    emb = sd["model.embed_tokens.weight"]
    tcfg = json.loads((pair / "target" / "config.json").read_text())
    assert tcfg["vocab_size"] == 512 and emb.shape[0] == 512
    assert torch.equal(emb[300:], emb[300:301].expand(212, -1)) and not torch.equal(emb[299], emb[300])
    compact = tm.Qwen3Target(tcfg, rows=301)
    compact.load_state_dict({k: (v[:301] if k == "model.embed_tokens.weight" else v).float() for k, v in sd.items()})
    hf = Qwen3ForCausalLM.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()
    ids = torch.tensor([json.loads(x)["input_ids"] for x in (pair / "prompts.jsonl").read_text().splitlines()])
    with torch.no_grad():
        full = torch.log_softmax(hf(ids).logits, -1)
        z = compact.dist(compact(ids)[0])
    got = torch.log_softmax(z, -1)
    torch.testing.assert_close(got[..., :300], full[..., :300], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[..., 300], full[..., 300:].logsumexp(-1), rtol=1e-4, atol=1e-4)
    # sampling at T = 1 from the compact model draws the shared row with the 212 ids' total mass
    g = torch.Generator().manual_seed(0)
    tiny = dict(tcfg, vocab_size=4, hidden_size=4, intermediate_size=4, num_hidden_layers=0, num_attention_heads=1,
                num_key_value_heads=1, head_dim=4)
    m = tm.Qwen3Target(tiny, rows=2)  # ids 1, 2, 3 share row 1
    with torch.no_grad():
        m.model.embed_tokens.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0.0, 1, 0, 0]]))
        m.model.norm.weight.fill_(1.0)
        draws = m.generate(torch.zeros(4000, 1, dtype=torch.long), 1, temperature=1.0, generator=g)
    h = torch.tensor([[1.0, 0, 0, 0]]) * 2.0  # the normed embedding of id 0 (rms 0.5)
    p_shared = 3 * torch.exp(h[0, 1]) / (torch.exp(h[0, 0]) + 3 * torch.exp(h[0, 1]))
    assert abs(float((draws == 1).float().mean()) - float(p_shared)) < 0.03


def test_kv_cached_generation_equals_full_forward_argmax(pair):
    target, _ = _load_ours(pair)
    prompts = torch.tensor([json.loads(x)["input_ids"] for x in (pair / "prompts.jsonl").read_text().splitlines()])
    cont = target.generate(prompts, 6)
    seq = prompts
    for _ in range(6):  # greedy by full recomputation
        logits, _ = target(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(cont, seq[:, prompts.shape[1]:])


def test_training_blocks_see_only_context_before_the_anchor(pair):
    """The batched training forward (all anchors at once, one dense mask) equals the serving-style
    computation per anchor: context K/V of positions < a only, then the block alone, non-causal."""
    target, drafter = _load_ours(pair)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 20), generator=g)
    anchors = torch.tensor([[4, 9, 15], [6, 7, 16]])
    with torch.no_grad():
        _, feats = target(ids, capture=drafter.target_layer_ids)
        batched = tm.draft_logits(drafter, target, ids, feats, anchors)  # [2, 3, B-1, V]
        bsz = drafter.block_size
        for b in range(2):
            for n, a in enumerate(anchors[b].tolist()):
                blk = torch.full((1, bsz), drafter.mask_token_id)
                blk[0, 0] = ids[b, a]
                pos = torch.arange(a, a + bsz)[None]
                mask = torch.ones(1, bsz, a + bsz, dtype=torch.bool)
                h = drafter(target.model.embed_tokens(blk), pos, feats[b : b + 1, :a], torch.arange(a)[None], mask)
                alone = target.logits(h)[0, 1:]
                torch.testing.assert_close(batched[b, n], alone, rtol=1e-5, atol=1e-5)


def test_time_guard_lays_the_schedule_over_the_steps_that_fit(monkeypatch):
    """fit_steps: after PROBE_STEPS steps, a loop whose rate leaves room for fewer steps than
    planned gets the schedule over 97% of what fits (so its LR still reaches 0 by the guard); one
    with room keeps its steps; no change at any other step."""
    now = [100.0]
    monkeypatch.setattr(ttp.time, "time", lambda: now[0])
    t0, deadline = 0.0, 200.0  # 20 steps took 100 s: 0.2 steps/s, 100 s left -> 20 more steps fit
    assert ttp.fit_steps(ttp.PROBE_STEPS, 1000, t0, deadline) == ttp.PROBE_STEPS + int(0.97 * 0.2 * 100)
    assert ttp.fit_steps(ttp.PROBE_STEPS, 30, t0, deadline) == 30
    assert ttp.fit_steps(ttp.PROBE_STEPS + 1, 1000, t0, deadline) == 1000
    assert ttp.fit_steps(5, 1000, t0, deadline) == 1000
    lrs = [tm.cosine_lr(s, 39, 1.0, 0.04) for s in range(39)]
    assert lrs[-1] < 0.01 and max(lrs) <= 1.0


def test_loss_labels_are_unshifted_and_decay_weighted():
    """Slot k is labelled ids[a+k]; a model that puts all mass on exactly those labels has zero loss,
    and one that is wrong only at slot 1 has the loss of slot 1 times its weight share."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    anchors = torch.tensor([[1, 3]])
    L, V = 3, 16
    logits = torch.full((1, 2, L, V), -1e4)
    for n, a in enumerate(anchors[0].tolist()):
        for k in range(1, L + 1):
            logits[0, n, k - 1, ids[0, a + k]] = 0.0
    mask = torch.ones_like(ids)
    loss, acc = tm.dflash_loss(logits, ids, anchors, mask, gamma=2.0)
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and acc.tolist() == [1.0] * L
    wrong = logits.clone()
    wrong[0, :, 0] = 0.0  # uniform at slot 1: CE = log V
    loss2, _ = tm.dflash_loss(wrong, ids, anchors, mask, gamma=2.0)
    w = torch.exp(-torch.arange(L).float() / 2.0)
    assert float(loss2) == pytest.approx(float(torch.log(torch.tensor(float(V))) * w[0] / w.sum()), rel=1e-5)


@pytest.mark.sglang
@pytest.mark.slow
def test_drafter_loads_into_sglang_dflash_draft_model(pair):
    if importlib.util.find_spec("sglang") is None:  # find, never import: the overlay tests need sglang unimported
        pytest.skip("sglang is not installed")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "tiny_pair_sglang_load.py"), str(pair / "draft")],
                       capture_output=True, text=True, timeout=300, cwd=str(pair))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    dcfg = json.loads((pair / "draft" / "config.json").read_text())
    bad = {k: v for k, v in res["params"].items() if not v["ok"]}
    assert not bad
    assert res["unused_checkpoint_names"] == []
    assert res["block_size"] == dcfg["block_size"]
    assert res["num_context_features"] == len(dcfg["dflash_config"]["target_layer_ids"])
    # every tensor of our drafter reached a parameter (fused names included)
    from safetensors.torch import load_file

    assert set(load_file(str(pair / "draft" / "model.safetensors"))) == {s for v in res["params"].values() for s in v["from"]}


def test_offline_tree_acceptance_equals_brute_force():
    """tree_accepted_depth: the longest prefix of the target's tokens that is a root path of the
    tree, checked against the set of all node paths built from parents, on random trees."""
    import ddtree_reference as dr
    import ddtree_utils as du

    g = torch.Generator().manual_seed(7)
    n, L, K = 64, 6, 4
    logits = torch.randn(n, L, 12, generator=g) * 2
    lp, ids = du.draft_topk_logprobs(logits, K, backend="torch")
    # truths that follow the drafter's top choices for a while, then diverge
    truth = torch.randint(0, 12, (n, L), generator=g)
    follow = torch.randint(0, L + 1, (n,), generator=g)
    for r in range(n):
        for d in range(int(follow[r])):
            truth[r, d] = ids[r, d, int(torch.randint(0, 2, (1,), generator=g))]
    for budget in (1, 5, 17):
        tree = dr.build_tree_reference(lp, ids, budget)
        got = ttp.tree_accepted_depth(tree, truth)
        for r in range(n):
            paths = {(): True}
            node_path = {0: ()}
            for j in range(budget):
                if tree.node_valid[r, j]:
                    node_path[j + 1] = node_path[int(tree.parents[r, j])] + (int(tree.tokens[r, j]),)
                    paths[node_path[j + 1]] = True
            want = max(d for d in range(L + 1) if tuple(truth[r, :d].tolist()) in paths)
            assert int(got[r]) == want, (budget, r)


def test_walk_rounds_follows_the_commits():
    acc = torch.tensor([[2, 9, 9, 0, 1, 9, 9], [0, 0, 6, 9, 9, 9, 9]])
    pred = torch.arange(14, dtype=torch.float32).view(2, 7)
    tau, p, n = ttp.walk_rounds(acc, pred)
    # row 0 visits anchors 0 (3 tokens), 3 (1), 4 (2), 6 (10); row 1: 0, 1, 2 (7)
    taus = [3, 1, 2, 10, 1, 1, 7]
    preds = [0, 3, 4, 6, 7, 8, 9]
    assert n == len(taus) and tau == pytest.approx(sum(taus) / len(taus)) and p == pytest.approx(sum(preds) / len(preds))


def test_offline_accept_tool_reproduces_the_training_eval_and_takes_temperatures(pair, tmp_path):
    """bench/offline_accept.py at tau 1 on the eval's prompts gives the training run's own eval.json
    numbers (same walk, recomputed from the saved checkpoint); at tau 0.5 DFLASH's predicted chain
    is longer (a sharper top-1) and the budgets' trees are still valid walks; bad lists are one error."""
    ev = json.loads((pair / "eval.json").read_text())
    out = tmp_path / "o.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    tool = [sys.executable, str(ROOT / "bench" / "offline_accept.py"), "--pair", str(pair), "--device", "cpu"]
    r = subprocess.run([*tool, "--prompts", str(ev["prompts"]), "--gen-len", str(ev["gen_len"]), "--budgets", "3,7",
                        "--taus", "1,0.5", "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["prompt_len"] == ev["prompt_len"]
    one, half = got["by_tau"]["1.0"], got["by_tau"]["0.5"]
    for key in ("dflash", "ddtree_b3", "ddtree_b7"):
        assert one[key] == ev[key], key
        assert half[key]["rounds"] >= 1
    assert half["dflash"]["predicted_accept"] > one["dflash"]["predicted_accept"]
    assert "| 0.5 |" in r.stdout and "| 1 |" in r.stdout
    bad = subprocess.run([*tool, "--budgets", "3,x"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "--budgets" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([*tool[:-4], "--pair", str(empty), "--device", "cpu", "--json", str(tmp_path / "none.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "not a trained pair" in r.stderr
    assert list(empty.iterdir()) == [] and not (tmp_path / "none.json").exists()
