"""Gate 6: smoke-test a build against the real, installed sglang package.

    python checks/sglang_smoke.py --build build/sglang-0.5.13.post1

Exit codes: 0 passed, 1 a check failed, 2 bad arguments (no such build), 77 skipped (no sglang
installed in this Python, or one of another version than the build's pin: gate 6 puts the pin's
site first on PYTHONPATH). Human progress goes to stderr; the last stdout line is the summary.

The build is laid over a copy of the installed package (an "overlay": hard links where possible,
so it is cheap; files the build replaces are unlinked first, never written through). A fresh
Python then imports from the overlay with TRITON_INTERPRET=1 (sglang's Triton helpers run on CPU)
and checks: every patched module imports from the overlay; `prepare_server_args` accepts a DDTREE
configuration and derives the expected fields; an invalid budget is rejected with its message;
and, when the build has `DDTreeVerifyInput`, one tiny tree verify matches ddtree_utils' reference.
A build of an empty series (a pin in preparation) is checked for its imports only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OK, FAILED, USAGE, SKIPPED = 0, 1, 2, 77
# Build metadata, not package files: deploy.build.buildinfo.METADATA_NAMES, repeated because this
# module stays stdlib-only (it also runs as a script in the overlay Python); a test keeps them equal.
METADATA_NAMES = frozenset({"BUILD-MANIFEST.json", "GATES.json"})
REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "sglang" / "fixtures.py"
# Pins whose DDTREE runs on the v1 DFlash worker, which needs the overlap scheduler off.
NO_OVERLAP_PINS = frozenset({"0.5.13.post1"})


def build_manifest(build_dir: Path) -> dict:
    """The build's BUILD-MANIFEST.json ({} when absent or unreadable)."""
    try:
        return json.loads((Path(build_dir) / "BUILD-MANIFEST.json").read_text())
    except (OSError, ValueError):
        return {}


def installed_version(pkg: Path) -> str | None:
    """The version of the sglang distribution installed beside the package dir `pkg`."""
    import importlib.metadata

    for dist in importlib.metadata.distributions(path=[str(Path(pkg).parent)]):
        if (dist.metadata["Name"] or "").lower() == "sglang":
            return dist.version
    return None


def find_installed_sglang() -> Path | None:
    """The installed `sglang/` package dir, found without importing it (None if absent)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def build_files(build_dir: Path) -> list[str]:
    """Package-relative paths of every file in a build (the manifest excluded)."""
    root = Path(build_dir)
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name not in METADATA_NAMES
    )


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def make_overlay(build_dir: Path, dest: Path, installed: Path | None = None) -> Path:
    """Lay `build_dir` over a copy of the installed sglang at `dest/sglang`; return `dest`.

    Put `dest` first on sys.path (or PYTHONPATH) before sglang is imported. Byte-code caches of
    the replaced files are dropped so Python cannot pick up the upstream compiled version.
    """
    installed = installed or find_installed_sglang()
    if installed is None:
        raise RuntimeError("sglang is not installed in this Python")
    pkg = Path(dest) / "sglang"
    shutil.copytree(installed, pkg, copy_function=_link_or_copy)
    for rel in build_files(build_dir):
        target = pkg / rel
        if target.exists():
            target.unlink()  # may be a hard link into site-packages: never write through it
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(build_dir) / rel, target)
        cache = target.parent / "__pycache__"
        for pyc in cache.glob(f"{target.stem}.*.pyc") if rel.endswith(".py") else ():
            pyc.unlink()
    return Path(dest)


def module_name(relpath: str) -> str | None:
    """`srt/speculative/spec_info.py` -> `sglang.srt.speculative.spec_info` (None for non-.py)."""
    if not relpath.endswith(".py"):
        return None
    parts = relpath[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["sglang", *parts])


def overlay_env(overlay_root: Path) -> dict[str, str]:
    """Environment for a Python that must import sglang from the overlay."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(overlay_root), *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_INTERPRET"] = "1"
    env.setdefault("SGLANG_LOGGING_LEVEL", "WARNING")
    return env


