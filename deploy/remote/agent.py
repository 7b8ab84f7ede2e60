"""Host-side helper, stdlib only, run with the service's own python (nothing is installed on the
host); prints one result line `@@ddtree-agent@@ <json>`.

How it gets there (deploy.remote.agent_client): the first call of a connection sends this source as
`python -c <source> <op> <json> --save <path>`; the agent answers, then stores its source at <path>
(`<state_dir>/ddtree-agent-<sha256[:16]>.py`, temp file + rename); later calls of that connection
run `python <path> <op> <json>`, a few hundred bytes each. A host that cannot store it (full disk)
gets the source with every call, as before.

The protocol is one table, OPS below: each operation's name, handler and the payload keys it
requires and accepts. The client imports the same table (deploy.remote.agent_client) and refuses a
call that does not fit it before anything is sent; the agent dispatches through it.

Ops: facts, hashes, lock, unlock, stage, verify, apply, journal, record, prune, read, http. Each is
small and all-or-nothing where it changes files: `apply` checks every source, then writes every new
file as a temp file next to its destination (same filesystem) and hard-links every old file beside
it; only then does it rename file by file (atomic per file, no space needed). Any write failure
removes every temp file and puts back every file already renamed before it answers.

Every transition has a journal, releases/<id>/journal.jsonl: one JSON line per step, appended and
fsynced *before* the step runs (see docs/DEPLOY.md, "Journal and recovery").
"""

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

MARK = "@@ddtree-agent@@"


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha_or_none(path):
    return _sha(path) if os.path.isfile(path) else None


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # ENOSPC, ...: the old file stays as it was, no temp file is left behind
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


TERMINAL = ("healthy", "rolled-back", "aborted")
TMP_KINDS = ("new", "old")


def _fsync_dir(d):
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _journal(state, rid, step, **info):
    """Append one fsynced line to the release's journal (the directory entry fsynced when new)."""
    d = os.path.join(state, "releases", rid)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "journal.jsonl")
    new = not os.path.exists(path)
    line = json.dumps(dict(info, step=step, time=time.time()), sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            data = line.encode()
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        except OSError:  # ENOSPC: cut a torn line off, or the next step's line would be glued to it
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)
    if new:
        _fsync_dir(d)


def _read_journal(state, rid):
    out = []
    try:
        with open(os.path.join(state, "releases", rid, "journal.jsonl")) as f:
            for ln in f:
                try:
                    out.append(json.loads(ln))
                except ValueError:  # a line torn by a crash: the step it announced did not start
                    pass
    except OSError:
        pass
    return out


def _unfinished(state):
    """Transitions whose journal does not end in a terminal step."""
    root = os.path.join(state, "releases")
    out = []
    for rid in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        j = _read_journal(state, rid)
        if j and j[-1].get("step") not in TERMINAL:
            rec = _read_json(os.path.join(root, rid, "release.json")) or {}
            cause = next((e.get("reason") for e in j if e.get("step") == "rolling-back"), None)
            out.append({"release": rid, "action": rec.get("action"), "steps": [e.get("step") for e in j], "cause": cause,
                        "last": j[-1], "files_touched": any(e.get("step") in ("swapping", "restoring") for e in j),
                        "has_backup": "backup" in rec})
    return out


def _tmp_path(sd, rel, tag, kind):
    dest = _dest(sd, rel)
    return os.path.join(os.path.dirname(dest), ".%s.ddtree-%s.%s" % (os.path.basename(dest), tag, kind))


def _remove_tmps(sd, rels, tags):
    removed = []
    for rel in rels:
        for tag in tags:
            for kind in TMP_KINDS + ("tmp",):
                path = _tmp_path(sd, rel, tag, kind)
                if os.path.lexists(path):
                    os.unlink(path)
                    removed.append(path)
    return removed


class HostConfigError(Exception):
    """The inventory does not fit the host (the client reports a configuration error, exit 2)."""


def _sglang_dir(given):
    if given:
        return given
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise HostConfigError("sglang is not importable with %s (check `python` or `sglang_dir` in the inventory)"
                              % sys.executable)
    return list(spec.submodule_search_locations)[0]


