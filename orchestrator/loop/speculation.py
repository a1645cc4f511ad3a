"""How many draft tokens a round asks for (k), chosen per batch from measured costs and acceptance.

Speculation pays when the tokens a round yields outweigh what the drafts cost: a round of b decoding requests with k
drafts each yields b * (1 + sum of p_1..p_k) tokens, where p_i is the measured rate at which draft position i is
accepted (all of positions 1..i accepted), and costs

    round(b, k) = target(b * (k + 1))  +  draft(b, k)  +  scheduling
    target(n)   = seconds of a target step of n tokens: the median of recent steps of that size, else a line
    draft(b, k) = h_b + u_b * (k + 1) + g_b   h_b: a Propose call's seconds outside the replica's compute (the hop);
                                              u_b: the replica's compute seconds per draft step (the ingest of a
                                              round's rows counts as a step);
                                              g_b: what ingesting new requests' prompts adds, per Propose
    draft(b, 0) = 0                           no Propose at all

A Propose that carries a request new to its replica (or started over there) ingests every row of its context: that
is paid once per request, whatever k is, so it does not count towards u_b. The replica's compute is fitted as
u_b * (k + 1) + r_b * rows (rows: the context rows of such requests), and g_b is r_b times the rows a Propose brings
on average. Counted as steps, one such Propose among a fresh server's first made a lone request look dear to draft
for (k about 2 where 5 pays).

The policy picks the k in 0..max_k with the most tokens per second, and keeps the current k unless another is better
by HYSTERESIS (a noisy estimate must not make k flap). Until the first measurements of a batch size are in, it uses
max_k, which is what measures them; below max_k, one round in EXPLORE_EVERY drafts max_k, so that the acceptance of
the positions it does not draft and the cost of more steps stay measured.

Example (shaped like the demo pair on 2 CPU cores of an earlier machine, hop left out): with a = 4.6 ms,
c = 0.65 ms a token, u_1 = 1.2 ms and p = 0.8, 0.68, 0.6, 0.53, 0.49, one request gets k = 5 (4.1 tokens in 15.7 ms,
against 1 in 5.25 ms for k = 0); at b = 32, where u_32 = 6 ms, k = 0 wins (32 tokens in 25.4 ms, against 57.6 in
58.2 ms for k = 1): speculation need not lose to target-only decoding on the same servers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from statistics import median

LOG = logging.getLogger(__name__)

HYSTERESIS = 0.05  # another k must promise this much more throughput to replace the current one
EXPLORE_EVERY = 32  # below max_k, one round in this many drafts max_k, so that acceptance and costs stay measured
DECAY = 0.98  # weight of the past in the running means (acceptance, ingest, scheduling: about the last 50 count)
MIN_STEPS = 8  # target steps seen before the target's cost line is trusted
WINDOW = 16  # recent samples a cost is taken from (per draft step, per hop, per target step size)
# Proposes seen at a batch size before its draft cost is trusted: a whole window, so that a fresh server's slow first
# calls are a minority of the samples that the medians are taken over.
MIN_PROPOSES = WINDOW
MIN_ROUNDS = 12.0  # (decayed) rounds that drafted a first token before the acceptance is trusted
# Steps a batch size's k must stay at 0 before its requests are paused (taken off their replicas for good): at 8
# requests estimates a few percent apart made k flap 0 -> 5 -> 0 within 100 ms, and each flap paused requests that
# never came back (bench/ab.py at c = 8: acceptance length 1.0-2.6 for a stretch, against 3.7).
PAUSE_AFTER = 16
SIZES = 64  # target step sizes (tokens) the cost line keeps, the most recently seen
OWN_SAMPLES = 3  # samples at a step size from which its own median is its cost, not the line's value


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, ... (powers of two)."""
    return 1 << max(0, batch - 1).bit_length()