def run_probe(build_dir: Path, overlay_root: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run the probe (below) in a fresh Python that imports sglang from the overlay."""
    cmd = [sys.executable, __file__, "--probe", "--build", str(build_dir), "--overlay", str(overlay_root)]
    return subprocess.run(cmd, env=overlay_env(overlay_root), capture_output=True, text=True,
                          timeout=timeout_s, check=False)


# ------------------------------------------------------------------------------------------------
# The probe: runs inside the overlay Python (sglang importable from the overlay).


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_fixtures():
    spec = importlib.util.spec_from_file_location("_ddtree_fixtures", FIXTURES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe_imports(build_dir: Path, overlay_root: Path) -> list[str]:
    """Import every patched module; each must come from the overlay."""
    import importlib

    names = [n for n in map(module_name, build_files(build_dir)) if n]
    for name in names:
        mod = importlib.import_module(name)
        where = Path(mod.__file__).resolve()
        if Path(overlay_root).resolve() not in where.parents:
            raise AssertionError(f"{name} was imported from {where}, not from the overlay")
    return names


def probe_server_args(models_root: Path, version: str | None = None) -> dict:
    """Parse one DDTREE configuration and check one rejection."""
    from sglang.srt.server_args import prepare_server_args

    dirs = _load_fixtures().write_model_dirs(models_root, block_size=16)
    base = ["--model-path", str(dirs.target), "--device", "cuda", "--attention-backend", "triton",
            "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(dirs.draft)]
    args = prepare_server_args([*base, "--speculative-ddtree-budget", "31"])
    got = {
        "algorithm": args.speculative_algorithm,
        "budget": args.speculative_ddtree_budget,
        "block_size": args.speculative_dflash_block_size,
        "num_draft_tokens": args.speculative_num_draft_tokens,
        # Per-decode KV reservation (spec v1, page 1): a round's peak, max(block, budget + 1).
        "kv_reservation": max(args.speculative_num_steps * args.speculative_eagle_topk,
                              args.speculative_num_draft_tokens),
        "overlap_disabled": args.disable_overlap_schedule,
    }
    want = {"algorithm": "DDTREE", "budget": 31, "block_size": 16, "num_draft_tokens": 32,
            "overlap_disabled": version in NO_OVERLAP_PINS or version is None}
    # spec v1 (0.5.13.post1): the reservation is a round's peak; spec v2 pins keep num_steps = depth.
    if want["overlap_disabled"]:
        want["kv_reservation"] = 32
    else:
        want["num_steps"] = 15
    got["num_steps"] = args.speculative_num_steps
    got = {k: got[k] for k in want}
    if got != want:
        raise AssertionError(f"DDTREE server args: got {got}, want {want}")
    if args.speculative_eagle_topk < 2:
        raise AssertionError(f"speculative_eagle_topk must be > 1 for tree verify, got {args.speculative_eagle_topk}")
    try:
        prepare_server_args([*base, "--speculative-ddtree-budget", "0"])
    except ValueError as e:
        if "--speculative-ddtree-budget" not in str(e):
            raise AssertionError(f"budget 0 rejected with an unclear message: {e}") from e
    else:
        raise AssertionError("--speculative-ddtree-budget 0 was accepted")
    return got


_BS, _DEPTH, _VOCAB, _BUDGET = 2, 4, 12, 5  # the probes' round: 2 requests, N = 6 verify nodes


def _probe_tree(gen, prefix_lens, **compile_kw):
    """The probes' tree and target: ``(compiled tree, candidates [2, N], target predictions
    [2, N])``. Request 0's target agrees with the first child at every node (a path is
    accepted); request 1's agrees with nothing (only the bonus)."""
    import torch
    from sglang.srt.speculative import ddtree_utils as du

    import ddtree_reference as dr

    logp, ids = du.draft_topk_logprobs(torch.randn(_BS, _DEPTH, _VOCAB, generator=gen), 3)
    tree = dr.build_tree_reference(logp, ids, _BUDGET)
    ct = du.compile_tree(tree, torch.tensor([7, 9]), prefix_lens, **compile_kw)
    cand = ct.draft_tokens.view(_BS, _BUDGET + 1)
    first_child = cand.gather(1, ct.retrieve_next_token.clamp(min=0))
    predict = torch.where(ct.retrieve_next_token >= 0, first_child, torch.full_like(first_child, _VOCAB - 1))
    predict[1, 0] = next(t for t in range(_VOCAB) if t not in cand[1].tolist())  # root child: none
    return ct, cand, predict


