"""The per-round verify width of ``--speculative-ddtree-budget auto``: a controller that picks,
for each decode round, the tree width that maximises expected committed tokens per second.

Torch + standard library. Shipped next to ddtree_utils.py as
``sglang/srt/speculative/ddtree_budget.py`` when a pin's worker imports it. Pure pieces:

* :func:`expected_committed` (batched, capture-safe): the expected committed tokens of the
  best-first tree truncated to each width, from the tree's own node path probabilities. The
  first ``w - 1`` nodes of a best-first tree of budget ``B >= w - 1`` are exactly the best-first
  tree of budget ``w - 1`` (the nodes are listed in the tie order and every prefix of that order
  is prefix-closed), so one tree built at the largest width prices every width, and
  :func:`truncate_tree` cuts the compiled tree to the chosen width.
* :class:`AcceptCalibration`: an online ratio (realised / predicted accepted drafts) per option,
  exponentially forgotten, shrunk towards the ratio pooled over all options.
* :class:`CostTable`: round seconds per (batch bucket x option), interpolated for batch sizes
  between the measured buckets. Filled online from timed rounds, and optionally seeded at
  start-up with each cell's **verify** seconds (the worker replays its captured verify graphs):
  a round is its verify plus a width-independent rest (draft forward, tree build, host share),
  learnt online per bucket from the rounds of any width, so every width is priced from the
  first round on.
* :func:`best_option` and :class:`BudgetController`: the choice.

The flag's value and the widths ``auto`` may use (the memory rule) are server-argument rules,
in ddtree_serving (``parse_ddtree_budget``, ``auto_verify_widths``).

Options: an ``int`` is a tree of verify width ``w = budget + 1``; ``"chain"`` is DFLASH's round
shape (the drafter's top-1 token at every depth, width = block size); ``"off"`` is plain decode
(width 1, one committed token per request). Units: tokens per request unless a name says sum;
seconds for costs.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "CHAIN",
    "OFF",
    "OFF_WIDTH",
    "AcceptCalibration",
    "AutoRounds",
    "BudgetController",
    "CostTable",
    "Option",
    "best_option",
    "expected_committed",
    "expected_committed_chain",
    "monotone_in_width",
    "truncate_tree",
    "width_gather_index",
]

CHAIN = "chain"
OFF = "off"
OFF_WIDTH = 1  # the verify width of an OFF round: only the root (the previous bonus)
Option = int | str


def width_gather_index(widths: Sequence[int], budget: int, device=None) -> Tensor:
    """``[W]`` int64 column of each width's node count ``min(w - 1, budget)`` in the padded
    cumulative sum of :func:`expected_committed`. Build it before CUDA-graph capture."""
    return torch.tensor([min(max(int(w) - 1, 0), int(budget)) for w in widths], dtype=torch.int64, device=device)


def expected_committed(score: Tensor, index: Tensor) -> Tensor:
    """Expected committed tokens per request of the best-first tree truncated to each width.

    Args:
        score: ``[bs, B]`` float32 log q(prefix) of the nodes in best-first order
            (``ddtree_utils.DDTree.score``; -inf for missing nodes).
        index: ``[W]`` from :func:`width_gather_index` (``w - 1`` nodes, capped at B).

    Returns ``[bs, W]`` float32: ``1 + sum of q(prefix) over the first w - 1 nodes`` (the bonus
    token plus each node's chance of being accepted, its path probability when the target
    samples like the drafter; calibrated online by :class:`AcceptCalibration`). No host sync,
    fixed shapes.
    """
    bs = score.shape[0]
    p = torch.exp(score.float())  # [bs, B], 0 for -inf
    csum = torch.cat([p.new_zeros(bs, 1), torch.cumsum(p, dim=1)], dim=1)  # [bs, B + 1]
    return 1.0 + csum.index_select(1, index)


def expected_committed_chain(topk_logp: Tensor, length: int) -> Tensor:
    """Expected committed tokens per request of DFLASH's chain: the drafter's top-1 token at
    depths 1..length. ``topk_logp`` ``[bs, L, K]`` (rank 0 first) -> ``[bs]`` float32
    ``1 + sum_d prod_{i<=d} q_i(top-1)``."""
    lp = topk_logp[:, : int(length), 0].float()
    return 1.0 + torch.exp(torch.cumsum(lp, dim=1)).sum(dim=1)


def truncate_tree(
    tokens: Tensor,
    depth: Tensor,
    next_token: Tensor,
    next_sibling: Tensor,
    tree_mask: Tensor,
    width: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A compiled best-first tree (``ddtree_utils.compile_tree`` arrays, ``[bs, N]`` and
    ``[bs, N, N]``, root first) cut to its first ``width`` verify rows: equal to compiling the
    tree built with budget ``width - 1``. Children and siblings are listed in verify-index order,
    so a pointer at or past ``width`` ends its list. Views / elementwise ops only."""
    w = int(width)
    if not 1 <= w <= tokens.shape[1]:
        raise ValueError(f"width must be in 1..{tokens.shape[1]}, got {w}")
    cut = lambda x: torch.where(x[:, :w] >= w, torch.full_like(x[:, :w], -1), x[:, :w])
    return tokens[:, :w], depth[:, :w], cut(next_token), cut(next_sibling), tree_mask[:, :w, :w]