class CostLine:
    """The seconds of a target step of x tokens: the median of the recent steps of that size once there are
    OWN_SAMPLES of them, else y = a + c * x, least squares through the medians of every size (weighted by their
    number of samples).

    Medians, because the first calls of a new process, of a new request's context and of each new shape are slow
    (page faults, kernels' first runs): a fresh server's first verification took 27 ms where the next took 13, and
    a decayed mean kept such calls for tens of rounds. A size's own median first, because one line does not fit
    every batch (the attention runs per sequence): fitted to one request's steps and 8 requests' together it put
    a verification of 8 x 6 rows at 31 ms where it took 39.
    """

    def __init__(self) -> None:
        self.samples: OrderedDict[int, deque[float]] = OrderedDict()  # x -> recent y, the last seen x last
        self.count = 0
        self._fit = (0.0, 0.0)  # (a, c)
        self._medians: dict[int, float] = {}  # x -> median of samples[x]

    def add(self, x: int, y: float) -> None:
        recent = self.samples.pop(x, None) or deque(maxlen=WINDOW)
        recent.append(y)
        self.samples[x] = recent
        if len(self.samples) > SIZES:
            del self._medians[self.samples.popitem(last=False)[0]]
        self._medians[x] = median(recent)
        self.count += 1
        self._fit = self._refit()

    def predict(self, x: int) -> float:
        if len(self.samples.get(x, ())) >= OWN_SAMPLES:
            return self._medians[x]
        a, c = self._fit
        return max(0.0, a + c * x)

    def _refit(self) -> tuple[float, float]:
        points = [(x, self._medians[x], len(ys)) for x, ys in self.samples.items()]
        weight = sum(w for _, _, w in points)
        mean_x = sum(x * w for x, _, w in points) / weight
        mean_y = sum(y * w for _, y, w in points) / weight
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in points) / weight
        if spread <= 1e-9 * max(1.0, mean_x * mean_x):
            # Every step had the same size: cost proportional to size is the best guess through the origin.
            return (0.0, mean_y / mean_x) if mean_x > 0 else (mean_y, 0.0)
        slope = max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / weight / spread)
        return mean_y - slope * mean_x, slope


class Recent:
    """The mean of the last WINDOW samples: a slow first call is forgotten after WINDOW more. Not a median: what a
    round waits for a replica is legitimately two-sided (a round whose drafts were made ahead waits about nothing
    for them, an asked one for the whole call), and the mean is what a round costs on average."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.value = 0.0

    def add(self, sample: float) -> None:
        self.samples.append(sample)
        self.value = sum(self.samples) / len(self.samples)


class DraftCost:
    """A replica's compute for a Propose: u seconds per draft step (the ingest of a round's rows counts as one) and
    r per row of context it ingests for requests new to it, `seconds = u * (k + 1) + r * rows`, from the last WINDOW
    Proposes. Where most of them ingested nothing, u is their median per step and r the median of what the others
    took beyond their steps, per row: a fresh server's few slow first calls do not move a median. Under steady
    arrivals at a large batch nearly every Propose ingests: then both come from a least-squares fit (with no new
    request among the samples, r keeps its last value)."""

    def __init__(self) -> None:
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)  # (k + 1, rows ingested, seconds)
        self.rows = Average()  # rows ingested per Propose, over a longer horizon (they come in bursts)
        self.count = 0
        self.per_step = 0.0
        self.per_row = 0.0

    def add(self, steps: int, rows: int, seconds: float) -> None:
        self.samples.append((steps, rows, seconds))
        self.rows.add(rows)
        self.count += 1
        self.per_step, self.per_row = self._fit()

    @property
    def ingest(self) -> float:
        """What ingesting new requests' contexts adds to a Propose, on average (g_b)."""
        return self.per_row * self.rows.value

    def _fit(self) -> tuple[float, float]:
        steady = [seconds / steps for steps, rows, seconds in self.samples if rows == 0]
        if 2 * len(steady) <= len(self.samples):
            return self._least_squares()
        per_step = median(steady)
        ingests = [(seconds - per_step * steps) / rows for steps, rows, seconds in self.samples if rows > 0]
        return per_step, max(0.0, median(ingests)) if ingests else self.per_row

    def _least_squares(self) -> tuple[float, float]:
        kk = sum(k * k for k, _, _ in self.samples)
        kr = sum(k * r for k, r, _ in self.samples)
        rr = sum(r * r for _, r, _ in self.samples)
        ky = sum(k * y for k, _, y in self.samples)
        ry = sum(r * y for _, r, y in self.samples)
        steps_only = max(0.0, ky / kk)
        if rr == 0:
            # No new request among them: the cost of a row stays what it was (the rows' mean still counts them).
            return steps_only, self.per_row
        determinant = kk * rr - kr * kr
        if determinant <= 1e-9 * kk * rr:
            return steps_only, 0.0  # rows always in proportion to the steps: all of it is steps
        per_step = (ky * rr - ry * kr) / determinant
        per_row = (kk * ry - kr * ky) / determinant
        if per_row < 0:
            return steps_only, 0.0
        if per_step < 0:
            return 0.0, ry / rr
        return per_step, per_row