def probe_verify() -> str:
    """One tiny greedy DDTreeVerifyInput verify against ddtree_utils' reference, when present.

    Real ReqToTokenPool, TokenToKVPoolAllocator, ChunkCache and Req objects on CPU; the
    ScheduleBatch is a namespace holding just the fields verify reads (a full ScheduleBatch
    needs a running scheduler). Request 0's target agrees with the first child at every node
    (a path is accepted); request 1's target agrees with nothing (only the bonus).
    """
    from types import SimpleNamespace

    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import ddtree_utils as du
    if not _has_module("sglang.srt.speculative.ddtree_info"):
        return "DDTreeVerifyInput not in this build: verify skipped"
    from sglang.srt.speculative import ddtree_info
    gen = torch.Generator().manual_seed(0)
    bs, depth, vocab, budget, hid = _BS, _DEPTH, _VOCAB, _BUDGET, 3
    n = budget + 1
    seq_lens = torch.tensor([5, 3])
    ct, cand, predict = _probe_tree(gen, seq_lens)

    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(size=128, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=False)
    cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                       page_size=1))
    params = SamplingParams(max_new_tokens=64)
    params.normalize(None)  # what the tokenizer manager does (stop strings -> lists)
    reqs = [Req(rid=f"r{b}", origin_input_text="", origin_input_ids=list(range(3, 3 + int(seq_lens[b]))),
                sampling_params=params, vocab_size=vocab) for b in range(bs)]
    rpi = torch.tensor([1, 2])
    for b in range(bs):
        pool.req_to_token[rpi[b], : int(seq_lens[b])] = alloc.alloc(int(seq_lens[b])).to(pool.req_to_token.dtype)
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, reqs=reqs, device="cpu", tree_cache=cache,
        req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, req_pool_indices=rpi,
        seq_lens=seq_lens.clone(), seq_lens_cpu=seq_lens.clone(), seq_lens_sum=int(seq_lens.sum()),
        sampling_info=None, input_ids=None, out_cache_loc=None, batch_size=lambda: bs,
    )
    vi = ddtree_info.DDTreeVerifyInput(
        draft_token=ct.draft_tokens, positions=ct.positions, draft_token_num=n, custom_mask=ct.custom_mask,
        retrieve_index=ct.retrieve_index, retrieve_next_token=ct.retrieve_next_token,
        retrieve_next_sibling=ct.retrieve_next_sibling, max_depth=depth,
    )
    vi.prepare_for_verify(batch, page_size=1)
    slots = batch.out_cache_loc.clone()
    free_before = alloc.available_size()
    logits = torch.nn.functional.one_hot(predict.view(-1), vocab).float() * 8
    hidden = torch.randn(bs * n, hid, generator=gen)
    out = LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden.clone())
    new_bonus, commit_lens, next_hidden, _ = vi.verify(batch=batch, logits_output=out, page_size=1)

    acc_idx, acc_len, bonus = du.verify_greedy_reference(cand, ct.retrieve_next_token, ct.retrieve_next_sibling,
                                                         predict, depth)
    plan = du.accept_plan(acc_idx, acc_len, slots)
    checks = {
        "bonus": torch.equal(new_bonus.long(), bonus),
        "commit_lens": torch.equal(commit_lens.long(), acc_len + 1),
        "one path accepted": int(acc_len[0]) >= 1 and int(acc_len[1]) == 0,
        "freed slots": alloc.available_size() - free_before == bs * n - int((acc_len + 1).sum()),
        "hidden": torch.equal(next_hidden, hidden[plan.hidden_index]),
        "seq_lens": torch.equal(batch.seq_lens, seq_lens + acc_len + 1),
    }
    start = 0
    for b in range(bs):
        c, s0 = int(acc_len[b]) + 1, int(seq_lens[b])
        path = cand[b, acc_idx[b, 1:c]].tolist() + [int(bonus[b])]
        checks[f"output_ids[{b}]"] = list(reqs[b].output_ids) == path
        written = pool.req_to_token[rpi[b], s0 : s0 + c].long()
        checks[f"req_to_token[{b}]"] = torch.equal(written, plan.keep_slots[start : start + c])
        start += c
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise AssertionError(f"DDTreeVerifyInput.verify differs from ddtree_utils' reference: {bad}")
    return f"tree verify matches the reference (accepted {acc_len.tolist()})"


