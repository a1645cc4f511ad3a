"""Which replica holds which prefix, as far as the orchestrator sent it there: placement follows the prefix.

A replica keeps the draft context of the requests it drafted for in its own prefix cache (draft_server.prefixes),
so a request that starts with a prefix a replica drafted before is best sent there: elsewhere the replica lacks the
draft context of what the target takes from its cache, and the request is replayed (its every row recomputed). The
orchestrator remembers, per replica, the names of the full blocks of the requests it placed there (the target's
block size and names, tandem.layers.block_pool), up to MAX_NAMES per replica, the least recently used forgotten
first. It is a guess: a replica evicts on its own, restarts empty, and a miss costs a replay, never a wrong token.

The rule: a request goes to the serving replica holding the most of its leading blocks, unless that replica has more
than IMBALANCE more requests outstanding than the least loaded one; otherwise, and with no match, to the least
loaded (ReplicaPool.pick).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.layers.block_pool import Marks, block_hashes

MAX_NAMES = 65536  # per replica: 1M tokens of 16-token blocks, about 3 MB of names
IMBALANCE = 4  # outstanding requests a replica holding the prefix may carry beyond the least loaded one


class PrefixRoutes:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._names: dict[str, OrderedDict[bytes, None]] = {}

    def names(self, tokens: Sequence[int], salt: str, marks: Marks = ()) -> list[bytes]:
        return block_hashes(tokens, self.block_size, salt, marks=marks)

    def matched(self, replica_id: str, names: Sequence[bytes]) -> int:
        """How many of the leading blocks `names` the replica was sent (as far as this orchestrator knows)."""
        held = self._names.get(replica_id)
        count = 0
        while held is not None and count < len(names) and names[count] in held:
            count += 1
        return count

    def record(self, replica_id: str, names: Sequence[bytes]) -> None:
        """Notes that the replica drafted for a request with these blocks (their draft context is cached there)."""
        held = self._names.setdefault(replica_id, OrderedDict())
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > MAX_NAMES:
            held.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """A replica that left, or failed: whatever it held is not assumed when it comes back."""
        self._names.pop(replica_id, None)
