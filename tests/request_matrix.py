"""One request matrix for both pins' DDTREE request validation, and the rule docs/DDTREE.md states.

Used by tests/sglang/test_ddtree_serving.py::test_both_pins_and_the_docs_agree_on_every_request_parameter:
that test validates the matrix with the 0.5.13.post1 pin in its own process and runs this file
as a script in a child Python with the 0.5.16 pin laid over the real 0.5.16 site (the two SGLang
versions cannot share a process); the script prints each case's message as JSON.

The expectation is read from the per-request parameter table of docs/DDTREE.md (`| parameter |
DDTREE | tested by |`): a parameter is refused iff its DDTREE column says "refused".
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "DDTREE.md"
VOCAB = 64

# (case, documented parameter, SamplingParams kwargs, Req kwargs): one non-default value per
# parameter the table names, on a sampled request (temperature 0.7) unless the case is greedy.
MATRIX = [
    ("temperature", "temperature", {"temperature": 0.7}, {}),
    ("greedy", "temperature", {"temperature": 0.0}, {}),
    ("top_k", "top_k", {"temperature": 0.7, "top_k": 20}, {}),
    ("top_p", "top_p", {"temperature": 0.7, "top_p": 0.9}, {}),
    ("min_p", "min_p", {"temperature": 0.7, "min_p": 0.1}, {}),
    ("logit_bias", "logit_bias", {"temperature": 0.7, "logit_bias": {"7": 2.5, "11": -100.0}}, {}),
    ("repetition_penalty", "repetition_penalty", {"temperature": 0.7, "repetition_penalty": 1.2}, {}),
    ("greedy repetition_penalty", "repetition_penalty", {"temperature": 0.0, "repetition_penalty": 1.05}, {}),
    ("frequency_penalty", "frequency_penalty", {"temperature": 0.7, "frequency_penalty": 0.5}, {}),
    ("presence_penalty", "presence_penalty", {"temperature": 0.7, "presence_penalty": 0.3}, {}),
    ("min_new_tokens", "min_new_tokens", {"temperature": 0.7, "min_new_tokens": 5}, {}),
    ("sampling_seed", "sampling_seed", {"temperature": 0.7, "sampling_seed": 1234}, {}),
    ("custom logit processor", "custom logit processor", {"temperature": 0.7},
     {"custom_logit_processor": '{"callable": "stub"}'}),
    ("logprobs", "logprobs", {"temperature": 0.7}, {"return_logprob": True}),
    ("grammar", "grammar", {"temperature": 0.7, "regex": "[ab]+"}, {}),
    ("neutral penalties", "repetition_penalty",
     {"temperature": 0.7, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
      "min_new_tokens": 0}, {}),
]  # fmt: skip
NEUTRAL = {"neutral penalties"}  # default values: served whatever the parameter's rule


def documented_rules(text: str | None = None) -> dict[str, bool]:
    """{parameter: refused} from the docs table: each backticked name (or the plain name, e.g.
    "custom logit processor", "logprobs, grammar") of a row's first column."""
    text = DOCS.read_text() if text is None else text
    head = text.index("| parameter | DDTREE | tested by |")
    rules: dict[str, bool] = {}
    for line in text[head:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, ddtree = (c.strip() for c in line.strip("|").split("|")[:2])
        refused = "refused" in ddtree.lower()
        names = re.findall(r"`([a-z_]+)", first) or [n.strip() for n in first.split(",")]
        for name in names:
            rules[name] = refused
    return rules


def expected(rules: dict[str, bool]) -> dict[str, bool]:
    """{case: refused} for MATRIX under ``rules``."""
    missing = {param for _, param, _, _ in MATRIX} - set(rules)
    if missing:
        raise KeyError(f"docs/DDTREE.md's request table names no rule for {sorted(missing)}")
    return {case: rules[param] and case not in NEUTRAL for case, param, _, _ in MATRIX}


# SamplingParams.normalize(tokenizer) encodes stop strings with the tokenizer (the matrix has
# none) and, on 0.5.16, refuses min_new_tokens without one (a server started with
# --skip-tokenizer-init); a server with a tokenizer is what the matrix models, so it gets this
# placeholder, which normalize never calls here.
_TOKENIZER_PRESENT = object()


def make_requests(req_cls, params_cls) -> dict[str, object]:
    """Real Req objects of the running SGLang, one per MATRIX case (normalised and checked by
    SGLang's own SamplingParams.verify, as the tokenizer manager does)."""
    out = {}
    for case, _, sampling, extra in MATRIX:
        sp = params_cls(max_new_tokens=16, **sampling)
        sp.normalize(_TOKENIZER_PRESENT)
        sp.verify(VOCAB)
        out[case] = req_cls(f"r-{case}", "", [3, 4, 5], sp, vocab_size=VOCAB, **extra)
    return out


def _pin_016_messages() -> dict[str, str | None]:
    """What the 0.5.16 scheduler's request check returns for each case (it runs DFLASH's
    validate_dflash_request, then, when that passes, validate_ddtree_request; patch 0006)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.ddtree_serving import validate_ddtree_request
    from sglang.srt.speculative.dflash_utils import validate_dflash_request

    out = {}
    for case, req in make_requests(Req, SamplingParams).items():
        msg = validate_dflash_request(req, True)
        out[case] = msg if msg is not None else validate_ddtree_request(req)
    return out


if __name__ == "__main__":
    json.dump(_pin_016_messages(), sys.stdout)
