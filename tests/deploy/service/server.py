"""The "remote SGLang" service of the deploy test hosts (not a mock of the deploy path).

At start it imports the SGLang modules the DDTree build changes, from whatever SGLang the python
resolves (the host's own copy), so a broken deployed build really fails here; it validates its
`--speculative-algorithm` with SGLang's own `SpeculativeAlgorithm.from_string` (DDTREE only exists
once the patch series is deployed: pristine SGLang refuses it at start, as the real server does) and
refuses any other flag that is not a field of the installed `ServerArgs` (`--speculative-ddtree-*`
only exist once deployed), like `launch_server`'s argument parser. Without `--speculative-algorithm`
it runs no speculative decoding (`speculative_algorithm` null). Then it answers /health,
/get_server_info (with the extra flags as server args) and /generate.
No GPU and no model: /generate returns a deterministic continuation computed from the prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODULES = ["sglang.srt.server_args", "sglang.srt.speculative.spec_info",
           "sglang.srt.speculative.dflash_info"]
# The DFlash worker of the installed release: v1 (0.5.13.post1) or v2 (0.5.16); one must import.
WORKERS = ["sglang.srt.speculative.dflash_worker", "sglang.srt.speculative.dflash_worker_v2"]
OPTIONAL = ["sglang.srt.speculative.ddtree_utils"]


def server_flags(extra: list[str]) -> dict:
    """The other `--flag [value]` arguments, each a field of this sglang's ServerArgs, else refused."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    out: dict = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        name, eq, value = tok.partition("=")
        key = name[2:].replace("-", "_")
        if not tok.startswith("--") or key not in fields:
            raise SystemExit(f"launch_server: error: unrecognized arguments: {tok}")
        if not eq and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value, i = extra[i + 1], i + 1
        out[key] = value if (eq or value) else True
        i += 1
    return out


def load(algorithm: str | None, extra: list[str]) -> dict:
    import sglang

    for m in MODULES:
        importlib.import_module(m)
    workers = [m for m in WORKERS if importlib.util.find_spec(m) is not None]
    if not workers:
        raise ImportError(f"no DFlash worker module in this sglang ({', '.join(WORKERS)})")
    for m in workers:
        importlib.import_module(m)
    present = []
    for m in OPTIONAL:
        if importlib.util.find_spec(m) is not None:
            importlib.import_module(m)
            present.append(m)
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(algorithm)  # raises for an unknown algorithm
    flags = server_flags(extra)
    return {"version": sglang.__version__, "sglang_dir": list(sglang.__path__)[0],
            "algorithm": algo.name if algorithm is not None else None, "optional_modules": present, "flags": flags}


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0
        self.tokens = 0
        self.steps = 0


def continuation(text: str, n: int) -> list[str]:
    words = []
    seed = text.encode()
    for i in range(n):
        seed = hashlib.sha256(seed + bytes([i % 256])).digest()
        words.append(f"w{seed[0] % 97}")
    return words


def make_handler(info: dict, stats: Stats):
    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict | str) -> None:
            data = (json.dumps(body) if isinstance(body, dict) else body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # keep the service log for real errors
            return

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, "ok")
            elif self.path == "/get_server_info":
                with stats.lock:
                    accept = stats.tokens / stats.steps if stats.steps else None
                    st = {"avg_spec_accept_length": accept, "spec_verify_steps": stats.steps,
                          "generated_tokens": stats.tokens}
                self._send(200, {**info["flags"], "version": info["version"], "speculative_algorithm": info["algorithm"],
                                 "sglang_dir": info["sglang_dir"], "optional_modules": info["optional_modules"],
                                 "internal_states": [st]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._send(404, {"error": "not found"})
                return
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                n = int(req.get("sampling_params", {}).get("max_new_tokens", 8))
                words = continuation(str(req["text"]), n)
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": f"bad request: {exc}"})
                return
            steps = (n + 2) // 3  # a verify step accepts up to 3 tokens here
            with stats.lock:
                stats.requests += 1
                stats.tokens += n
                stats.steps += steps
            self._send(200, {"text": " " + " ".join(words), "meta_info": {"completion_tokens": n, "spec_verify_ct": steps}})

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--speculative-algorithm", default=None)
    args, extra = ap.parse_known_args()
    info = load(args.speculative_algorithm, extra)
    srv = ThreadingHTTPServer((args.host, args.port), make_handler(info, Stats()))
    print(f"serving sglang {info['version']} from {info['sglang_dir']} ({info['algorithm']}) on {args.host}:{args.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
