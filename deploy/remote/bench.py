"""Serving benchmark against live SGLang servers: measurement and report model (stdlib only).

Kept free of third-party imports so that the GPU driver (bench/acceptance_run.py) can use it on a
machine that has only SGLang's own dependencies; the command (`ddtree-deploy bench`) is in
deploy/cli_bench.py, the plot in :func:`plot` (matplotlib, imported when called).

What is measured, per server and concurrency level ``c`` (``n`` requests, at most ``c`` in flight,
each one ``POST /generate`` with ``input_ids`` or ``text``):

* ``output_tokens_per_s`` = the sum of ``meta_info.completion_tokens`` over the level / the level's
  wall time (first request sent to last answer received);
* ``accept_length`` = sum ``completion_tokens`` / sum ``spec_verify_ct`` over the level's requests,
  i.e. SGLang's own per-request ``meta_info.spec_accept_length`` (``completion_tokens /
  spec_verify_ct``, sglang 0.5.13.post1 and 0.5.16 ``managers/tokenizer_manager.py``) weighted by
  rounds. It counts the token the prefill produces, so it reads a little above the tokens per
  verify round; ``accept_per_round`` = (sum ``completion_tokens`` - requests) / sum
  ``spec_verify_ct`` is that per-round figure. Both are absent for a server without speculative
  decoding (no ``spec_verify_ct``);
* ``per_round_ms``: a request's latency divided by the target forwards it took part in (its prefill
  plus its ``spec_verify_ct`` verify rounds; one forward per output token without speculation),
  averaged over requests. At concurrency ``c`` this is about the wall time of one batched
  scheduler step with ``c`` requests in it (draft + verify for a speculative server);
* ``latency_p50_ms`` / ``latency_p99_ms``: request latency percentiles (linear interpolation
  between closest ranks, as numpy's default);
* ``fit_request_ms`` / ``fit_round_ms``: the least-squares line latency = fixed + round x
  verify rounds over a speculative level's requests (:func:`latency_fit`), which splits what a
  request pays once (its prefill, scheduling, HTTP) from what it pays a round; absent (None)
  when the requests' round counts do not vary (plain decode, or fewer than 4 requests).

The server-wide ``avg_spec_accept_length`` of ``/get_server_info`` (cumulative since the server
started, ``managers/scheduler.py`` ``get_internal_state``) is recorded per server next to the
speculative algorithm, the draft-token count and the DDTREE budget.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA_VERSION = 1


class BenchInputError(Exception):
    """Bad benchmark input (prompt file, option): exit code 2 in the CLI."""


class ServerUnreachable(Exception):
    """A server did not answer: exit code 5 in the CLI."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = True

    def params(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "ignore_eos": self.ignore_eos}


@dataclass
class RequestResult:
    latency_s: float
    completion_tokens: int
    verify_ct: int | None
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    ok_requests: int
    errors: list[str]
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float | None
    accept_length: float | None
    accept_per_round: float | None
    verify_rounds: int | None
    per_round_ms: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    latency_mean_ms: float | None
    fit_request_ms: float | None = None
    fit_round_ms: float | None = None


@dataclass
class ServerResult:
    target: str
    label: str
    url: str
    group: str = ""  # e.g. "T=0" when one report holds several sampling settings
    server: dict = field(default_factory=dict)
    levels: list[LevelResult] = field(default_factory=list)


