"""How many drafts each request's round asks for (its k, 0 included), chosen every step for the batch at hand.

Draft position j of request r is accepted (with every earlier one) at an estimated rate s_r(j), falling with j. A
round of b decoding requests that asks r for k_r drafts yields b + sum over r of s_r(0) + ... + s_r(k_r - 1) tokens
and costs round(b + sum k_r rows, the requests that draft, max k_r) seconds (orchestrator.loop.speculation). Every
position (r, j) is ranked by s_r(j), so that a request's positions come in order; the policy takes the prefix of
that ranking (or of one that puts every request's first position first) with the most tokens per second among those
that slow no class down: each class present (and the requests that cannot draft, together) must expect on average
at least the tokens per second a round without drafts gives it. One request alone drafts what pays for it; in a
batch where a JSON request's drafts fail, the free-text requests beside it draft only as far as the JSON request's
own gain covers the longer step (on 2 CPU cores: not at all, a Propose costs as much as the step), and a request
that decodes target-only is never slowed by the others; a free request on a bad streak does not hold back the rest
of its class (an A/B at 8 requests found the batch held to its weakest request drafting nothing).

s_r(j) is the request's own decayed acceptance drawn towards its class's (free text, grammar, penalties: drafts fare
differently under each) with the weight of PRIOR_ROUNDS rounds, so that a new request starts from its class and
moves to what it shows; a class's is drawn towards every class's the same way, so that a new class starts from it.
Forced grammar tokens come whatever k is (the target appends them) and are not counted as the drafter's.

The last allocation stays unless the best promises HYSTERESIS more (noisy estimates must not make k flap). Until
the costs and acceptance are measured, every request drafts its cap, which measures them. When some request drafts
below its cap, one step in EXPLORE_EVERY (per batch size) lets one of them draft its cap, in turn, so that positions
not drafted stay measured and a request at k = 0 tries again at a bounded cost: one request's full drafts per
EXPLORE_EVERY steps. A batch size whose steps drafted nothing for PAUSE_AFTER steps in a row is paused
(orchestrator.loop.placement): all but one request leave their replica.

Example (the demo pair's recorded acceptance, tests/unit/data/acceptance_traces.json, costs shaped like 2 CPU
cores): free code accepts 0.82 0.72 0.62 0.58 0.55 by position and drafts 5 alone; JSON accepts 0.17 at the first
position past the forced tokens and drafts nothing, its class learnt from the first few JSON requests.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from orchestrator.loop.speculation import DECAY, RoundCosts, bucket
from tandem.sampling.params import SamplingParams

LOG = logging.getLogger(__name__)

HYSTERESIS = 0.05  # another allocation must promise this much more throughput to replace the last one
EXPLORE_EVERY = 32  # below the caps, one step in this many lets one request draft its cap
MIN_ROUNDS = 12.0  # (decayed) rounds that drafted a first token before acceptance is trusted at all
# Steps a batch size must draft nothing before its requests are paused (taken off their replicas for good): at 8
# requests estimates a few percent apart made k flap 0 -> 5 -> 0 within 100 ms, and each flap paused requests that
# never came back (bench/ab.py at c = 8: acceptance length 1.0-2.6 for a stretch, against 3.7).
PAUSE_AFTER = 16
PRIOR_ROUNDS = 4.0  # weight, in rounds, of a class's acceptance in a request's estimate (and of all in a class's)
REQUEST_DECAY = 0.9  # of a request's own rounds: about the last ten count

FREE, GRAMMAR, PENALTIES = "free", "grammar", "penalties"
CLASSES = (FREE, GRAMMAR, PENALTIES)


def request_class(sampling: SamplingParams) -> str:
    """The constraint a request's drafts are verified under: a grammar, else penalties or bias, else free text."""
    if sampling.grammar:
        return GRAMMAR
    penalised = sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty != 1.0
    return PENALTIES if penalised or sampling.logit_bias else FREE