@dataclass
class Average:
    """A mean with exponential forgetting."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, sample: float) -> None:
        self.weight = DECAY * self.weight + 1.0
        self.value += (sample - self.value) / self.weight


@dataclass
class SpeculationPolicy:
    max_k: int
    adaptive: bool = True
    target: CostLine = field(default_factory=CostLine)
    draft: dict[int, DraftCost] = field(default_factory=dict)  # by bucket(batch): the replica's compute (u_b, g_b)
    draft_hop: dict[int, Recent] = field(default_factory=dict)  # by bucket(batch): Propose seconds outside compute
    scheduling: Average = field(default_factory=Average)
    drafted: list[float] = field(default_factory=list)  # decayed count of rounds that drafted position i
    accepted: list[float] = field(default_factory=list)  # decayed count of rounds that accepted position i
    current: dict[int, int] = field(default_factory=dict)  # by bucket(batch): the k in use
    changes: dict[int, int] = field(default_factory=dict)  # by bucket(batch): how often its k changed (metrics)
    at_zero: dict[int, int] = field(default_factory=dict)  # by bucket(batch): consecutive choices settled at k = 0
    explored: dict[int, int] = field(default_factory=dict)  # by bucket(batch): rounds chosen below max_k

    def __post_init__(self) -> None:
        self.drafted = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def choose(self, batch: int) -> int:
        """k for a round of `batch` decoding requests."""
        if not self.adaptive or self.max_k == 0 or batch == 0:
            return self.max_k
        size = bucket(batch)
        draft = self.draft.get(size)
        current = self.settled(batch)
        if self.target.count < MIN_STEPS or draft is None or draft.count < MIN_PROPOSES or self.drafted[0] < MIN_ROUNDS:
            return current
        self.current.setdefault(size, current)  # measured from here on (metrics)
        hop = self.draft_hop[size].value + draft.ingest
        rates = {k: self.throughput(batch, k, draft.per_step, hop) for k in range(self.max_k + 1)}
        best = max(rates, key=lambda k: rates[k])
        if rates[best] > rates[current] * (1 + HYSTERESIS):
            self._log_change(size, current, best, rates, draft, hop)
            self.current[size] = current = best
            self.changes[size] = self.changes.get(size, 0) + 1
        self.at_zero[size] = self.at_zero.get(size, 0) + 1 if current == 0 else 0
        if current == self.max_k:
            return current
        # Positions past k are not drafted, so their acceptance would never be measured again (nor would it be with
        # k = 0): a draft that got better, or a batch that got smaller, would never be asked for more.
        self.explored[size] = self.explored.get(size, 0) + 1
        return self.max_k if self.explored[size] % EXPLORE_EVERY == 0 else current

    def _log_change(self, size: int, old: int, new: int, rates: dict[int, float], draft: DraftCost, hop: float) -> None:
        """One INFO line with what decided a batch size's new k."""
        LOG.info(
            "adaptive k for batches of %s: %d -> %d; tokens/s by k %s; target step %.2f ms at k %d, %.2f ms at k %d; "
            "draft %.2f ms a step + %.2f ms a Propose; acceptance by position %s",
            f"{size // 2 + 1}-{size}" if size > 2 else size,
            old,
            new,
            " ".join(f"{rate:.0f}" for rate in rates.values()),
            1000 * self.target.predict(size * (old + 1)),
            old,
            1000 * self.target.predict(size * (new + 1)),
            new,
            1000 * draft.per_step,
            1000 * hop,
            " ".join(f"{self.acceptance(i):.2f}" for i in range(self.max_k)),
        )

    def settled(self, batch: int) -> int:
        """The k that rounds of `batch` requests draft apart from exploration: the next round's, most likely."""
        if not self.adaptive or self.max_k == 0 or batch == 0:
            return self.max_k
        return self.current.get(bucket(batch), self.max_k)

    def paused(self, batch: int) -> bool:
        """Whether measurements settled this batch size at k = 0 (never the configured k it starts from) for
        PAUSE_AFTER choices in a row: drafting does not pay there, so its requests may as well decode without a replica
        (Placement.pause_speculation)."""
        if not self.adaptive or self.max_k == 0 or batch == 0:
            return False
        size = bucket(batch)
        return self.current.get(size) == 0 and self.at_zero.get(size, 0) >= PAUSE_AFTER

    def throughput(self, batch: int, k: int, draft_step_s: float, draft_hop_s: float = 0.0) -> float:
        """Tokens per second of a round of `batch` requests with k drafts each, by the current estimates;
        `draft_hop_s` is what a Propose costs whatever its k (h_b + g_b)."""
        tokens = batch * (1.0 + sum(self.acceptance(i) for i in range(k)))
        seconds = self.target.predict(batch * (k + 1)) + self.scheduling.value
        if k > 0:
            # A step that verifies drafts never costs less than one without them. Medians of two sizes, taken at
            # different times on a loaded machine, can say otherwise, and then a draft never accepted looked worth
            # asking for (test_adaptive_k failed so under load: 18 draft tokens in 95 rounds, at most 12 expected).
            seconds = max(seconds, self.target.predict(batch) + self.scheduling.value)
            seconds += draft_hop_s + draft_step_s * (k + 1)
        return tokens / seconds if seconds > 0 else 0.0

    def acceptance(self, position: int) -> float:
        """Rate at which draft position `position` (0-based) is accepted, when drafted."""
        drafted = self.drafted[position]
        return self.accepted[position] / drafted if drafted > 0 else 0.0

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A target step: tokens computed (prompt chunks, verified tokens and drafts) and the call's seconds."""
        if tokens > 0:
            self.target.add(tokens, seconds)

    def observe_propose(
        self, batch: int, k: int, call_seconds: float, compute_seconds: float, new_rows: int = 0
    ) -> None:
        """A replica's Propose for `batch` requests of k drafts: the call's seconds and the replica's compute;
        `new_rows`: rows of context it ingested for requests new to it (or started over there)."""
        if batch <= 0 or k <= 0:
            return
        size = bucket(batch)
        self.draft_hop.setdefault(size, Recent()).add(max(0.0, call_seconds - compute_seconds))
        self.draft.setdefault(size, DraftCost()).add(k + 1, new_rows, compute_seconds)

    def observe_round(self, drafts: int, accepted: int) -> None:
        """One request's round: drafts verified and how many of them were accepted."""
        for position in range(min(drafts, self.max_k)):
            self.drafted[position] = DECAY * self.drafted[position] + 1.0
            self.accepted[position] = DECAY * self.accepted[position] + (1.0 if position < accepted else 0.0)

    def observe_scheduling(self, seconds: float) -> None:
        self.scheduling.add(seconds)