# ---------------------------------------------------------------- prompts
def load_prompts(path: Path | str) -> list[dict]:
    """A jsonl file, one object a line with ``text`` (a string) or ``input_ids`` (non-negative
    ints). Blank lines are skipped. Raises :class:`BenchInputError` naming the file and line."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchInputError(f"prompt file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BenchInputError(f"prompt file {p} cannot be read: {exc}") from None
    out: list[dict] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BenchInputError(f"{p}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise BenchInputError(f"{p}:{n}: expected an object with 'text' or 'input_ids'")
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if (not isinstance(ids, list) or not ids
                    or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
                raise BenchInputError(f"{p}:{n}: 'input_ids' must be a non-empty list of non-negative integers")
            out.append({"input_ids": ids})
        elif "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise BenchInputError(f"{p}:{n}: 'text' must be a non-empty string")
            out.append({"text": obj["text"]})
        else:
            raise BenchInputError(f"{p}:{n}: expected 'text' or 'input_ids'")
    if not out:
        raise BenchInputError(f"prompt file {p} holds no prompts")
    return out


def parse_concurrency(spec: str) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise BenchInputError(f"--concurrency must be a comma-separated list of integers, got {spec!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise BenchInputError(f"--concurrency values must be >= 1, got {spec!r}")
    return vals


# ---------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy 'linear')."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``(intercept, slope)`` of ``y = intercept + slope * x`` over ``(x, y)``
    points; None for fewer than 4 points, when every ``x`` is the same, or when the intercept
    is negative: a request cannot pay less than nothing once, so the points (e.g. sampled
    requests whose round counts barely vary, or rounds of changing widths) do not split."""
    if len(points) < 4:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 1e-12 * max(1.0, mx * mx):
        return None
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    intercept = my - slope * mx
    return (intercept, slope) if intercept >= 0 else None


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> LevelResult:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.completion_tokens for r in ok)
    lat = [r.latency_s * 1000.0 for r in ok]
    spec = [r for r in ok if r.verify_ct]
    rounds = sum(r.verify_ct for r in spec) if spec else None
    accept = per_round = None
    if spec and len(spec) == len(ok):
        accept = sum(r.completion_tokens for r in spec) / rounds
        per_round = (sum(r.completion_tokens for r in spec) - len(spec)) / rounds
    forwards = [(r.latency_s * 1000.0) / ((1 + r.verify_ct) if r.verify_ct else max(1, r.completion_tokens)) for r in ok]
    fit = latency_fit([(float(r.verify_ct), r.latency_s * 1000.0) for r in spec]) if spec and len(spec) == len(ok) else None
    return LevelResult(
        concurrency=concurrency, requests=len(results), ok_requests=len(ok), errors=errors[:5],
        wall_s=round(wall_s, 6), output_tokens=tokens,
        output_tokens_per_s=round(tokens / wall_s, 2) if ok and wall_s > 0 else None,
        accept_length=round(accept, 4) if accept is not None else None,
        accept_per_round=round(per_round, 4) if per_round is not None else None,
        verify_rounds=rounds,
        per_round_ms=round(sum(forwards) / len(forwards), 4) if forwards else None,
        latency_p50_ms=round(percentile(lat, 50), 3) if lat else None,
        latency_p99_ms=round(percentile(lat, 99), 3) if lat else None,
        latency_mean_ms=round(sum(lat) / len(lat), 3) if lat else None,
        fit_request_ms=round(fit[0], 3) if fit else None,
        fit_round_ms=round(fit[1], 4) if fit else None,
    )


# ---------------------------------------------------------------- HTTP
def _request(url: str, path: str, body: dict | None, timeout: float) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def server_info(url: str, timeout: float = 10.0) -> dict:
    """Speculative settings and the cumulative acceptance from /get_server_info (or /server_info).

    Raises :class:`ServerUnreachable` if the server does not answer at all."""
    last: Exception | None = None
    for path in ("/get_server_info", "/server_info"):
        try:
            info = _request(url, path, None, timeout)
            break
        except urllib.error.HTTPError as exc:
            last = exc
            continue
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ServerUnreachable(f"{url}: {getattr(exc, 'reason', exc)}") from None
    else:
        raise ServerUnreachable(f"{url}: /get_server_info and /server_info failed ({last})")
    if not isinstance(info, dict):
        return {}
    states = info.get("internal_states") or []
    accept = [s.get("avg_spec_accept_length") for s in states if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    keys = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ddtree_budget",
            "speculative_draft_model_path", "model_path", "version", "attention_backend")
    out = {k: info.get(k) for k in keys if k in info}
    if accept:
        out["avg_spec_accept_length"] = round(sum(accept) / len(accept), 4)
    return out


def generate_one(url: str, prompt: dict, sampling: Sampling, timeout: float) -> RequestResult:
    body = dict(prompt)
    body["sampling_params"] = sampling.params()
    t0 = time.perf_counter()
    try:
        out = _request(url, "/generate", body, timeout)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")[:300]
        return RequestResult(time.perf_counter() - t0, 0, None, f"HTTP {exc.code}: {text}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return RequestResult(time.perf_counter() - t0, 0, None, f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")
    dt = time.perf_counter() - t0
    if isinstance(out, list):
        out = out[0] if out else {}
    meta = out.get("meta_info") if isinstance(out, dict) else None
    if not isinstance(meta, dict) or "completion_tokens" not in meta:
        return RequestResult(dt, 0, None, f"answer without meta_info.completion_tokens: {str(out)[:200]}")
    vct = meta.get("spec_verify_ct")
    return RequestResult(dt, int(meta["completion_tokens"]), int(vct) if vct else None)


def run_level(url: str, prompts: list[dict], concurrency: int, n_requests: int, sampling: Sampling,
              timeout: float = 600.0, on_done: Callable[[], None] | None = None) -> LevelResult:
    """Send ``n_requests`` (prompts cycled in order) with at most ``concurrency`` in flight."""
    lock = threading.Lock()
    results: list[RequestResult | None] = [None] * n_requests

    def one(i: int) -> None:
        results[i] = generate_one(url, prompts[i % len(prompts)], sampling, timeout)
        if on_done is not None:
            with lock:
                on_done()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(n_requests)))
    wall = time.perf_counter() - t0
    return summarize(concurrency, [r for r in results if r is not None], wall)


