"""A small HTTP server that speaks the part of SGLang's API that `ddtree-deploy bench` uses.

TEST DOUBLE: a real SGLang server needs a GPU, which CI does not have. This one answers
``GET /health``, ``GET /get_server_info`` and ``POST /generate`` with the JSON shapes of
sglang 0.5.13.post1 (``meta_info.completion_tokens``, ``spec_verify_ct``, ``spec_accept_length``;
``internal_states[].avg_spec_accept_length``), and models a speculative server that commits
``accept`` tokens per verify round, one round taking ``round_ms`` milliseconds (a plain server:
``accept = 0``, one token per round). Everything is deterministic so tests can derive the
expected numbers from the same parameters.

    python tests/bench_fake_sglang.py --port 31000 [--algo DFLASH --accept 3 --round-ms 2]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeSGLang:
    def __init__(self, algo: str | None = None, accept: int = 0, round_ms: float = 1.0, draft_tokens: int = 16,
                 budget: int | None = None, fail_every: int = 0):
        self.algo, self.accept, self.round_ms = algo, accept, round_ms
        self.draft_tokens, self.budget, self.fail_every = draft_tokens, budget, fail_every
        self.lock = threading.Lock()
        self.total_tokens = 0
        self.total_rounds = 0
        self.count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.server: ThreadingHTTPServer | None = None
        self.profile: dict | None = None  # /start_profile's body while "profiling"
        self.profile_steps = 0
        self.profiles_written = 0

    def rounds_for(self, completion: int) -> int:
        """Verify rounds for a request: the prefill gives 1 token, each round commits `accept`."""
        if not self.algo:
            return completion
        return max(1, math.ceil((completion - 1) / self.accept))

    def info(self) -> dict:
        d: dict = {"version": "0.5.13.post1", "model_path": "/models/fake", "attention_backend": "triton",
                   "speculative_algorithm": self.algo, "speculative_num_draft_tokens": self.draft_tokens if self.algo else None,
                   "internal_states": [{}]}
        if self.budget is not None:
            d["speculative_ddtree_budget"] = self.budget
        with self.lock:
            if self.algo and self.total_rounds:
                d["internal_states"][0]["avg_spec_accept_length"] = self.total_tokens / self.total_rounds
        return d

    def generate(self, body: dict) -> tuple[int, object]:
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_new_tokens", 16))
        ids = body.get("input_ids")
        text = body.get("text")
        batch = isinstance(ids, list) and ids and isinstance(ids[0], list)
        prompts = ids if batch else [ids if ids is not None else text]
        if any(p is None for p in prompts):
            return 400, {"error": {"message": "either text or input_ids should be provided"}}
        with self.lock:
            self.count += 1
            k = self.count
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_every and k % self.fail_every == 0:
                return 500, {"error": {"message": "injected failure"}}
            rounds = self.rounds_for(n)
            time.sleep(rounds * self.round_ms / 1000.0)
            outs = []
            for p in prompts:
                seed = sum(p) if isinstance(p, list) else len(p)
                meta = {"id": f"req-{k}", "prompt_tokens": len(p), "completion_tokens": n,
                        "finish_reason": {"type": "length", "length": n}}
                if self.algo:
                    meta.update({"spec_verify_ct": rounds, "spec_accept_length": n / rounds})
                outs.append({"output_ids": [(seed + i) % 97 for i in range(n)], "meta_info": meta})
            with self.lock:
                self.total_tokens += n * len(prompts)
                self.total_rounds += rounds * len(prompts)
                if self.profile is not None:
                    self.profile_steps += rounds + 1
                    if self.profile_steps >= int(self.profile.get("num_steps") or 1):
                        self._write_trace(self.profile)
                        self.profile = None
            return 200, outs if batch else outs[0]
        finally:
            with self.lock:
                self.in_flight -= 1

    # The trace a profiled step leaves (a stand-in for SGLang's Kineto trace, no GPU here): per
    # step a TRACE_BUSY_US kernel, the host in an "accept" frame for TRACE_ACCEPT_US while the GPU
    # waits, then a TRACE_SHORT_US kernel it launches 10 us later, and a TRACE_TAIL_US wait for the
    # next step's launch (the four add up to TRACE_STEP_US).
    TRACE_STEP_US, TRACE_BUSY_US, TRACE_ACCEPT_US, TRACE_SHORT_US, TRACE_TAIL_US = 1000.0, 700.0, 250.0, 30.0, 10.0

    def start_profile(self, body: dict) -> str:
        with self.lock:
            self.profile, self.profile_steps = dict(body), 0
        return "Start profiling.\n"

    def _write_trace(self, body: dict) -> None:
        steps = int(body.get("num_steps") or 1)
        step, busy, accept, short = self.TRACE_STEP_US, self.TRACE_BUSY_US, self.TRACE_ACCEPT_US, self.TRACE_SHORT_US
        assert busy + accept + 10.0 + short + self.TRACE_TAIL_US == step
        host = {"pid": 100, "tid": 101}
        ev = [{"ph": "X", "cat": "python_function", "name": "scheduler.py(10): event_loop", "ts": -50.0,
               "dur": steps * step + 100.0, **host}]
        for i in range(steps):
            t = i * step
            launch2 = t + busy + accept + 5.0
            ev += [
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t - 5.0, "dur": 2.0, **host,
                 "args": {"correlation": 2 * i + 1}},
                {"ph": "X", "cat": "kernel", "name": "verify", "pid": 0, "tid": 7, "ts": t, "dur": busy,
                 "args": {"correlation": 2 * i + 1}},
                {"ph": "X", "cat": "python_function", "name": "worker.py(20): accept", "ts": t + busy, "dur": accept, **host},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch2, "dur": 2.0, **host,
                 "args": {"correlation": 2 * i + 2}},
                {"ph": "X", "cat": "kernel", "name": "commit", "pid": 0, "tid": 7, "ts": launch2 + 5.0,
                 "dur": short, "args": {"correlation": 2 * i + 2}},
            ]
        folder = Path(body["output_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        self.profiles_written += 1
        with gzip.open(folder / f"fake-{self.profiles_written}-TP-0.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": ev}, f)

    def serve(self, port: int = 0) -> int:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {})
                elif self.path in ("/get_server_info", "/server_info"):
                    self._send(200, fake.info())
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                if self.path == "/start_profile":  # SGLang answers in plain text
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    data = fake.start_profile(body).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if self.path != "/generate":
                    self._send(404, {"detail": "Not Found"})
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                self._send(*fake.generate(body))

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # as a real server's backlog: many clients connect at once

        self.server = Server(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.server.server_address[1]

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


def serve_in_a_row(fakes: list[FakeSGLang], first: int = 34100, step: int = 7) -> int:
    """Serve ``fakes`` at consecutive ports (a driver's ``--port-base + i``) and return the base;
    a base where any port is taken is given up (the servers started there stopped) for the next."""
    for base in range(first, 60000, step):
        started = []
        try:
            for i, f in enumerate(fakes):
                f.serve(base + i)
                started.append(f)
            return base
        except OSError:
            for f in started:
                f.stop()
    raise RuntimeError(f"no {len(fakes)} free ports in a row from {first}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--algo", default=None)
    ap.add_argument("--accept", type=int, default=3)
    ap.add_argument("--round-ms", type=float, default=1.0)
    ap.add_argument("--budget", type=int, default=None)
    a, _ = ap.parse_known_args()
    FakeSGLang(a.algo, a.accept, a.round_ms, budget=a.budget).serve(a.port)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