def monotone_in_width(expected: Mapping[Option, float]) -> dict:
    """``expected`` with the tree widths' values made non-decreasing in the width (a running
    maximum: a wider best-first tree contains the narrower one, so it cannot commit fewer).
    Other options are left as they are."""
    out = dict(expected)
    best = -math.inf
    for w in sorted(k for k in expected if isinstance(k, int)):
        best = max(best, float(expected[w]))
        out[w] = best
    return out


def best_option(bs: int, expected: Mapping[Option, float], cost: Mapping[Option, float]) -> Option:
    """The option maximising ``bs * expected[o] / cost[o]`` (committed tokens per second of the
    batch). Ties go to the cheaper option, then to the order of ``expected``."""
    best, best_key = None, None
    for i, (key, e) in enumerate(expected.items()):
        c = float(cost[key])
        if not c > 0:
            raise ValueError(f"cost of {key!r} must be > 0, got {c}")
        score = (int(bs) * float(e) / c, -c, -i)
        if best is None or score > best:
            best, best_key = score, key
    if best_key is None:
        raise ValueError("no option to choose from")
    return best_key


class AcceptCalibration:
    """Online ratio of realised to predicted **accepted draft tokens** (committed - 1), per
    option, with exponential forgetting.

    ``ratio(o) = (R_o + w0 * pooled) / (P_o + w0)`` with ``R_o, P_o`` the decayed sums of the
    realised and predicted accepted tokens of the rounds that ran ``o`` and ``pooled`` the same
    ratio over all options (seeded with ``prior_ratio`` at weight ``prior_weight``): an option
    never run borrows what the others show, one run often converges to its own ratio.
    """

    def __init__(
        self,
        keys: Iterable[Option],
        prior_ratio: float = 1.0,
        prior_weight: float = 8.0,
        decay: float = 0.99,
    ):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if prior_ratio < 0 or prior_weight <= 0:
            raise ValueError("prior_ratio must be >= 0 and prior_weight > 0")
        self.keys = list(keys)
        self.prior_ratio, self.prior_weight, self.decay = float(prior_ratio), float(prior_weight), float(decay)
        self.realised = {k: 0.0 for k in self.keys}
        self.predicted = {k: 0.0 for k in self.keys}
        self.rounds = {k: 0 for k in self.keys}

    def update(self, key: Option, predicted: float, realised: float) -> None:
        """One round that ran ``key``: the batch's predicted and realised accepted draft tokens
        (sums over its requests). Every option's sums decay by one step."""
        if key not in self.realised:
            raise KeyError(f"unknown option {key!r}")
        if predicted < 0 or realised < 0:
            raise ValueError(f"accepted tokens must be >= 0, got {predicted}, {realised}")
        for k in self.keys:
            self.realised[k] *= self.decay
            self.predicted[k] *= self.decay
        self.realised[key] += float(realised)
        self.predicted[key] += float(predicted)
        self.rounds[key] += 1

    def pooled(self) -> float:
        w0 = self.prior_weight
        return (sum(self.realised.values()) + w0 * self.prior_ratio) / (sum(self.predicted.values()) + w0)

    def ratio(self, key: Option) -> float:
        w0 = self.prior_weight
        return (self.realised[key] + w0 * self.pooled()) / (self.predicted[key] + w0)

    def calibrate(self, key: Option, predicted_committed: float) -> float:
        """Calibrated expected committed tokens per request: ``1 + ratio * (predicted - 1)``."""
        return 1.0 + self.ratio(key) * max(0.0, float(predicted_committed) - 1.0)

    def snapshot(self) -> dict:
        return {
            "pooled_ratio": round(self.pooled(), 4),
            "ratio": {str(k): round(self.ratio(k), 4) for k in self.keys},
            "rounds": {str(k): self.rounds[k] for k in self.keys},
        }


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys) (xs ascending). Below the first point: its value;
    past the last: the last segment extended (never below the last value); one point:
    proportional to ``x`` above it."""
    if len(xs) == 1:
        return ys[0] * max(1.0, x / xs[0]) if x > xs[0] else ys[0]
    if x <= xs[-1]:
        return _interp_flat(x, xs, ys)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return max(ys[-1] + slope * (x - xs[-1]), ys[-1])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 4)


def _interp_flat(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), constant beyond both ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


class CostTable:
    """Round seconds per (batch bucket x option).

    ``seconds[i][j]`` is the measured cost of a round of ``buckets[i]`` requests with
    ``options[j]``, or None while unmeasured: given, filled by :meth:`measure` (a timing function
    per cell) and/or online by :meth:`observe` (an exponential moving average of timed rounds).

    Start-up seeds (:meth:`seed`): ``verify[i][j]``, the seconds of the cell's **verify** alone
    (the worker replays its captured verify graphs). A round costs its verify plus a rest that
    does not depend on the width (the draft forward, the tree build, the host's share), learnt
    online per bucket from the timed rounds of any seeded width: ``offset[i]``, a moving average
    of ``max(0, observed - verify[i][j])``. A cell is then priced ``verify[i][j] + offset(i)``
    until its own rounds are timed, and by its own average after (``seconds[i][j]``, which also
    holds what the replay cannot see: the attention over the requests' real context). A bucket
    with no timed round yet borrows ``offset(i)`` from the buckets that have one (linear in the
    batch size between them, constant beyond), 0 while no bucket has one. So a seeded cell is
    never missing: the controller prices every seeded width from the first round.

    :data:`OFF` has a rest of its own (``off_offset``), learnt from off rounds only: an off
    round runs no draft forward and builds no tree, so the trees' rest would overprice it, and
    an option priced too high is never chosen, so its price would never be corrected (measured
    on the H100, lifted pair, T = 1: off priced 15.9 ms at batch 64 against 8.3 ms for a plain
    decode step, and never run). Until an off round is timed its rest is 0: the price is
    optimistic, so the controller tries off where its verify alone would pay, and the timed
    rounds then set its price.

    A timed round more than :attr:`OUTLIER` times away from its cell's price (a round that
    waited on something else: a prefill, a first use) counts as that bound, so one outlier
    cannot hold a cell far off its cost for the many rounds a moving average needs to forget it.

    A batch of ``bs`` requests costs what the smallest captured graph size ``>= bs`` costs (its
    graph replays with padding; ``graph_sizes`` default: the buckets), interpolated linearly in
    the batch size between the priced buckets of the option, and extrapolated linearly from
    the two largest above the last one (batches run eagerly there).
    """

    def __init__(
        self,
        buckets: Sequence[int],
        options: Sequence[Option],
        seconds: Sequence[Sequence[float | None]] | None = None,
        graph_sizes: Sequence[int] | None = None,
        decay: float = 0.9,
    ):
        self.buckets = [int(b) for b in buckets]
        self.options = list(options)
        if not self.buckets or self.buckets != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be ascending distinct sizes >= 1, got {list(buckets)}")
        if seconds is None:
            seconds = [[None] * len(self.options) for _ in self.buckets]
        if len(seconds) != len(self.buckets) or any(len(r) != len(self.options) for r in seconds):
            raise ValueError("seconds must be [len(buckets)][len(options)]")
        self.seconds = [[None if s is None else self._check(s) for s in row] for row in seconds]
        self.verify: list[list[float | None]] = [[None] * len(self.options) for _ in self.buckets]
        self.offset: list[float | None] = [None] * len(self.buckets)
        self.off_offset: list[float | None] = [None] * len(self.buckets)
        self.graph_sizes = sorted(int(g) for g in (graph_sizes or self.buckets))
        self.decay = float(decay)
        self._bucket_of = {b: i for i, b in enumerate(self.buckets)}  # the per-round fast path of cost()

    @staticmethod
    def _check(s) -> float:
        s = float(s)
        if not s > 0 or not math.isfinite(s):
            raise ValueError(f"every cost must be a finite number of seconds > 0, got {s}")
        return s

    @classmethod
    def measure(
        cls,
        buckets: Sequence[int],
        options: Sequence[Option],
        timing: Callable[[int, Option], float],
        graph_sizes: Sequence[int] | None = None,
    ) -> CostTable:
        """Fill the table with ``timing(bs, option)`` (seconds of one round) for every cell."""
        return cls(buckets, options, [[timing(int(b), o) for o in options] for b in buckets], graph_sizes)

    def padded(self, bs: int) -> int:
        for g in self.graph_sizes:
            if g >= bs:
                return g
        return int(bs)

    def bucket_index(self, bs: int) -> int:
        """The bucket a round of ``bs`` requests is recorded in: the first >= its padded size,
        else the last."""
        x = self.padded(int(bs))
        for i, b in enumerate(self.buckets):
            if b >= x:
                return i
        return len(self.buckets) - 1

    def seed(self, bs: int, option: Option, verify_seconds: float) -> bool:
        """A start-up verify time of ``option`` at batch size ``bs``. Kept only when ``bs`` is a
        bucket (a seed stands for its bucket's rounds); returns whether it was kept."""
        s = self._check(verify_seconds)
        j = self.options.index(option)
        if int(bs) not in self.buckets:
            return False
        self.verify[self.buckets.index(int(bs))][j] = s
        return True

    OUTLIER = 2.0  # a timed round counts as at most this many times its cell's price, at least 1 / it

    def observe(self, bs: int, option: Option, seconds: float) -> None:
        """One timed round: the cell's moving average (the first measurement as it is; later
        ones clamped to within :attr:`OUTLIER` times the cell's price) and, for a seeded cell,
        the bucket's rest: the trees' width-independent rest for a tree width, off's own rest
        for an off round (it has no draft forward, so its time says nothing about the trees')."""
        i, j = self.bucket_index(bs), self.options.index(option)
        s = self._check(seconds)
        old = self.seconds[i][j]  # the cell's price once it has timed rounds
        if old is not None:
            s = min(max(s, old / self.OUTLIER), old * self.OUTLIER)
        self.seconds[i][j] = s if old is None else self.decay * old + (1.0 - self.decay) * s
        v = self.verify[i][j]
        if v is not None:
            rests = self.off_offset if option == OFF else self.offset
            rest, old = max(0.0, s - v), rests[i]
            rests[i] = rest if old is None else self.decay * old + (1.0 - self.decay) * rest

    def rest(self, i: int, off: bool = False) -> float:
        """Seconds a round of bucket ``i`` spends outside its verify (``off``: an off round's):
        learnt in that bucket, else borrowed from the buckets that learnt it (the trees' rest
        interpolated between them; off's the smallest of them), else 0.

        Off borrows optimistically: the trees are explored in every bucket, so a borrowed price
        of theirs is soon replaced, but off runs only where it is priced best, so a borrowed
        price too high is never corrected. H100, lifted pair: one off round at batch 26 (rest
        3.4 ms; off rounds elsewhere learnt 1.1-1.5 ms) priced off at every batch up to 26 at
        10.4 ms against about 8 ms, and at T = 1, c = 16 the controller ran trees where off
        alone was 8 % faster."""
        rests = self.off_offset if off else self.offset
        if rests[i] is not None:
            return rests[i]
        pts = [(b, o) for b, o in zip(self.buckets, rests) if o is not None]
        if not pts:
            return 0.0
        if off:
            return min(o for _, o in pts)
        return _interp_flat(float(self.buckets[i]), [b for b, _ in pts], [o for _, o in pts])

    def cell(self, i: int, j: int) -> float | None:
        """The price of cell (bucket ``i``, option ``j``): its own timed rounds, else its seed
        plus the bucket's rest (off's own rest for off), else None."""
        if self.seconds[i][j] is not None:
            return self.seconds[i][j]
        if self.verify[i][j] is not None:
            return self.verify[i][j] + self.rest(i, off=self.options[j] == OFF)
        return None

    def missing(self, bs: int) -> list:
        """Options without a price in the bucket of ``bs`` (in option order)."""
        i = self.bucket_index(bs)
        return [o for j, o in enumerate(self.options) if self.cell(i, j) is None]

    def cost(self, bs: int, option: Option) -> float | None:
        """Seconds of a round of ``bs`` requests with ``option``; None if never priced."""
        j = self.options.index(option)
        x = self.padded(int(bs))
        i = self._bucket_of.get(x)
        if i is not None and (c := self.cell(i, j)) is not None:
            return c  # a priced bucket: what the interpolation below gives there, without it
        pts = [(b, c) for i, b in enumerate(self.buckets) if (c := self.cell(i, j)) is not None]
        if not pts:
            return None
        return _interp(float(x), [b for b, _ in pts], [s for _, s in pts])

    def costs(self, bs: int) -> dict:
        return {o: c for o in self.options if (c := self.cost(bs, o)) is not None}

    def as_dict(self) -> dict:
        """``ms``: the timed rounds' averages; ``verify_ms``: the start-up seeds;
        ``offset_ms``: the trees' learnt rest per bucket; ``off_offset_ms``: off's;
        ``cost_ms``: the prices the controller uses."""
        rows = range(len(self.buckets))
        return {
            "buckets": list(self.buckets),
            "options": [str(o) for o in self.options],
            "ms": [[_ms(s) for s in row] for row in self.seconds],
            "verify_ms": [[_ms(s) for s in row] for row in self.verify],
            "offset_ms": [_ms(o) for o in self.offset],
            "off_offset_ms": [_ms(o) for o in self.off_offset],
            "cost_ms": [[_ms(self.cell(i, j)) for j in range(len(self.options))] for i in rows],
        }

    def format_ms(self, which: str = "verify") -> str:
        """A text table of ``verify`` (the seeds) or ``cost`` (the prices) in ms: one row per
        bucket, one column per option ("-": none); for the log."""
        get = (lambda i, j: self.verify[i][j]) if which == "verify" else self.cell
        head = ["bs \\ width"] + [str(o) for o in self.options]
        rows = [
            [str(b)] + ["-" if (s := get(i, j)) is None else f"{1e3 * s:.3f}" for j in range(len(self.options))]
            for i, b in enumerate(self.buckets)
        ]
        widths = [max(len(r[k]) for r in [head, *rows]) for k in range(len(head))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows])


class BudgetController:
    """The round's option for ``--speculative-ddtree-budget auto``.

    Per round the worker calls :meth:`choose` with the batch size (host value) and, once the
    round's accept lengths are on the host (SGLang's ``on_verify_complete_cpu``, one round
    later), :meth:`observe` with the option that ran, the batch's predicted expected committed
    tokens of every option (sums over its requests, copied to the host with the round's results)
    and the realised committed tokens. The choice uses the predictions observed so far (pooled over
    about :attr:`SMOOTH_REQUESTS` requests, so a batch that large uses its latest), so it lags one
    round; nothing here waits on the device.

    Warm-up: while an option has no price in the batch's bucket (a table filled online only, or
    a bucket without start-up seeds), the choice is that option, so every cell the batch sizes
    reach gets measured. A table seeded at start-up (:meth:`CostTable.seed`) prices every seeded
    cell from the first round, so there the choice is made without warm-up.

    Exploration: every ``explore_every``-th choice takes the neighbour of the best width (the
    next wider, then the next narrower, alternating; below the narrowest width that is off,
    when offered; the narrowest width when chain or off is best, so that speculation resumes
    when drafts start landing again) so that options near the best keep their calibration and
    prices current; deterministic, so every TP rank makes the same choice. While off is best
    the narrowest width runs :attr:`OFF_PROBE` times as often (every ``explore_every /
    OFF_PROBE``-th choice): off rounds draft nothing, so only these rounds update the trees'
    estimate.

    ``limits`` (``{option: largest batch}``, ``ddtree_serving.auto_width_limits``; an option
    not in it, or mapped to None, serves every batch): a width is offered, explored and warmed
    up only for batches within its range (its verify graphs are captured only there).

    Greedy and sampled batches (``sampled=`` of :meth:`choose` / :meth:`observe`: any request of
    the batch samples) keep separate calibrations (``calibration``, ``sampled_calibration``): the
    tree's node probabilities predict a sampled verify's acceptance differently from a greedy
    one's (H100, lift-c pair: realised / predicted about 1.1 at T = 0 and 0.9 at T = 1), and one
    shared ratio moved between them over about a hundred rounds after each change of traffic.
    """

    OFF_PROBE = 4  # while off is best, the narrowest tree runs 4x as often as exploration's
    # The per-request estimate is smoothed over about this many requests' rounds. At batch 1 the
    # latest round's estimate is one tree's, and its lag-one value is noise: on the H100 lifted
    # pair at T = 1, c = 1 it sent 203 of 697 rounds to off (1 token) and cost 15 % of tokens/s,
    # while on average width 16 commits 1.7 tokens a round for 15 % more time than off.
    SMOOTH_REQUESTS = 8

    def __init__(
        self,
        options: Sequence[Option],
        table: CostTable,
        calibration: AcceptCalibration | None = None,
        explore_every: int = 64,
        initial: Mapping[Option, float] | None = None,
        limits: Mapping[Option, int | None] | None = None,
    ):
        self.options = list(options)
        self.limits = {o: (None if v is None else int(v)) for o, v in (limits or {}).items()}
        if set(self.options) - set(table.options):
            raise ValueError(f"no cost for {sorted(map(str, set(self.options) - set(table.options)))}")
        self.table = table
        self.calibration = calibration or AcceptCalibration(self.options)
        self.sampled_calibration = AcceptCalibration(
            self.options, self.calibration.prior_ratio, self.calibration.prior_weight, self.calibration.decay
        )
        self.explore_every = int(explore_every)
        self.widths = sorted(o for o in self.options if isinstance(o, int))
        # Per-request predicted committed tokens (smoothed, see observe); before the first
        # round: a chain-like guess (1 + half the nodes, capped at 4) that makes no width free.
        self.predicted = {
            o: (1.0 if o == OFF else min(4.0, 1.0 + 0.5 * (o - 1)) if isinstance(o, int) else 2.0)
            for o in self.options
        }
        if initial:
            self.predicted.update({k: float(v) for k, v in initial.items() if k in self.predicted})
        self.seen_requests = 0
        self.choices = 0
        self.history = {o: 0 for o in self.options}
        self.last = None

    def calibration_of(self, sampled: bool) -> AcceptCalibration:
        """The calibration of greedy (``sampled=False``) or sampled batches."""
        return self.sampled_calibration if sampled else self.calibration

    def expected(self, sampled: bool = False) -> dict:
        """Calibrated expected committed tokens per request of every option, for a greedy or a
        sampled batch."""
        cal = self.calibration_of(sampled)
        out = {}
        for o in self.options:
            out[o] = 1.0 if o == OFF else cal.calibrate(o, self.predicted[o])
        return monotone_in_width(out)

    def offers(self, option: Option, bs: int) -> bool:
        """Whether a batch of ``bs`` requests may run ``option`` (its range, ``limits``)."""
        limit = self.limits.get(option)
        return limit is None or int(bs) <= limit

    def choose(self, bs: int, sampled: bool = False) -> Option:
        self.choices += 1
        missing = [o for o in self.table.missing(bs) if o in self.history and self.offers(o, bs)]
        if missing:  # warm-up: run every option once in this batch bucket to measure it
            best = missing[0]
            self.history[best] += 1
            self.last = best
            return best
        costs = {o: c for o, c in self.table.costs(bs).items() if self.offers(o, bs)}
        best = best_option(bs, {o: e for o, e in self.expected(sampled).items() if o in costs}, costs)
        widths = [w for w in self.widths if self.offers(w, bs)]
        # While off is best, a tree round comes every OFF_PROBE-th of the interval: an off round
        # drafts nothing, so the trees' estimate is frozen at the round that sent the choice to
        # off, and one low estimate (a batch of fresh requests) would otherwise hold off for a
        # whole interval (H100, lifted pair, T = 0, c = 32: 44 off rounds in 105, -10 % tokens/s)
        every = self.explore_every
        if best == OFF:  # not below every 4th choice, unless the interval itself is shorter
            every = min(every, max(4, every // self.OFF_PROBE))
        if self.explore_every > 0 and self.choices % every == 0 and widths:
            if not isinstance(best, int):  # chain / off: keep the narrowest tree's data current
                best = widths[0]
            else:
                i = widths.index(best)
                up = (self.choices // self.explore_every) % 2 == 1
                if i == 0 and not up and OFF in self.options:  # off is the narrowest's neighbour below
                    best = OFF
                else:
                    j = i + 1 if (up and i + 1 < len(widths)) or i == 0 else i - 1
                    if 0 <= j < len(widths):
                        best = widths[j]
        self.history[best] += 1
        self.last = best
        return best

    def observe(
        self,
        option: Option,
        predicted_sums: Mapping[Option, float],
        realised_sum: float,
        requests: int,
        sampled: bool = False,
    ) -> None:
        """One finished round: ``predicted_sums`` per option (sums over the batch's requests of
        the expected committed tokens), ``realised_sum`` committed tokens of the batch, and
        whether the batch sampled (the calibration it updates)."""
        n = int(requests)
        if n <= 0:
            return
        # The estimate pools the last ~SMOOTH_REQUESTS requests' rounds: the mean of the first
        # ones (the first replaces the start-up guess), then a moving average in which a batch
        # of SMOOTH_REQUESTS or more replaces it and one request moves it 1/SMOOTH_REQUESTS.
        self.seen_requests = min(self.SMOOTH_REQUESTS, self.seen_requests + n)
        w = min(1.0, n / self.seen_requests)
        for o, s in predicted_sums.items():
            if o in self.predicted and o != OFF:
                self.predicted[o] += w * (float(s) / n - self.predicted[o])
        if option != OFF:
            pred = float(predicted_sums.get(option, self.predicted[option] * n))
            self.calibration_of(sampled).update(option, max(0.0, pred - n), max(0.0, float(realised_sum) - n))

    def snapshot(self) -> dict:
        """What ``/get_server_info`` and the log show: the cost table, the calibration, the
        current expected tokens and how often each option ran."""
        return {
            "options": [str(o) for o in self.options],
            "cost_table": self.table.as_dict(),
            "calibration": self.calibration.snapshot(),
            "calibration_sampled": self.sampled_calibration.snapshot(),
            "expected_committed": {str(k): round(v, 4) for k, v in self.expected().items()},
            "expected_committed_sampled": {str(k): round(v, 4) for k, v in self.expected(True).items()},
            "chosen": {str(k): v for k, v in self.history.items()},
            "last": None if self.last is None else str(self.last),
            "max_batch": {str(k): v for k, v in self.limits.items()},
        }


class AutoRounds:
    """The worker's side of ``auto``: each decode round's width, and the round's results fed
    back to the :class:`BudgetController` once they reach the host. No host sync.

    Per round the worker calls :meth:`choose` (host batch size -> width), runs the round at that
    width and calls :meth:`record` with the tree's ``[bs, W]`` expected committed tokens of every
    width (:func:`expected_committed`, a device tensor) and the round's start / end marks (CUDA
    events, or host seconds). :meth:`record` sums the rows on the device and copies the ``[W]``
    sums into a slot of a pinned host ring with ``non_blocking``: issued on the forward stream
    before the scheduler records its result copy's ``copy_done``, so the copy is complete by the
    time the scheduler, which waits on ``copy_done``, calls the worker's
    ``on_verify_complete_cpu`` with the round's accept lengths. That call is
    :meth:`on_verify_complete_cpu` here: it takes the oldest pending round (the scheduler
    processes decode results in order; a record whose batch size differs from the accept list's
    is dropped and counted), reads its ring slot and the round's elapsed time (the end mark is
    complete by then too), and calls ``observe`` and ``CostTable.observe``. The first timed
    round of each (bucket, width) cell is dropped (first-use costs: kernel compilation, lazy
    buffers); the controller then runs that width again in that bucket.

    Start-up (:meth:`seed_verify`): the worker's verify time per (batch size, width), measured
    by replaying its captured verify graphs, seeds the cost table, so the controller prices
    every width from the first round (:class:`CostTable`); ``startup`` records how that went
    (measured, skipped and why, or failed) for the snapshot. Without it the table fills online.

    ``cycle=True`` (``SGLANG_DDTREE_AUTO_CYCLE=1``, the exactness matrix): the widths in turn,
    one per round, so the width changes every round; the feed still runs (snapshot).
    ``cycle_widths`` (``SGLANG_DDTREE_AUTO_ONLY=off,16``; implies the cycle) cycles through
    those verify widths only; one width forces it (``=off``: every round plain decode, to
    measure or profile an option alone). A batch beyond every listed width's range runs the
    narrowest tree width (it serves every batch).

    ``off=True`` (the v2 worker's default; ``SGLANG_DDTREE_AUTO_OFF=0`` for False): :data:`OFF` is an option too, run as a round
    of verify width :data:`OFF_WIDTH` (only the root; no draft forward, so no estimate:
    :meth:`record` takes ``expected=None``). :meth:`choose` returns ``OFF_WIDTH`` for it;
    :attr:`verify_widths` lists it with the tree widths; the cycle starts with it.

    ``limits`` (``{width: largest batch}``, ``ddtree_serving.auto_width_limits``): each tree
    width serves only its own batch range, both for the controller and for the cycle; a round's
    estimates feed back only the widths its batch may run (the tree of a large batch is built
    for the widest width in range, so wider columns of its estimate are not that width's).
    """

    def __init__(
        self,
        widths: Sequence[int],
        budget: int,
        buckets: Sequence[int],
        graph_sizes: Sequence[int] | None = None,
        cycle: bool = False,
        device=None,
        ring: int = 64,
        explore_every: int = 64,
        log_interval: int = 200,
        off: bool = False,
        limits: Mapping[int, int | None] | None = None,
        cycle_widths: Sequence[int] | None = None,
    ):
        self.widths = sorted(int(w) for w in widths)
        if not self.widths or self.widths[0] < 1 or self.widths[-1] > int(budget) + 1:
            raise ValueError(f"widths must lie in 1..{int(budget) + 1}, got {list(widths)}")
        self.off = bool(off)
        if self.off and self.widths[0] <= OFF_WIDTH:
            raise ValueError(f"with off, tree widths must be > {OFF_WIDTH}, got {list(widths)}")
        self.budget = int(budget)
        self.index = width_gather_index(self.widths, self.budget, device)
        options = [*self.widths, *([OFF] if self.off else [])]
        table = CostTable(buckets, options, graph_sizes=graph_sizes)
        limits = {int(w): limit for w, limit in (limits or {}).items()}
        if set(limits) - set(self.widths):
            raise ValueError(f"limits for widths not served: {sorted(set(limits) - set(self.widths))}")
        self.controller = BudgetController(options, table, explore_every=explore_every, limits=limits)
        # The verify widths the worker needs a state for; the cycle's order.
        self.verify_widths = [*([OFF_WIDTH] if self.off else []), *self.widths]
        self.cycle_widths = None
        if cycle_widths:
            unknown = sorted({int(w) for w in cycle_widths} - set(self.verify_widths))
            if unknown:
                raise ValueError(f"cycle widths {unknown} are not served (verify widths {self.verify_widths})")
            self.cycle_widths = [w for w in self.verify_widths if w in {int(x) for x in cycle_widths}]
        self.cycle = bool(cycle) or self.cycle_widths is not None
        pin = torch.device(device).type == "cuda" if device is not None else False
        self.ring = torch.zeros((int(ring), len(self.widths)), dtype=torch.float32, pin_memory=pin)
        self.slot = 0
        self.pending: deque = deque()
        self.rounds = 0
        self.observed = 0
        self.dropped = 0
        self.warm: set = set()
        self.log_interval = int(log_interval)
        self.startup: dict = {"status": "not measured"}

    def seed_verify(self, verify_seconds: Mapping[tuple[int, int], float]) -> int:
        """Start-up verify seconds per ``(batch size, width)`` into the cost table (seeds of a
        batch size that is no bucket, or of a width not served, are left out). All or nothing:
        a time that is not a finite number of seconds > 0 raises before any cell is seeded.
        Returns how many cells were seeded."""
        table = self.controller.table
        cells = [(int(bs), int(w), table._check(s)) for (bs, w), s in verify_seconds.items()]
        served = set(self.widths) | ({OFF_WIDTH} if self.off else set())
        # width 1 seeds the off option: its rest is learned from tree rounds (which draft), so off
        # starts over-estimated until its own rounds are timed
        return sum(table.seed(bs, self.option(w), s) for bs, w, s in cells if w in served)

    def option(self, width: int) -> Option:
        """The controller's option a round of verify width ``width`` ran."""
        return OFF if self.off and int(width) == OFF_WIDTH else int(width)

    def choose(self, bs: int, sampled: bool = False) -> int:
        """The verify width of the next round of ``bs`` requests (``OFF_WIDTH``: off);
        ``sampled``: whether any of them samples (the calibration the choice uses)."""
        self.rounds += 1
        if not self.cycle:
            o = self.controller.choose(int(bs), sampled=bool(sampled))
            return OFF_WIDTH if o == OFF else int(o)
        offered = [w for w in self.verify_widths if self.controller.offers(self.option(w), bs)]
        ws = [w for w in self.cycle_widths or offered if w in offered] or [self.widths[0]]
        w = ws[(self.rounds - 1) % len(ws)]
        o = self.option(w)
        self.controller.history[o] += 1
        self.controller.last = o
        return w

    def record(
        self, width: int, expected: Tensor | None, start=None, end=None, bs: int | None = None, sampled: bool = False
    ) -> None:
        """One issued round: its width, ``expected`` ``[bs, W]`` (device; None for an off
        round, which then gives ``bs``), its start / end marks (CUDA events recorded on the
        forward stream, or host seconds; None: untimed) and whether the batch sampled (as given
        to :meth:`choose`)."""
        slot = None
        if expected is not None:
            slot = self.slot
            self.slot = (slot + 1) % self.ring.shape[0]
            self.ring[slot].copy_(expected.sum(dim=0), non_blocking=True)
            bs = int(expected.shape[0])
        elif bs is None:
            raise ValueError("a round without an estimate needs its batch size")
        if len(self.pending) >= self.ring.shape[0] - 1:  # results never came back: forget
            self.pending.popleft()
            self.dropped += 1
        self.pending.append((slot, int(width), int(bs), start, end, bool(sampled)))

    @staticmethod
    def _seconds(start, end) -> float | None:
        if start is None or end is None:
            return None
        if isinstance(start, float | int):
            return float(end) - float(start)
        if not end.query():  # not complete yet: leave the cell for a later round
            return None
        return 1e-3 * float(start.elapsed_time(end))

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: Sequence[int], batch_size: int = 0) -> bool:
        """The oldest pending round's accept lengths (accepted drafts per request, the bonus
        not counted). Returns whether this round is one to log."""
        if not self.pending:
            return False
        slot, width, bs, start, end, sampled = self.pending.popleft()
        n = len(num_correct_drafts_per_req)
        if n != bs:
            self.dropped += 1
            return False
        sums = {} if slot is None else {
            w: s for w, s in zip(self.widths, self.ring[slot].tolist()) if self.controller.offers(w, bs)
        }
        realised = float(sum(int(x) for x in num_correct_drafts_per_req)) + n
        option = self.option(width)
        self.controller.observe(option, sums, realised, n, sampled=sampled)
        seconds = self._seconds(start, end)
        if seconds is not None and seconds > 0:
            table = self.controller.table
            cell = (table.bucket_index(bs), option)
            if cell in self.warm:
                table.observe(bs, option, seconds)
            else:
                self.warm.add(cell)
        self.observed += 1
        return self.log_interval > 0 and self.observed % self.log_interval == 0

    def snapshot(self) -> dict:
        out = self.controller.snapshot()
        out.update(
            widths=list(self.widths),
            off=self.off,
            mode="cycle" if self.cycle else "controller",
            cycle_widths=None if self.cycle_widths is None else list(self.cycle_widths),
            rounds=self.rounds,
            observed_rounds=self.observed,
            dropped_rounds=self.dropped,
            startup=dict(self.startup),
        )
        return out