def _version(sglang_dir):
    for name in ("_version.py", "version.py"):
        try:
            with open(os.path.join(sglang_dir, name)) as f:
                m = re.search(r"""^__version__\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", f.read(), re.MULTILINE)
            if m:
                return m.group(1)
        except OSError:
            pass
    import importlib.metadata

    return importlib.metadata.version("sglang")


def _free_bytes(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or "/").free


def _free_mb(path):
    return _free_bytes(path) // (1 << 20)


# Targets are package paths relative to sglang_dir, or absolute paths (the launch env file,
# deploy/config/launch.py). An absolute target lives at its own path; its copies under a release's files/
# and backup/ and under pristine/ are stored as @abs/<path> (os.path.join(root, "/etc/x") would
# be "/etc/x" itself).
ABS = "@abs"


def _dest(sd, rel):
    return rel if os.path.isabs(rel) else os.path.join(sd, rel)


def _store(root, rel):
    return os.path.join(root, ABS + rel) if os.path.isabs(rel) else os.path.join(root, rel)


def _check_writable(path):
    """An absolute target must be replaceable by this user (rename in its directory) before
    anything is staged: the launch env file often lives in /etc."""
    d = os.path.dirname(path)
    while d and not os.path.isdir(d):
        d = os.path.dirname(d)
    if not os.access(d or "/", os.W_OK):
        raise RuntimeError("cannot replace %s: directory %s is not writable by this user" % (path, d))


def _releases(state_dir):
    root = os.path.join(state_dir, "releases")
    out = []
    if os.path.isdir(root):
        for rid in sorted(os.listdir(root)):
            rec = _read_json(os.path.join(root, rid, "release.json"))
            if rec is not None:
                out.append(rec)
    return out


def _read_b64(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode()


def op_facts(p):
    """Everything a command needs to know about the host, in one call: python, sglang location and
    version, hashes of the target files (`files`, or `files_by_version`[version]: the build of the
    host's pin, chosen here since the version is read here), disk, current.json, lock, releases,
    unfinished transitions, the live hashes of the files current.json names (`current_files`), and
    the bytes of the files named in `read` (the [launch] env file)."""
    sd = _sglang_dir(p.get("sglang_dir"))
    state = p["state_dir"]
    version = _version(sd)
    rels = p["files"] if p.get("files") is not None else (p.get("files_by_version") or {}).get(version, [])
    files = {}
    for rel in rels:
        path = _dest(sd, rel)
        files[rel] = {"sha256": _sha(path), "size": os.path.getsize(path)} if os.path.isfile(path) else None
    pristine_root = os.path.join(state, "pristine")
    pristine = {rel: _sha_or_none(_store(pristine_root, rel)) for rel in rels}
    current = _read_json(os.path.join(state, "current.json"))
    out = {
        "python": sys.executable,
        "hostname": __import__("socket").gethostname(),
        "unfinished": _unfinished(state),
        "sglang_dir": sd,
        "version": version,
        "files": files,
        "free_mb": {"sglang": _free_mb(sd), "state": _free_mb(state)},
        "free_bytes": {"sglang": _free_bytes(sd), "state": _free_bytes(state)},
        "current": current,
        "lock": _read_json(os.path.join(state, "lock", "owner.json")) or ({"owner": "?"} if os.path.isdir(os.path.join(state, "lock")) else None),
        "releases": _releases(state),
        "pristine_store": pristine,
        "read": {path: _read_b64(path) for path in p.get("read") or []},
    }
    if p.get("current_files"):
        out["current_files"] = {rel: _sha_or_none(_dest(sd, rel)) for rel in sorted((current or {}).get("files") or {})}
    return out


def op_hashes(p):
    """sha256 of each file: with `sglang_dir`, the live targets (an absolute one at its own path);
    with `root`, the copies in a store (pristine/, a release's files/ or backup/: @abs/<path>)."""
    if p.get("sglang_dir"):
        return {"files": {rel: _sha_or_none(_dest(p["sglang_dir"], rel)) for rel in p["files"]}}
    return {"files": {rel: _sha_or_none(_store(p["root"], rel)) for rel in p["files"]}}


def op_lock(p):
    state = p["state_dir"]
    os.makedirs(state, exist_ok=True)
    lock = os.path.join(state, "lock")
    made = False
    try:
        os.mkdir(lock)  # atomic: exactly one deploy wins
        made = True
    except FileExistsError:
        holder = _read_json(os.path.join(lock, "owner.json")) or {"owner": "?"}
        if not p.get("take_over") or holder.get("token") != p["take_over"]:
            return {"acquired": False, "holder": holder, "unfinished": _unfinished(state)}
        # the holder is known dead (checked by the caller against this exact token): take its lock over
    try:
        _write_json(os.path.join(lock, "owner.json"), dict(p["owner"], remote_time=time.time()))
    except OSError:  # ENOSPC on the state dir: leave no ownerless lock behind (a take-over keeps the old owner)
        if made:
            shutil.rmtree(lock, ignore_errors=True)
        raise
    return {"acquired": True}


def op_unlock(p):
    lock = os.path.join(p["state_dir"], "lock")
    holder = _read_json(os.path.join(lock, "owner.json"))
    if not os.path.isdir(lock):
        return {"released": False, "holder": None}
    if not p.get("force") and (holder or {}).get("token") != p.get("token"):
        return {"released": False, "holder": holder}
    shutil.rmtree(lock)
    return {"released": True, "holder": holder}


def op_stage(p):
    """Create releases/<id>/{files,backup}; back up what is on the host now; keep pristine copies.
    Journal: staging (before anything), staged (after release.json holds the backup). A write
    failure (ENOSPC, ...) removes what this op wrote and ends the journal with `aborted`."""
    sd, state, rid = p["sglang_dir"], p["state_dir"], p["release_id"]
    rdir = os.path.join(state, "releases", rid)
    for rel in p["files"]:
        if os.path.isabs(rel):
            _check_writable(rel)
    os.makedirs(rdir)
    made = []
    try:
        _journal(state, rid, "staging", action=p["record"].get("action"), files=len(p["files"]))
        os.makedirs(os.path.join(rdir, "files"))
        backup = {}
        for rel in p["files"]:
            src = _dest(sd, rel)
            if os.path.isfile(src):
                dst = _store(os.path.join(rdir, "backup"), rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(src, dst)
                backup[rel] = _sha(dst)
                if backup[rel] == p["pristine"].get(rel):
                    keep = _store(os.path.join(state, "pristine"), rel)
                    if not os.path.isfile(keep):
                        os.makedirs(os.path.dirname(keep), exist_ok=True)
                        tmp = keep + ".tmp-%d" % os.getpid()
                        made.append(tmp)
                        shutil.copyfile(dst, tmp)
                        os.replace(tmp, keep)
            else:
                backup[rel] = None
            os.makedirs(os.path.dirname(_store(os.path.join(rdir, "files"), rel)), exist_ok=True)
        rec = dict(p["record"], backup=backup, outcome="staging")
        _write_json(os.path.join(rdir, "release.json"), rec)
        _journal(state, rid, "staged")
    except OSError as exc:
        for path in made:
            if os.path.lexists(path):
                os.unlink(path)
        for sub in ("files", "backup"):
            shutil.rmtree(os.path.join(rdir, sub), ignore_errors=True)
        try:
            _write_json(os.path.join(rdir, "release.json"), dict(p["record"], outcome="aborted", error=str(exc)))
            _journal(state, rid, "aborted", error=str(exc))
        except OSError:  # even the journal cannot be written: drop the release directory entirely
            shutil.rmtree(rdir, ignore_errors=True)
        return {"ok": False, "error": "staging failed (%s); nothing changed" % exc}
    return {"ok": True, "backup": backup, "release_dir": rdir}


IMPORT_CHECK = r'''
import importlib.abc, importlib.util, json, os, sys
staged, sglang_dir, modules = json.loads(sys.argv[1])
class Overlay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in staged:
            src = staged[name]
            pkg = [os.path.dirname(os.path.join(sglang_dir, *name.split(".")[1:], "__init__.py"))] if src.endswith("__init__.py") else None
            return importlib.util.spec_from_file_location(name, src, submodule_search_locations=pkg)
        return None
sys.meta_path.insert(0, Overlay())
for m in modules:
    importlib.import_module(m)
print("import check ok:", ", ".join(modules))
'''


def _module_name(rel):
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["sglang"] + parts)


def op_verify(p):
    """Hashes of the uploaded files, a syntax check of each .py, then an import check of the staged
    modules with this python (the service's), before anything is swapped."""
    rdir = os.path.join(p["state_dir"], "releases", p["release_id"], "files")
    staged = {}
    for rel, sha in sorted(p["files"].items()):
        path = _store(rdir, rel)
        got = _sha_or_none(path)
        if got != sha:
            return {"ok": False, "stage": "upload", "error": "%s: uploaded file hash %s != build %s" % (rel, got, sha)}
        if rel.endswith(".py") and not os.path.isabs(rel):
            try:
                with open(path, "rb") as f:
                    compile(f.read(), path, "exec", dont_inherit=True)
            except SyntaxError as exc:
                return {"ok": False, "stage": "py_compile", "error": "%s: %s" % (rel, exc)}
            staged[_module_name(rel)] = path
    if not p.get("import_check", True) or not staged:
        return {"ok": True, "checked": sorted(staged)}
    modules = sorted(staged)
    arg = json.dumps([staged, p["sglang_dir"], modules])
    r = subprocess.run([sys.executable, "-c", IMPORT_CHECK, arg], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=p.get("timeout", 600))
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        return {"ok": False, "stage": "import", "error": "import check failed", "log": tail}
    return {"ok": True, "checked": modules}


def op_apply(p):
    """Make each target file what `targets` says: {rel: {"src": path | null, "sha256": hex | null}}.

    phase "swap" (the forward swap of release `release_id`) or "restore" (putting its backup back).
    1. check every source; 2. prepare: every new file as `.<name>.ddtree-<tag>.new` next to its
    destination, fsynced (a restore uses the `.old` hard link of the forward swap when it is intact:
    a rename, no space needed), and in a swap every existing file hard-linked as `.old`;
    3. rename file by file, journal `swapping`/`restoring` k/n before each. A failure in 2 removes
    every temp file (nothing changed); a failure in 3 renames the `.old` links back."""
    sd, tag, state, rid = p["sglang_dir"], p["tag"], p["state_dir"], p["release_id"]
    phase = p.get("phase", "swap")
    targets = p["targets"]
    rels = sorted(targets)
    for rel in rels:  # check everything first: all or nothing
        t = targets[rel]
        if t["src"] is not None and _sha_or_none(t["src"]) != t["sha256"]:
            return {"ok": False, "swapped": 0, "error": "%s: source %s is missing or does not match %s" % (rel, t["src"], t["sha256"])}
    made = []
    try:
        for rel in rels:
            t, dest = targets[rel], _dest(sd, rel)
            if phase == "swap" and os.path.isfile(dest):
                old = _tmp_path(sd, rel, tag, "old")
                if os.path.lexists(old):
                    os.unlink(old)
                os.link(dest, old)
                made.append(old)
            if t["src"] is None:
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            new = _tmp_path(sd, rel, tag, "new")
            fwd_old = _tmp_path(sd, rel, p.get("forward_tag") or "", "old") if phase == "restore" else None
            made.append(new)
            if fwd_old and os.path.isfile(fwd_old) and _sha(fwd_old) == t["sha256"]:
                os.replace(fwd_old, new)
            else:
                shutil.copyfile(t["src"], new)
                if os.path.exists(dest):
                    shutil.copymode(dest, new)
                with open(new, "rb") as f:
                    os.fsync(f.fileno())
    except OSError as exc:
        for path in made:
            if os.path.lexists(path):
                os.unlink(path)
        return {"ok": False, "swapped": 0, "error": "preparing the files failed (%s); every temp file removed, nothing changed" % exc}
    done = []
    try:
        for k, rel in enumerate(rels, 1):
            _journal(state, rid, "swapping" if phase == "swap" else "restoring", k=k, n=len(rels), file=rel)
            dest = _dest(sd, rel)
            if targets[rel]["src"] is None:
                if os.path.lexists(dest):
                    os.unlink(dest)
            else:
                os.replace(_tmp_path(sd, rel, tag, "new"), dest)  # atomic on one filesystem
            done.append(rel)
        for d in sorted({os.path.dirname(_dest(sd, r)) for r in rels if os.path.isdir(os.path.dirname(_dest(sd, r)))}):
            _fsync_dir(d)
    except OSError as exc:
        restored = phase == "swap"
        if phase == "swap":
            for rel in done:
                old, dest = _tmp_path(sd, rel, tag, "old"), _dest(sd, rel)
                try:
                    if os.path.lexists(old):
                        os.replace(old, dest)
                    elif os.path.lexists(dest):
                        os.unlink(dest)  # an added file
                except OSError:
                    restored = False
        _remove_tmps(sd, rels, [tag])
        files = {rel: _sha_or_none(_dest(sd, rel)) for rel in rels}
        return {"ok": False, "swapped": len(done), "restored": restored, "files": files,
                "error": "swap of %s failed (%s)" % (rels[len(done)], exc)}
    files = {rel: _sha_or_none(_dest(sd, rel)) for rel in rels}
    bad = {rel: sha for rel, sha in files.items() if sha != targets[rel]["sha256"]}
    _journal(state, rid, "swapped" if phase == "swap" else "restored", bad=sorted(bad))
    return {"ok": not bad, "swapped": len(done), "files": files, "error": ("after swap: %s" % sorted(bad)) if bad else None}


def op_journal(p):
    _journal(p["state_dir"], p["release_id"], p["step"], **(p.get("info") or {}))
    return {"ok": True}


def op_record(p):
    """Update release.json (and current.json); with `cleanup`, remove the release's temp files in the
    package; with `journal`, append that step last (a terminal step once everything above is done)."""
    path = os.path.join(p["state_dir"], "releases", p["release_id"], "release.json")
    if p.get("drop_uploads"):  # an aborted upload (a full disk): its files go first, to make room for the record
        shutil.rmtree(os.path.join(os.path.dirname(path), "files"), ignore_errors=True)
    rec = _read_json(path) or {"id": p["release_id"]}
    rec.update(p["updates"])
    _write_json(path, rec)
    if p.get("current") is not None:
        _write_json(os.path.join(p["state_dir"], "current.json"), p["current"])
    removed = []
    if p.get("cleanup"):
        c = p["cleanup"]
        removed = _remove_tmps(c["sglang_dir"], c["files"], c["tags"])
    if p.get("journal"):
        _journal(p["state_dir"], p["release_id"], p["journal"], **(p.get("info") or {}))
    return {"ok": True, "removed": removed}


def op_prune(p):
    """Keep the newest `keep` pushes that changed the host (outcome deployed) besides the protected
    ones, so that `rollback --to` finds them; everything else (failed attempts, rollbacks, restarts)
    takes no slot: the newest `keep` of those are kept apart for inspection. Unfinished transitions
    are never removed."""
    state = p["state_dir"]
    root = os.path.join(state, "releases")
    ids = sorted(os.listdir(root)) if os.path.isdir(root) else []
    protect = set(p.get("protect", [])) | {u["release"] for u in _unfinished(state)}
    good, failed, protected_good = [], [], 0
    for rid in ids:
        rec = _read_json(os.path.join(root, rid, "release.json")) or {}
        ok = rec.get("outcome") == "deployed"  # a push that changed the host; rollbacks and restarts take no slot
        if rid in protect:
            protected_good += ok
            continue
        (good if ok else failed).append(rid)
    keep_good = max(0, p["keep"] - protected_good)
    removed = good[: max(0, len(good) - keep_good)] + failed[: max(0, len(failed) - p["keep"])]
    for rid in removed:
        shutil.rmtree(os.path.join(root, rid))
    return {"removed": sorted(removed)}


def op_read(p):
    path = p["path"]
    if not os.path.isfile(path):
        return {"exists": False}
    with open(path, "rb") as f:
        return {"exists": True, "b64": base64.b64encode(f.read()).decode()}


def _shell(cmd, timeout):
    """(exit code, stdout + stderr) of a shell command of the restart strategy; 124 on a timeout."""
    try:
        r = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, ""
    return r.returncode, r.stdout + r.stderr


def op_http(p):
    """One HTTP request from the host. A health poll also passes the restart strategy's `alive` and
    `probe` commands: they run first, in this order and in the same call (one round trip per poll),
    and answer as `alive` (exit 0) and `probe` (the supervisor's words: main PID, restart count,
    state); a dead service gets no request."""
    out = {}
    if p.get("alive"):
        out["alive"] = _shell(p["alive"], 30)[0] == 0
    if p.get("probe"):  # after `alive`: a process that died between the two shows here as dead or replaced
        out["probe"] = _shell(p["probe"], 30)[1]
    if out.get("alive") is False:
        return dict(out, status=None, error="the service process is not running")
    return dict(out, **_request(p))


def _request(p):
    import urllib.error
    import urllib.request

    data = json.dumps(p["json"]).encode() if p.get("json") is not None else None
    req = urllib.request.Request(p["url"], data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=p.get("timeout", 10)) as r:
            return {"status": r.status, "body": r.read(1 << 20).decode("utf-8", "replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read(4096).decode("utf-8", "replace")}
    except Exception as exc:  # connection refused, timeout, ...: the service is not answering
        return {"status": None, "error": "%s: %s" % (type(exc).__name__, exc)}


# The protocol: op name -> (handler, payload keys it requires, payload keys it also accepts).
# deploy.remote.agent_client checks every call against this table before sending it.
OPS = {
    "facts": (op_facts, ("state_dir",), ("sglang_dir", "files", "files_by_version", "read", "current_files")),
    "hashes": (op_hashes, ("files",), ("sglang_dir", "root", "state_dir")),
    "lock": (op_lock, ("state_dir", "owner"), ("take_over",)),
    "unlock": (op_unlock, ("state_dir",), ("token", "force")),
    "stage": (op_stage, ("state_dir", "release_id", "sglang_dir", "files", "pristine", "record"), ()),
    "verify": (op_verify, ("state_dir", "release_id", "sglang_dir", "files"), ("import_check", "timeout")),
    "apply": (op_apply, ("state_dir", "release_id", "sglang_dir", "targets", "tag"), ("phase", "forward_tag")),
    "journal": (op_journal, ("state_dir", "release_id", "step"), ("info",)),
    "record": (op_record, ("state_dir", "release_id", "updates"), ("current", "cleanup", "journal", "info", "drop_uploads")),
    "prune": (op_prune, ("state_dir", "keep"), ("protect",)),
    "read": (op_read, ("path",), ("state_dir",)),
    "http": (op_http, ("url",), ("json", "timeout", "state_dir", "alive", "probe")),
}


def check_call(op, payload):
    """Why `op(payload)` does not fit OPS, or None (the client runs the same check before sending)."""
    if op not in OPS:
        return "unknown operation %r (known: %s)" % (op, ", ".join(sorted(OPS)))
    _, required, optional = OPS[op]
    missing = [k for k in required if k not in payload]
    unknown = sorted(set(payload) - set(required) - set(optional))
    if missing or unknown:
        return "%s: missing %s, unknown %s" % (op, missing or "nothing", unknown or "nothing")
    return None


def _own_source():
    """This file's text when run as `python -c <source>` (to store it on the host), else None."""
    argv = getattr(sys, "orig_argv", None)
    if not argv:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "surrogateescape") for a in f.read().split(b"\0")[:-1]]
        except OSError:
            return None
    return argv[argv.index("-c") + 1] if "-c" in argv[:-1] else None


def _save(path):
    """Store this source at `path` (content-addressed name, temp file + rename); True when it is there."""
    src = _own_source()
    if src is None or hashlib.sha256(src.encode()).hexdigest()[:16] not in os.path.basename(path):
        return False
    if os.path.isfile(path) and _sha(path) == hashlib.sha256(src.encode()).hexdigest():
        return True
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            f.write(src)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError:  # a full state disk: the client keeps sending the source with every call
        if os.path.lexists(tmp):
            os.unlink(tmp)
        return False


def main():
    op, payload = sys.argv[1], json.loads(sys.argv[2])
    save = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--save" else None
    why = check_call(op, payload)
    try:
        if why is not None:
            raise TypeError(why)
        out = OPS[op][0](payload)
        code = 0
    except HostConfigError as exc:
        out, code = {"agent_error": str(exc), "config_error": True}, 3
    except Exception as exc:
        out, code = {"agent_error": "%s: %s" % (type(exc).__name__, exc)}, 3
    if save is not None:
        out["_saved"] = _save(save)
    sys.stdout.write("\n" + MARK + " " + json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
