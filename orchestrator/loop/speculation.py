"""What a speculative round costs, measured as the rounds run (orchestrator.loop.draft_length decides from it).

A round of b decoding requests that verifies n rows in all, drafted by `drafting` of them to a depth of at most k:

    round       = target(n)  +  scheduling  +  draft            (draft only when something is drafted; without drafts
                                                                the scheduling of a multi-pass step is shared)
    target(n)   = seconds of a target step of n rows: the median of recent steps of that size, else a line
    draft       = h + u * (k + 1) + g   h: a Propose call's seconds outside the replica's compute (the hop);
                                        u: the replica's compute seconds per draft step (the ingest of a
                                           round's rows counts as a step);
                                        g: what ingesting new requests' prompts adds, per Propose
                  (a block drafter drafts any k in one forward: its steps count as 1 whatever k is, so u * 2)
    (h, u, g measured per bucket of the number of requests a Propose carries)

A Propose that carries a request new to its replica (or started over there) ingests every row of its context: that
is paid once per request, whatever k is, so it does not count towards u. The replica's compute is fitted as
u * (k + 1) + r * rows (rows: the context rows of such requests), and g is r times the rows a Propose brings on
average. Counted as steps, one such Propose among a fresh server's first made a lone request look dear to draft
for (k about 2 where 5 pays).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from statistics import median

DECAY = 0.98  # weight of the past in the running means (acceptance, ingest, scheduling: about the last 50 count)
MIN_STEPS = 8  # target steps seen before the target's cost line is trusted
WINDOW = 16  # recent samples a cost is taken from (per draft step, per hop, per target step size)
# Proposes seen at a batch size before its draft cost is trusted: a whole window, so that a fresh server's slow first
# calls are a minority of the samples that the medians are taken over.
MIN_PROPOSES = WINDOW
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
class RoundCosts:
    """What a round costs, as measured: the target's steps by size, each batch size's Propose compute and hop, and
    the scheduling between calls. orchestrator.loop.draft_length decides from these how many drafts to ask for."""

    # Forward passes a step without drafts runs (--num-scheduler-steps, nothing else waiting): its scheduling is paid
    # once for them all, where a step with drafts pays it for one token each.
    decode_passes: int = 1
    target: CostLine = field(default_factory=CostLine)
    draft: dict[int, DraftCost] = field(default_factory=dict)  # by bucket(drafting requests): u_b, g_b
    draft_hop: dict[int, Recent] = field(default_factory=dict)  # by bucket(drafting requests): h_b
    scheduling: Average = field(default_factory=Average)
    # The replicas draft any k in one forward (block drafters: ProposedBatch.one_forward), so a Propose's compute
    # does not grow with k.
    one_forward: bool = False

    def draft_steps(self, k: int) -> int:
        """The draft steps of a Propose of at most k drafts, as the model counts them."""
        return 1 if self.one_forward else k

    def measured(self, batch: int) -> bool:
        """Whether the target's steps and the Proposes at this batch size are measured well enough to decide by."""
        draft = self.draft.get(bucket(batch))
        return self.target.count >= MIN_STEPS and draft is not None and draft.count >= MIN_PROPOSES

    def round_seconds(self, batch: int, rows: int, drafting: int, depth: int) -> float:
        """A round of `batch` decoding requests verifying `rows` rows in all, `drafting` of them with drafts of at
        most `depth` tokens from one Propose per replica: the target's step, scheduling and, when anything is
        drafted, the Propose (h + g + u * (depth + 1) of the measured batch size nearest `drafting`)."""
        return self.step_seconds(batch, rows, depth > 0) + self.propose_seconds(drafting, depth)

    def step_seconds(self, batch: int, rows: int, drafted: bool) -> float:
        """The target's step of `rows` rows for `batch` requests, and its scheduling."""
        if not drafted:
            return self.target.predict(rows) + self.scheduling.value / self.decode_passes
        # A step that verifies drafts never costs less than one without them. Medians of two sizes, taken at
        # different times on a loaded machine, can say otherwise, and then a draft never accepted looked worth
        # asking for (test_adaptive_k failed so under load: 18 draft tokens in 95 rounds, at most 12 expected).
        return max(self.target.predict(rows), self.target.predict(batch)) + self.scheduling.value

    def propose_seconds(self, drafting: int, depth: int) -> float:
        """A Propose for `drafting` requests of at most `depth` drafts (0: none, no Propose)."""
        if depth == 0:
            return 0.0
        size = min(self.draft, key=lambda measured: abs(measured.bit_length() - bucket(drafting).bit_length()))
        draft = self.draft[size]
        return self.draft_hop[size].value + draft.ingest + draft.per_step * (self.draft_steps(depth) + 1)

    def observe_target(self, tokens: int, seconds: float) -> None:
        """A target step: tokens computed (prompt chunks, verified tokens and drafts) and the call's seconds."""
        if tokens > 0:
            self.target.add(tokens, seconds)

    def observe_propose(
        self, batch: int, k: int, call_seconds: float, compute_seconds: float, new_rows: int = 0
    ) -> None:
        """A replica's Propose for `batch` requests of at most k drafts: the call's seconds and the replica's
        compute; `new_rows`: rows of context it ingested for requests new to it (or started over there)."""
        if batch <= 0 or k <= 0:
            return
        size = bucket(batch)
        self.draft_hop.setdefault(size, Recent()).add(max(0.0, call_seconds - compute_seconds))
        self.draft.setdefault(size, DraftCost()).add(self.draft_steps(k) + 1, new_rows, compute_seconds)

    def observe_scheduling(self, seconds: float) -> None:
        self.scheduling.add(seconds)