class Survival:
    """Decayed counts, per draft position, of rounds that drafted it and of those that accepted it (and every
    earlier position)."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self.drafted: list[float] = []
        self.accepted: list[float] = []

    def observe(self, depth: int, accepted: int) -> None:
        """A round that drafted `depth` positions, of which the first `accepted` were accepted."""
        while len(self.drafted) < depth:
            self.drafted.append(0.0)
            self.accepted.append(0.0)
        for position in range(depth):
            self.drafted[position] = self.decay * self.drafted[position] + 1.0
            hit = 1.0 if position < accepted else 0.0
            self.accepted[position] = self.decay * self.accepted[position] + hit

    def rate(self, position: int, min_rounds: float = 0.0) -> float | None:
        """The acceptance of `position`, or None when fewer than `min_rounds` (or no) rounds drafted it."""
        drafted = self.drafted[position] if position < len(self.drafted) else 0.0
        if drafted <= 0.0 or drafted < min_rounds:
            return None
        return self.accepted[position] / drafted

    def counts(self, position: int) -> tuple[float, float]:
        """(accepted, drafted) at `position`."""
        if position >= len(self.drafted):
            return 0.0, 0.0
        return self.accepted[position], self.drafted[position]


@dataclass(frozen=True)
class Candidate:
    key: str
    survival: tuple[float, ...]  # estimated acceptance of each position it may draft, falling
    previous: int | None = None  # its k in the last allocation; None: it had none
    counted: bool = True  # whether the allocation must not slow it down (Asking.exempt)
    group: str = ""  # candidates held to "not slowed" together, on average (its class); "": on its own


Seconds = Callable[[int, int, int], float]  # (rows, drafting requests, deepest k) -> seconds of the round


def allocate(candidates: Sequence[Candidate], batch: int, seconds: Seconds) -> tuple[dict[str, int], float]:
    """The k of each candidate that maximise the round's tokens per second without slowing any group of candidates
    down (its members' mean expected tokens per second at least what a round without drafts gives them), and that
    rate; `batch`: the round's decoding requests (one row each, candidates or not); candidates not `counted` may be
    slowed. Two rankings are scanned: every position by survival, and every candidate's first position before the
    others (where drafting pays only if no group is left without)."""
    plain = max(seconds(batch, 0, 0), 1e-9)
    best_rate, best = batch / plain, dict.fromkeys((c.key for c in candidates), 0)
    group_of = {c.key: c.group or c.key for c in candidates if c.counted}
    size = Counter(group_of.values())
    first, second = _rankings(candidates)
    for ranking in (first, second):
        if ranking is second and (second == first or all(best[key] for key in group_of)):
            break  # the first ranking's best drafts for everyone: putting first positions first adds nothing
        lengths, gained = dict.fromkeys(best, 0), dict.fromkeys(size, 0.0)
        tokens, depth, drafting, without = float(batch), 0, 0, len(size)
        for taken, (s, position, key) in enumerate(ranking, 1):
            drafting += lengths[key] == 0
            lengths[key] += 1
            if key in group_of:
                without -= gained[group_of[key]] == 0.0 < s
                gained[group_of[key]] += s
            tokens += s
            depth = max(depth, position + 1)
            if without:
                continue  # a round with drafts is longer than one without: it would slow a group that gains nothing
            round_seconds = max(seconds(batch + taken, drafting, depth), 1e-9)
            least = min((gained[group] / size[group] for group in size), default=0.0)
            if tokens / round_seconds > best_rate and round_seconds <= plain * (1 + least):
                best_rate, best = tokens / round_seconds, dict(lengths)
    return best, best_rate


def _rankings(candidates: Sequence[Candidate]) -> tuple[list[tuple[float, int, str]], list[tuple[float, int, str]]]:
    """(survival, position, key) of every position, best first; then with every first position ahead of the rest.
    Survival falls with the position, so any prefix of either drafts each candidate's first positions."""
    entries = [(s, position, c.key) for c in candidates for position, s in enumerate(c.survival)]
    ranked = sorted(entries, key=lambda entry: (-entry[0], entry[1]))
    return ranked, sorted(ranked, key=lambda entry: entry[1] > 0)  # a stable sort keeps the order within each


def group(asking: Asking) -> str:
    """Who a request is held to "not slowed" with, on average: its class, or the requests that cannot draft."""
    return asking.request_class if asking.cap else "no drafts"


def _drawn_one(counts: Survival, position: int, prior: float) -> float:
    """The rate at `position` of `counts` drawn towards `prior` with the weight of PRIOR_ROUNDS rounds."""
    accepted, drafted = counts.counts(position)
    return (accepted + PRIOR_ROUNDS * prior) / (drafted + PRIOR_ROUNDS)


def _drawn(prior: Sequence[float], own: Survival) -> list[float]:
    """A request's rates by position: its own rounds drawn towards `prior`, never rising."""
    values, last = [], 1.0
    for position, rate in enumerate(prior):
        last = min(last, _drawn_one(own, position, rate) if own.drafted else rate)
        values.append(last)
    return values


def rate_of(lengths: dict[str, int], candidates: Sequence[Candidate], batch: int, seconds: Seconds) -> float | None:
    """Tokens per second of a round drafting `lengths` for the candidates; None when it slows a group down."""
    gained: dict[str, list[float]] = {}
    for c in candidates:
        if c.counted:
            gained.setdefault(c.group or c.key, []).append(sum(c.survival[: lengths[c.key]]))
    rows = batch + sum(lengths.values())
    drafting = sum(1 for k in lengths.values() if k > 0)
    round_seconds = max(seconds(rows, drafting, max(lengths.values(), default=0)), 1e-9)
    least = min((sum(gains) / len(gains) for gains in gained.values()), default=0.0)
    if round_seconds > max(seconds(batch, 0, 0), 1e-9) * (1 + least):
        return None
    tokens = batch + sum(sum(c.survival[: lengths[c.key]]) for c in candidates)
    return tokens / round_seconds


@dataclass(frozen=True)
class Asking:
    """A decoding request as the choice sees it."""

    key: str  # its request id
    request_class: str  # FREE, GRAMMAR or PENALTIES
    own: Survival  # its own rounds
    cap: int  # drafts it may verify this round (0: no replica, or its last token)
    previous: int | None = None  # its k settled in the last step; None: none yet
    exempt: bool = False  # not held to "slows no class down": on its last token (one longer step at most)


@dataclass(frozen=True)
class Choice:
    lengths: dict[str, int]  # this step's k by request id
    settled: dict[str, int]  # the k apart from exploration: what the next round most likely drafts


@dataclass
class DraftLengths:
    max_k: int
    adaptive: bool = True
    costs: RoundCosts = field(default_factory=RoundCosts)
    overall: Survival = field(default_factory=Survival)  # every class's rounds
    classes: dict[str, Survival] = field(default_factory=lambda: {name: Survival() for name in CLASSES})
    current: dict[int, int] = field(default_factory=dict)  # by bucket(batch): the deepest settled k (metrics)
    changes: dict[int, int] = field(default_factory=dict)  # by bucket(batch): how often that changed (metrics)
    at_zero: dict[int, int] = field(default_factory=dict)  # by bucket(batch): steps in a row that drafted nothing
    explored: dict[int, int] = field(default_factory=dict)  # by bucket(batch): steps below the caps
    rounds: Counter[tuple[str, int]] = field(default_factory=Counter)  # (class, k) -> rounds asked (metrics)
    skipped: Counter[str] = field(default_factory=Counter)  # class -> new requests it started paused
    confidence_cuts: int = 0  # drafts left unverified by their drafter's confidence (orchestrator.loop.confidence)

    def choose(self, batch: int, asking: Sequence[Asking]) -> Choice:
        """Each decoding request's k for a step in which `batch` requests speculate (paused ones included)."""
        full = {a.key: a.cap for a in asking}
        if not self.adaptive or self.max_k == 0 or batch == 0 or not self._measured(batch):
            return self._counted(Choice(full, full), asking)
        size = bucket(batch)
        self.current.setdefault(size, self.max_k)
        priors = {name: self._class_prior(name) for name in {a.request_class for a in asking}}
        candidates = [
            Candidate(a.key, tuple(_drawn(priors[a.request_class], a.own)[: a.cap]), a.previous, not a.exempt, group(a))
            for a in asking
        ]
        seconds = self._seconds(len(asking))
        lengths, rate = allocate(candidates, len(asking), seconds)
        kept = {c.key: lengths[c.key] if c.previous is None else min(c.previous, len(c.survival)) for c in candidates}
        kept_rate = rate_of(kept, candidates, len(asking), seconds) if kept != lengths else None
        if kept_rate is not None and rate <= kept_rate * (1 + HYSTERESIS):
            lengths, rate = kept, kept_rate
        self._log_requests(candidates, lengths, asking, (rate, len(asking) / max(seconds(len(asking), 0, 0), 1e-9)))
        self._settle(size, lengths, candidates)
        if lengths == full:
            return self._counted(Choice(lengths, lengths), asking)
        self.explored[size] = self.explored.get(size, 0) + 1
        if self.explored[size] % EXPLORE_EVERY:
            return self._counted(Choice(lengths, lengths), asking)
        # One request below its cap drafts it, in turn: the others' rows and a wider Propose are not paid for it.
        below = [a for a in asking if lengths[a.key] < a.cap]
        probe = below[(self.explored[size] // EXPLORE_EVERY) % len(below)]
        return self._counted(Choice({**lengths, probe.key: probe.cap}, lengths), asking)

    def expected(self, asking: Asking, batch: int) -> int:
        """The k the request's next round most likely drafts (what a replica drafts ahead for): its settled one, or
        for its first round what would pay for it in a round of `batch` requests that draft nothing else."""
        if asking.previous is not None or not self.adaptive or self.max_k == 0 or not self._measured(batch):
            return min(asking.cap if asking.previous is None else asking.previous, asking.cap)
        alone = Candidate(asking.key, tuple(self.survival(asking.request_class, asking.own)[: asking.cap]))
        return allocate([alone], batch, self._seconds(batch))[0][asking.key]

    def admits(self, request_class: str, batch: int) -> bool:
        """Whether a new request of this class gets a replica. Once measured, one whose class would draft nothing
        in a batch of this size starts paused (no rows captured or streamed, several tokens a step), but for one in
        EXPLORE_EVERY of its class, so that the class stays measured."""
        if not self.adaptive or self.max_k == 0 or not self._measured(batch):
            return True
        # A batch of this class alone: would it draft? (Alone among requests that draft nothing, a request at 8
        # never would, and its class-mates arriving beside it never would either.)
        prior = tuple(self._class_prior(request_class))
        mates = [Candidate(str(index), prior, group=request_class) for index in range(batch)]
        if any(allocate(mates, batch, self._seconds(batch))[0].values()):
            return True
        self.skipped[request_class] += 1
        return self.skipped[request_class] % EXPLORE_EVERY == 0

    def survival(self, request_class: str, own: Survival) -> list[float]:
        """The request's estimated acceptance by position (0..max_k - 1), never rising: its own rounds drawn towards
        its class's, the class's drawn towards every class's (PRIOR_ROUNDS each)."""
        return _drawn(self._class_prior(request_class), own)

    def _class_prior(self, request_class: str) -> list[float]:
        """The class's acceptance by position drawn towards every class's."""
        values, last = [], 1.0
        for position in range(self.max_k):
            overall = self.overall.rate(position)
            last = _drawn_one(self.classes[request_class], position, last if overall is None else overall)
            values.append(last)
        return values

    def _seconds(self, batch: int) -> Seconds:
        """round_seconds for rounds of `batch` requests, its parts remembered (an allocation asks for hundreds)."""
        steps: dict[tuple[int, bool], float] = {}
        proposes: dict[tuple[int, int], float] = {}

        def seconds(rows: int, drafting: int, depth: int) -> float:
            step = steps.get((rows, depth > 0))
            if step is None:
                step = steps[(rows, depth > 0)] = self.costs.step_seconds(batch, rows, depth > 0)
            propose = proposes.get((bucket(drafting), depth))
            if propose is None:
                propose = proposes[(bucket(drafting), depth)] = self.costs.propose_seconds(drafting, depth)
            return step + propose

        return seconds

    def paused(self, batch: int) -> bool:
        """Whether measurements settled this batch size at no drafts (never the caps it starts from) for
        PAUSE_AFTER steps in a row: drafting does not pay there, so its requests may as well decode without a
        replica (Placement.pause_speculation)."""
        if not self.adaptive or self.max_k == 0 or batch == 0:
            return False
        size = bucket(batch)
        return self.current.get(size) == 0 and self.at_zero.get(size, 0) >= PAUSE_AFTER

    def pauses_now(self, batch: int) -> bool:
        """Whether this step is the one at which the batch size became paused: the requests on their replicas then
        leave them. Requests admitted later keep theirs (`admits` decides), so that the batch drafts again once
        enough of them would gain from it."""
        return self.paused(batch) and self.at_zero[bucket(batch)] == PAUSE_AFTER

    def observe_round(self, request_class: str, own: Survival, depth: int, accepted: int) -> None:
        """One request's round: the drafter's tokens verified (its depth) and how many of them were accepted."""
        depth = min(depth, self.max_k)
        for counts in (self.overall, self.classes[request_class], own):
            counts.observe(depth, accepted)

    def _measured(self, batch: int) -> bool:
        return self.costs.measured(batch) and (self.overall.rate(0, MIN_ROUNDS) is not None)

    def _counted(self, choice: Choice, asking: Sequence[Asking]) -> Choice:
        for a in asking:
            if a.cap > 0:
                self.rounds[(a.request_class, choice.lengths[a.key])] += 1
        return choice

    def _settle(self, size: int, lengths: dict[str, int], candidates: Sequence[Candidate]) -> None:
        deepest = max(lengths.values(), default=0)
        self.at_zero[size] = self.at_zero.get(size, 0) + 1 if deepest == 0 else 0
        if deepest == self.current[size]:
            return
        LOG.info(
            "adaptive k for batches of %s: deepest k %d -> %d (requests %s); target step %.2f ms for %d rows",
            f"{size // 2 + 1}-{size}" if size > 2 else size,
            self.current[size],
            deepest,
            ", ".join(f"{n} at k {k}" for k, n in sorted(Counter(lengths.values()).items(), reverse=True)),
            1000 * self.costs.target.predict(len(candidates) + sum(lengths.values())),
            len(candidates) + sum(lengths.values()),
        )
        self.current[size] = deepest
        self.changes[size] = self.changes.get(size, 0) + 1

    def _log_requests(
        self,
        candidates: Sequence[Candidate],
        lengths: dict[str, int],
        asking: Sequence[Asking],
        rates: tuple[float, float],  # tokens/s the choice expects of the round, and of one without drafts
    ) -> None:
        """A DEBUG line for each request whose k changed, with the estimates behind it."""
        if not LOG.isEnabledFor(logging.DEBUG):
            return
        for candidate, a in zip(candidates, asking, strict=True):
            k = lengths[candidate.key]
            if k == candidate.previous:
                continue
            LOG.debug(
                "request %s (%s): k %s -> %d of %d; acceptance by position %s; %d requests, %d rows, expected %.0f "
                "tok/s (%.0f without drafts)",
                candidate.key,
                a.request_class,
                "-" if candidate.previous is None else candidate.previous,
                k,
                a.cap,
                " ".join(f"{s:.2f}" for s in candidate.survival),
                len(asking),
                len(asking) + sum(lengths.values()),
                *rates,
            )
