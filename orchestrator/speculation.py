"""How many draft tokens a round asks for (k), chosen per batch from measured costs and acceptance.

Speculation pays when the tokens a round yields outweigh what the drafts cost: a round of b decoding requests with k
drafts each yields b * (1 + sum of p_1..p_k) tokens, where p_i is the measured rate at which draft position i is
accepted (all of positions 1..i accepted), and costs

    round(b, k) = target(b * (k + 1))  +  draft(b, k)  +  scheduling
    target(n)   = a + c * n             fitted to every target step (tokens computed -> seconds of the call)
    draft(b, k) = h_b + u_b * (k + 1)   h_b: a Propose call's seconds outside the replica's compute (the hop);
                                        u_b: the replica's compute seconds per draft step (ingest counts as a step)
    draft(b, 0) = 0                     no Propose at all

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

from dataclasses import dataclass, field

HYSTERESIS = 0.05  # another k must promise this much more throughput to replace the current one
EXPLORE_EVERY = 32  # below max_k, one round in this many drafts max_k, so that acceptance and costs stay measured
DECAY = 0.98  # weight of the past in every running estimate (about the last 50 observations count)
MIN_STEPS = 8  # target steps seen before the target's cost line is trusted


def bucket(batch: int) -> int:
    """Batch sizes measured together: 1, 2, 3-4, 5-8, ... (powers of two)."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class CostLine:
    """y = a + c * x, a least-squares fit with exponential forgetting."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    count: int = 0

    def add(self, x: float, y: float) -> None:
        self.weight = DECAY * self.weight + 1.0
        self.sum_x = DECAY * self.sum_x + x
        self.sum_y = DECAY * self.sum_y + y
        self.sum_xx = DECAY * self.sum_xx + x * x
        self.sum_xy = DECAY * self.sum_xy + x * y
        self.count += 1

    def predict(self, x: float) -> float:
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        spread = self.sum_xx / self.weight - mean_x * mean_x
        if spread <= 1e-9 * max(1.0, mean_x * mean_x):
            # Every step had the same size: cost proportional to size is the best guess through the origin.
            return mean_y * x / mean_x if mean_x > 0 else mean_y
        slope = max(0.0, (self.sum_xy / self.weight - mean_x * mean_y) / spread)
        return max(0.0, mean_y + slope * (x - mean_x))


@dataclass
class Average:
    value: float = 0.0
    weight: float = 0.0

    def add(self, sample: float) -> None:
        self.weight = DECAY * self.weight + 1.0
        self.value += (sample - self.value) / self.weight

    @property
    def known(self) -> bool:
        return self.weight > 0


@dataclass
class SpeculationPolicy:
    max_k: int
    adaptive: bool = True
    target: CostLine = field(default_factory=CostLine)
    draft_step: dict[int, Average] = field(default_factory=dict)  # by bucket(batch): compute seconds per draft step
    draft_hop: dict[int, Average] = field(default_factory=dict)  # by bucket(batch): Propose seconds outside compute
    scheduling: Average = field(default_factory=Average)
    drafted: list[float] = field(default_factory=list)  # decayed count of rounds that drafted position i
    accepted: list[float] = field(default_factory=list)  # decayed count of rounds that accepted position i
    current: dict[int, int] = field(default_factory=dict)  # by bucket(batch): the k in use
    explored: dict[int, int] = field(default_factory=dict)  # by bucket(batch): rounds chosen below max_k

    def __post_init__(self) -> None:
        self.drafted = [0.0] * self.max_k
        self.accepted = [0.0] * self.max_k

    def choose(self, batch: int) -> int:
        """k for a round of `batch` decoding requests."""
        if not self.adaptive or self.max_k == 0 or batch == 0:
            return self.max_k
        size = bucket(batch)
        step = self.draft_step.get(size)
        if self.target.count < MIN_STEPS or step is None or not step.known or self.drafted[0] == 0:
            return self.current.get(size, self.max_k)
        hop = self.draft_hop[size].value
        rates = {k: self.throughput(batch, k, step.value, hop) for k in range(self.max_k + 1)}
        best = max(rates, key=lambda k: rates[k])
        current = self.current.get(size, self.max_k)
        if rates[best] > rates[current] * (1 + HYSTERESIS):
            self.current[size] = current = best
        if current == self.max_k:
            return current
        # Positions past k are not drafted, so their acceptance would never be measured again (nor would it be with
        # k = 0): a draft that got better, or a batch that got smaller, would never be asked for more.
        self.explored[size] = self.explored.get(size, 0) + 1
        return self.max_k if self.explored[size] % EXPLORE_EVERY == 0 else current

    def paused(self, batch: int) -> bool:
        """Whether measurements settled this batch size at k = 0 (never the configured k it starts from): drafting
        does not pay there, so its requests may as well decode without a replica (Scheduler._pause_speculation)."""
        return self.adaptive and self.max_k > 0 and batch > 0 and self.current.get(bucket(batch)) == 0

    def throughput(self, batch: int, k: int, draft_step_s: float, draft_hop_s: float = 0.0) -> float:
        """Tokens per second of a round of `batch` requests with k drafts each, by the current estimates."""
        tokens = batch * (1.0 + sum(self.acceptance(i) for i in range(k)))
        seconds = self.target.predict(batch * (k + 1)) + self.scheduling.value
        if k > 0:
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

    def observe_propose(self, batch: int, k: int, call_seconds: float, compute_seconds: float) -> None:
        """A replica's Propose for `batch` requests of k drafts: the call's seconds and the replica's compute."""
        if batch > 0 and k > 0:
            self.draft_step.setdefault(bucket(batch), Average()).add(compute_seconds / (k + 1))
            self.draft_hop.setdefault(bucket(batch), Average()).add(max(0.0, call_seconds - compute_seconds))

    def observe_round(self, drafts: int, accepted: int) -> None:
        """One request's round: drafts verified and how many of them were accepted."""
        for position in range(min(drafts, self.max_k)):
            self.drafted[position] = DECAY * self.drafted[position] + 1.0
            self.accepted[position] = DECAY * self.accepted[position] + (1.0 if position < accepted else 0.0)

    def observe_scheduling(self, seconds: float) -> None:
        self.scheduling.add(seconds)
