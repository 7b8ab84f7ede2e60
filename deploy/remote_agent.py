"""Host-side helper, stdlib only. Sent as `python -c <this source> <op> <json>` with the service's
own python (nothing is installed on the host); prints one result line `@@ddtree-agent@@ <json>`.

Ops: facts, hashes, lock, unlock, stage, verify, apply, record, prune, read, http. Each is small and
all-or-nothing where it changes files: `apply` checks every source before touching anything, then
swaps file by file with a temp file in the same directory + os.replace (atomic per file).
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
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sglang_dir(given):
    if given:
        return given
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not importable with %s" % sys.executable)
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


def _free_mb(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or "/").free // (1 << 20)


def _releases(state_dir):
    root = os.path.join(state_dir, "releases")
    out = []
    if os.path.isdir(root):
        for rid in sorted(os.listdir(root)):
            rec = _read_json(os.path.join(root, rid, "release.json"))
            if rec is not None:
                out.append(rec)
    return out


def op_facts(p):
    sd = _sglang_dir(p.get("sglang_dir"))
    state = p["state_dir"]
    files = {}
    for rel in p["files"]:
        path = os.path.join(sd, rel)
        files[rel] = {"sha256": _sha(path), "size": os.path.getsize(path)} if os.path.isfile(path) else None
    pristine_root = os.path.join(state, "pristine")
    pristine = {rel: _sha_or_none(os.path.join(pristine_root, rel)) for rel in p["files"]}
    return {
        "python": sys.executable,
        "sglang_dir": sd,
        "version": _version(sd),
        "files": files,
        "free_mb": {"sglang": _free_mb(sd), "state": _free_mb(state)},
        "current": _read_json(os.path.join(state, "current.json")),
        "lock": _read_json(os.path.join(state, "lock", "owner.json")) or ({"owner": "?"} if os.path.isdir(os.path.join(state, "lock")) else None),
        "releases": _releases(state),
        "pristine_store": pristine,
    }


def op_hashes(p):
    return {"files": {rel: _sha_or_none(os.path.join(p["root"], rel)) for rel in p["files"]}}


def op_lock(p):
    state = p["state_dir"]
    os.makedirs(state, exist_ok=True)
    lock = os.path.join(state, "lock")
    try:
        os.mkdir(lock)  # atomic: exactly one deploy wins
    except FileExistsError:
        return {"acquired": False, "holder": _read_json(os.path.join(lock, "owner.json")) or {"owner": "?"}}
    _write_json(os.path.join(lock, "owner.json"), dict(p["owner"], remote_time=time.time()))
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
    """Create releases/<id>/{files,backup}; back up what is on the host now; keep pristine copies."""
    sd, state, rid = p["sglang_dir"], p["state_dir"], p["release_id"]
    rdir = os.path.join(state, "releases", rid)
    os.makedirs(os.path.join(rdir, "files"))
    backup = {}
    for rel in p["files"]:
        src = os.path.join(sd, rel)
        if os.path.isfile(src):
            dst = os.path.join(rdir, "backup", rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(src, dst)
            backup[rel] = _sha(dst)
            if backup[rel] == p["pristine"].get(rel):
                keep = os.path.join(state, "pristine", rel)
                if not os.path.isfile(keep):
                    os.makedirs(os.path.dirname(keep), exist_ok=True)
                    shutil.copyfile(dst, keep)
        else:
            backup[rel] = None
        os.makedirs(os.path.dirname(os.path.join(rdir, "files", rel)), exist_ok=True)
    rec = dict(p["record"], backup=backup, outcome="staging")
    _write_json(os.path.join(rdir, "release.json"), rec)
    return {"backup": backup, "release_dir": rdir}


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
        path = os.path.join(rdir, rel)
        got = _sha_or_none(path)
        if got != sha:
            return {"ok": False, "stage": "upload", "error": "%s: uploaded file hash %s != build %s" % (rel, got, sha)}
        if rel.endswith(".py"):
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
    """Make each target file what `targets` says: {rel: {"src": path | null, "sha256": hex | null}}."""
    sd, tag = p["sglang_dir"], p["tag"]
    targets = p["targets"]
    for rel, t in targets.items():  # check everything first: all or nothing
        if t["src"] is not None and _sha_or_none(t["src"]) != t["sha256"]:
            return {"ok": False, "error": "%s: source %s is missing or does not match %s" % (rel, t["src"], t["sha256"])}
    done = {}
    for rel in sorted(targets):
        t = targets[rel]
        dest = os.path.join(sd, rel)
        if t["src"] is None:
            if os.path.lexists(dest):
                os.unlink(dest)
        else:
            d = os.path.dirname(dest)
            os.makedirs(d, exist_ok=True)
            tmp = os.path.join(d, ".%s.ddtree-%s.tmp" % (os.path.basename(dest), tag))
            shutil.copyfile(t["src"], tmp)
            if os.path.exists(dest):
                shutil.copymode(dest, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)  # atomic on one filesystem
        done[rel] = _sha_or_none(dest)
    bad = {rel: sha for rel, sha in done.items() if sha != targets[rel]["sha256"]}
    return {"ok": not bad, "files": done, "error": ("after swap: %s" % sorted(bad)) if bad else None}


def op_record(p):
    path = os.path.join(p["state_dir"], "releases", p["release_id"], "release.json")
    rec = _read_json(path) or {}
    rec.update(p["updates"])
    _write_json(path, rec)
    if p.get("current") is not None:
        _write_json(os.path.join(p["state_dir"], "current.json"), p["current"])
    return {"ok": True}


def op_prune(p):
    root = os.path.join(p["state_dir"], "releases")
    ids = sorted(os.listdir(root)) if os.path.isdir(root) else []
    protect = set(p.get("protect", []))
    removed = []
    for rid in ids[: max(0, len(ids) - p["keep"])]:
        if rid not in protect:
            shutil.rmtree(os.path.join(root, rid))
            removed.append(rid)
    return {"removed": removed}


def op_discard(p):
    rdir = os.path.join(p["state_dir"], "releases", p["release_id"])
    if os.path.isdir(rdir):
        shutil.rmtree(rdir)
    return {"ok": True}


def op_read(p):
    path = p["path"]
    if not os.path.isfile(path):
        return {"exists": False}
    with open(path, "rb") as f:
        return {"exists": True, "b64": base64.b64encode(f.read()).decode()}


def op_http(p):
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


def main():
    op, payload = sys.argv[1], json.loads(sys.argv[2])
    try:
        out = globals()["op_" + op](payload)
        code = 0
    except Exception as exc:
        out, code = {"agent_error": "%s: %s" % (type(exc).__name__, exc)}, 3
    sys.stdout.write("\n" + MARK + " " + json.dumps(out) + "\n")
    sys.stdout.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
