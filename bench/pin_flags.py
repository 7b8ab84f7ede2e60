"""The SGLang server flags the project's GPU scripts start their servers with, per pin, in one place.

Every device script (bench/acceptance_run.py, bench/round_cost.py and the tools that import them,
tests/gpu/ddtree_e2e.py, and the shell scripts through bench/lifted_setup.sh) builds its flags
with :func:`common`; each script chooses only its own size caps. What differs between the pins is
the CUDA-graph flag names:

* 0.5.13.post1 (v1 worker): ``--cuda-graph-max-bs``; prefill runs eager
  (``--disable-piecewise-cuda-graph``; the piecewise graph is off on this pin in every run).
* 0.5.16 (v2 worker, overlap scheduler): ``--cuda-graph-max-bs-decode``; the prefill graph is
  off (``--cuda-graph-backend-prefill disabled``) unless ``prefill_graph_max`` > 0, which keeps
  the pin's own (breakable) prefill graph for 1, 2, 4, ... ``prefill_graph_max`` tokens. The
  smallest size is 1: a request whose prompt is already in the radix cache prefills one token,
  and a replay pads at most 2x, so with the pin's default sizes (from 4) that prefill ran eager.

Stdlib only (the GPU machine has SGLang's dependencies and nothing else). As a script it prints
shell assignments for bench/lifted_setup.sh::

    python3 bench/pin_flags.py --pin 0.5.16 --prefill-graph-max 512 --shell
    # pin=0.5.16; common='...'; graph_bs=--cuda-graph-max-bs-decode
"""

from __future__ import annotations

import argparse
import shlex
import sys

PINS = ("0.5.13.post1", "0.5.16")
# the pin's flag for the largest decode batch captured as a CUDA graph
DECODE_GRAPH_BS = {"0.5.13.post1": "--cuda-graph-max-bs", "0.5.16": "--cuda-graph-max-bs-decode"}
# the flag that turns the pin's prefill CUDA graph off
PREFILL_GRAPH_OFF = {"0.5.13.post1": "--disable-piecewise-cuda-graph", "0.5.16": "--cuda-graph-backend-prefill disabled"}
# flags every run has: the sampler DDTREE's exactness tests compare against, no grammar backend to
# load, and a fixed seed
BASE = "--sampling-backend pytorch --grammar-backend none"


def check_pin(pin: str) -> None:
    if pin not in PINS:
        raise ValueError(f"unknown SGLang pin {pin!r}: this project builds {', '.join(PINS)}")


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to ``max_tokens`` (the powers of two not above it)."""
    if max_tokens < 1:
        raise ValueError(f"prefill_graph_max must be >= 1 to capture prefill graphs, got {max_tokens}")
    sizes, t = [], 1
    while t <= max_tokens:
        sizes.append(t)
        t *= 2
    return sizes


def graph_flags(pin: str, prefill_graph_max: int = 0) -> str:
    """The prefill-graph part of a pin's flags (see the module docstring)."""
    check_pin(pin)
    if pin == "0.5.16" and prefill_graph_max > 0:
        sizes = " ".join(str(t) for t in prefill_graph_sizes(prefill_graph_max))
        return f"--cuda-graph-max-bs-prefill {prefill_graph_max} --cuda-graph-bs-prefill {sizes}"
    return PREFILL_GRAPH_OFF[pin]


def common(pin: str, *, mem_fraction: float | None = None, max_total_tokens: int | None = None,
           max_bs: int | None = None, max_running: int | None = None, skip_tokenizer_init: bool = False,
           prefill_graph_max: int = 0) -> str:
    """A pin's common server flags; the size caps each script sets are left out when None."""
    parts = ["--skip-tokenizer-init"] if skip_tokenizer_init else []
    parts += [BASE, graph_flags(pin, prefill_graph_max)]
    if mem_fraction is not None:
        parts.append(f"--mem-fraction-static {mem_fraction:g}")
    if max_total_tokens is not None:
        parts.append(f"--max-total-tokens {max_total_tokens}")
    if max_bs is not None:
        parts.append(f"{DECODE_GRAPH_BS[pin]} {max_bs}")
    if max_running is not None:
        parts.append(f"--max-running-requests {max_running}")
    parts.append("--random-seed 0")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin", default="0.5.16", choices=PINS)
    ap.add_argument("--prefill-graph-max", type=int, default=0,
                    help="0.5.16: capture prefill graphs of 1, 2, 4 ... N tokens (0: prefill eager)")
    ap.add_argument("--mem-fraction", type=float, default=0.9)
    ap.add_argument("--shell", action="store_true",
                    help="print pin=, common= and graph_bs= assignments for bash's eval")
    a = ap.parse_args(argv)
    if a.prefill_graph_max < 0:
        ap.error(f"--prefill-graph-max must be >= 0, got {a.prefill_graph_max}")
    flags = common(a.pin, mem_fraction=a.mem_fraction, skip_tokenizer_init=True, prefill_graph_max=a.prefill_graph_max)
    if a.shell:
        print(f"pin={shlex.quote(a.pin)}; common={shlex.quote(flags)}; graph_bs={DECODE_GRAPH_BS[a.pin]}")
    else:
        print(flags)
    return 0


if __name__ == "__main__":
    sys.exit(main())