def probe_round_v2() -> str:
    """One tiny greedy DDTREE round of the spec-v2 worker (0.5.16 builds) on the CPU.

    Real ReqToTokenPool, TokenToKVPoolAllocator and MHATokenToKVPool: the verify slots read
    from req_to_token, the tree walk (ddtree_utils.accept_tree_greedy), the commit layout, and the KV move
    of the accepted path both ways the worker makes it (one ddtree_utils.move_kv_rows over
    DDTreeWorkerV2._target_kv_rows, and the pool's own move_kv_cache through the staging
    slots): every committed slot of every layer must hold its path node's KV, and the
    scheduler's tokens must be the accepted path plus the bonus. Request 0's target agrees
    with the first child at every node, request 1's with nothing.
    """
    from types import SimpleNamespace

    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.speculative import ddtree_utils as du
    from sglang.srt.speculative.ddtree_worker_v2 import DDTreeWorkerV2

    bs, depth, budget, block = _BS, _DEPTH, _BUDGET, 8
    n, width = budget + 1, budget + 1 + depth + 1  # verify nodes + staging of the KV move
    prefix = torch.tensor([5, 3])
    ct, cand, predict = _probe_tree(torch.Generator().manual_seed(0), prefix,
                                    build_custom_mask=False, max_depth=depth)  # fmt: skip

    pool = ReqToTokenPool(size=bs + 1, max_context_len=64, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(128, torch.bfloat16, "cpu", None, False)
    rows = torch.tensor([1, 2])
    for b in range(bs):
        pool.write((int(rows[b]), slice(0, int(prefix[b]) + width)),
                   alloc.alloc(int(prefix[b]) + width).to(torch.int32))  # fmt: skip
    slots = du.verify_slots(pool.req_to_token, rows, prefix, width)
    acc_idx, acc_len, bonus = du.accept_tree_greedy(cand, predict, torch.arange(bs * n).view(bs, n),
                                                    ct.retrieve_next_token, ct.retrieve_next_sibling, depth)  # fmt: skip
    ref = du.verify_greedy_reference(cand, ct.retrieve_next_token, ct.retrieve_next_sibling, predict, depth)
    out, commit, path = du.tree_commit_layout(acc_idx, acc_len, bonus, cand, block)

    size = int(slots.max()) + 1
    kv = [MHATokenToKVPool(size, 1, torch.float32, 2, 8, 2, "cpu", False, enable_kv_cache_copy=True)
          for _ in range(2)]  # fmt: skip
    for p in kv:
        for layer, buf in enumerate(p.k_buffer + p.v_buffer):
            for b in range(bs):  # the KV of verify node j of request b in this layer
                vals = (layer * 1000 + b * 100 + torch.arange(n)).float()
                buf[slots[b, :n]] = vals.view(n, 1, 1).expand(n, *buf.shape[1:])
    worker = SimpleNamespace(_kv_rows=None, model_runner=SimpleNamespace(token_to_kv_pool=kv[0]))
    kv_rows = DDTreeWorkerV2._target_kv_rows(worker)
    if not kv_rows:
        raise AssertionError("DDTreeWorkerV2._target_kv_rows refused a plain MHATokenToKVPool")
    du.move_kv_rows(kv_rows, *du.kv_path_locs(slots, path, n, depth))
    for tgt, src in du.kv_move_locs(slots, path, n, depth):
        kv[1].move_kv_cache(tgt, src)
    checks = {
        "walk": all(torch.equal(a, r) for a, r in zip((acc_idx, acc_len, bonus), ref)),
        "one path accepted": int(acc_len[0]) >= 1 and int(acc_len[1]) == 0,
        "commit_lens": torch.equal(commit.long(), acc_len + 1),
    }
    flat = out.reshape(-1).tolist()
    for b in range(bs):
        c = int(commit[b])
        want = [int(cand[b, j]) for j in acc_idx[b, 1:c]] + [int(bonus[b])]
        checks[f"tokens[{b}]"] = flat[b * block : b * block + c] == want
        for way, p in zip(("move_kv_rows", "move_kv_cache"), kv):
            got = [buf[slots[b, :c], 0, 0].tolist() for buf in p.k_buffer + p.v_buffer]
            checks[f"kv {way}[{b}]"] = got == [
                [layer * 1000 + b * 100 + int(j) for j in acc_idx[b, :c]] for layer in range(len(got))
            ]
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise AssertionError(f"the spec-v2 DDTREE round differs from ddtree_utils' reference: {bad}")
    return f"spec-v2 tree round matches the reference (accepted {acc_len.tolist()}, KV moved both ways)"


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _installed() -> str:
    import sglang

    return getattr(sglang, "__version__", "?")


def probe_main(build_dir: Path, overlay_root: Path) -> int:
    import time

    t0 = time.time()
    names = probe_imports(build_dir, overlay_root)
    _say(f"ok: {len(names)} patched modules import from the overlay ({time.time() - t0:.1f} s)")
    manifest = build_manifest(build_dir)
    if "patches" in manifest and not manifest["patches"]:  # a build of an empty series (no manifest: probe)
        print(f"sglang smoke passed: {len(names)} modules import into sglang {_installed()} "
              "(empty series: no DDTREE to probe)")
        return OK
    with tempfile.TemporaryDirectory(prefix="ddtree-smoke-models-") as tmp:
        got = probe_server_args(Path(tmp), manifest.get("sglang_version"))
    _say(f"ok: prepare_server_args DDTREE -> {json.dumps(got)}; budget 0 rejected")
    verify = probe_round_v2() if _has_module("sglang.srt.speculative.ddtree_info_v2") else probe_verify()
    _say(f"ok: {verify}")
    print(f"sglang smoke passed: {len(names)} modules import into sglang {_installed()}, DDTREE args parse and "
          f"validate, {verify}")
    return OK


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python checks/sglang_smoke.py", description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="the build dir (build/sglang-<version>)")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overlay", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not a.build.is_dir() or not build_files(a.build):
        print(f"error: {a.build}: not a build directory (run `ddtree-deploy patch` first)", file=sys.stderr)
        return USAGE
    if a.probe:
        try:
            return probe_main(a.build, a.overlay)
        except Exception as e:  # one clear line; the traceback goes to stderr for the gate's tail
            import traceback

            traceback.print_exc()
            print(f"sglang smoke FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return FAILED
    installed = find_installed_sglang()
    if installed is None:
        print("skipped: sglang is not installed in this Python (see scripts/install_sglang_env.sh)")
        return SKIPPED
    want, have = build_manifest(a.build).get("sglang_version"), installed_version(installed)
    if want and have != want:
        print(f"skipped: this Python imports sglang {have} from {installed}, the build is for {want} "
              f"(scripts/install_sglang_env.sh installs it into <venv>/sglang-sites/{want})")
        return SKIPPED
    with tempfile.TemporaryDirectory(prefix="ddtree-overlay-") as tmp:
        _say(f"overlay: {installed} + {a.build} -> {tmp}")
        root = make_overlay(a.build, Path(tmp), installed)
        try:
            proc = run_probe(a.build, root)
        except subprocess.TimeoutExpired:
            print("sglang smoke FAILED: probe timed out")
            return FAILED
    sys.stderr.write(proc.stderr)
    sys.stdout.write(proc.stdout)
    return OK if proc.returncode == 0 else FAILED


if __name__ == "__main__":
    if "--probe" in sys.argv:  # run as a script inside the overlay Python: make `checks` importable
        sys.path.append(str(REPO_ROOT))
    sys.exit(main())