def check_reachable(url: str, timeout: float = 10.0) -> None:
    """GET /health (or fall back to server info); raises :class:`ServerUnreachable`."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout):
            return
    except urllib.error.HTTPError:
        server_info(url, timeout)  # it answers HTTP: let server_info decide
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServerUnreachable(f"{url}: {getattr(exc, 'reason', exc)}") from None


def bench_server(target: str, label: str, url: str, prompts: list[dict], levels: list[int], n_requests: int | None,
                 sampling: Sampling, timeout: float = 600.0, on_done: Callable[[], None] | None = None,
                 warmup: int = 1) -> ServerResult:
    """All levels against one server (after ``warmup`` untimed requests); server info read after."""
    check_reachable(url)
    for i in range(warmup):
        generate_one(url, prompts[i % len(prompts)], Sampling(max_new_tokens=min(8, sampling.max_new_tokens)), timeout)
    res = ServerResult(target=target, label=label, url=url)
    for c in levels:
        n = requests_for(c, n_requests)
        res.levels.append(run_level(url, prompts, c, n, sampling, timeout, on_done))
    res.server = server_info(url)
    return res


def requests_for(concurrency: int, n_requests: int | None, waves: int = 2) -> int:
    """Requests sent at a level: ``--requests`` if given, else ``waves`` x concurrency (at least
    8). Two waves leave a speculative level at c >= 16 a few seconds long, and two runs of it
    11 % apart (docs/TESTING.md, thirteenth session); more waves give more of each."""
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    return n_requests if n_requests else max(8, waves * concurrency)


# ---------------------------------------------------------------- report
def report(servers: list[ServerResult], sampling: Sampling, extra: dict | None = None) -> dict:
    doc = {"ok": all(lv.ok_requests == lv.requests for s in servers for lv in s.levels), "exit_code": 0,
           "schema": SCHEMA_VERSION, "sampling": asdict(sampling),
           "servers": [{"target": s.target, "label": s.label, "group": s.group, "url": s.url, "server": s.server,
                        "levels": [asdict(lv) for lv in s.levels]} for s in servers]}
    if not doc["ok"]:
        doc["exit_code"] = 1
    if extra:
        doc.update(extra)
    return doc


def validate_report(doc: object) -> dict:
    """A report read back (``--from-json``): the keys the table and the plot need, else BenchInputError."""
    if not isinstance(doc, dict) or not isinstance(doc.get("servers"), list):
        raise BenchInputError("not a bench report: no 'servers' list")
    for s in doc["servers"]:
        if not isinstance(s, dict) or "label" not in s or not isinstance(s.get("levels"), list):
            raise BenchInputError("not a bench report: a server without 'label' and 'levels'")
        for lv in s["levels"]:
            if not isinstance(lv, dict) or "concurrency" not in lv:
                raise BenchInputError("not a bench report: a level without 'concurrency'")
    return doc


def plot_series(doc: dict) -> tuple[list[dict], list[str]]:
    """What :func:`plot` draws: one series per server that measured at least one level (name,
    colour ``C<i>`` kept on both panels, concurrencies, tokens/s, acceptance or None without
    speculation), and the names of the servers none of whose levels measured anything (every
    level failed or was skipped: drawn as no line, named in the legend)."""
    series, unmeasured = [], []
    for i, s in enumerate(doc["servers"]):
        name = s["label"] + (f" ({s['group']})" if s.get("group") else "")
        lv = sorted(s["levels"], key=lambda x: x["concurrency"])
        if not any(x.get("output_tokens_per_s") for x in lv):
            unmeasured.append(name)
            continue
        acc = [x.get("accept_length") for x in lv]
        series.append({
            "name": name, "color": f"C{i % 10}", "x": [x["concurrency"] for x in lv],
            "tokens_per_s": [x.get("output_tokens_per_s") or float("nan") for x in lv],
            "accept": [a if a is not None else float("nan") for a in acc] if any(a is not None for a in acc) else None,
        })
    return series, unmeasured


def plot(doc: dict, path: Path | str, title: str | None = None) -> Path:
    """PNG: output tokens/s (left) and mean acceptance length (right) vs concurrency, one line
    per configuration (label; a ``group`` key, e.g. the temperature, is appended when present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series, unmeasured = plot_series(doc)
    for a in series:
        ax1.plot(a["x"], a["tokens_per_s"], marker="o", color=a["color"], label=a["name"])
        if a["accept"] is not None:
            ax2.plot(a["x"], a["accept"], marker="o", color=a["color"], label=a["name"])
        else:
            ax2.plot(a["x"], [1.0] * len(a["x"]), linestyle=":", color=a["color"], label=f"{a['name']} (no speculation)")
    concs = sorted({x["concurrency"] for s in doc["servers"] for x in s["levels"]})
    for ax, yl in ((ax1, "output tokens/s"), (ax2, "mean acceptance length (tokens/round)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
    ax2.legend(fontsize=7, loc="best", title=("not measured: " + ", ".join(unmeasured)) if unmeasured else None,
               title_fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=110)
    plt.close(fig)
    return out
