"""The KV pool's blocks and the prefix cache over them: which blocks are free, which are shared, which keep a prefix.

A full block of committed tokens is named by a hash chain over the tokens before and in it:

    h_0 = sha256(salt)                                   the request's cache_salt ("" by default)
    h_j = sha256(h_{j-1} || tokens of block j || marks)  tokens int32 little-endian, block_size of them; marks: the
                                                          keys of the request's marks inside block j, UTF-8

so two sequences share block j's name only if they agree on every token through block j, on the salt (tenants
with different salts share nothing) and on the marks through block j. A mark is (position, key): an image's first
token and its content digest, so that blocks holding different images' tokens (the same placeholder ids) never share
a name, while the blocks before the first image are shared by prompts of any images.

A block is named (`publish`) once its KV is final: every position in it holds a committed token's KV. A named block
is shared by reference count; when its last holder lets it go it keeps its KV on the cached list, least recently
freed first, and is still free: `take` hands out never-named blocks first, then evicts the cached block freed
longest ago. So a cached block never makes a request wait.

A holder gives its blocks back tail first (PagedKVCache.truncate), so a sequence's last blocks are evicted before its
first ones, which more requests share. A sequence that grows takes the block after its last one when that one is
free (never a cached one, which may hold another request's prefix), and the blocks of one reservation come in
increasing order (PagedKVCache.reserve): on the CPU a sequence whose blocks follow each other is read as a view of
the pool, not gathered at every layer (tandem.layers.torch_attention).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

Marks = Sequence[tuple[int, str]]  # (position, key): an image's first token and its content digest


def block_hashes(
    tokens: Sequence[int], block_size: int, salt: str, known: Sequence[bytes] = (), marks: Marks = ()
) -> list[bytes]:
    """The names of every full block of `tokens`, extending `known` (the names of the first len(known) blocks)."""
    keys: dict[int, bytes] = {}
    for position, key in marks:
        keys[position // block_size] = keys.get(position // block_size, b"") + key.encode()
    hashes = list(known)
    parent = hashes[-1] if hashes else hashlib.sha256(salt.encode()).digest()
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        block = array("i", tokens[start : start + block_size])  # 4-byte ints wherever torch runs
        parent = hashlib.sha256(parent + block.tobytes() + keys.get(start // block_size, b"")).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """Block ids [0, num_blocks): free, held (reference count > 0) or cached (free, with a named KV kept)."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.caching = caching
        # Never named, or evicted; the last one is taken first (0, 1, 2, ... in a fresh pool).
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # named and unreferenced, least recently freed first
        self._refs = [0] * num_blocks
        self._named: dict[bytes, int] = {}
        self._name_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a named prefix."""
        return len(self._cached)

    def take(self, after: int | None = None) -> int:
        """A block for new KV: block `after + 1` if it is free, else a never-named one, else the cached one freed
        longest ago (a cached block taken loses its name)."""
        wanted = after + 1 if after is not None else None
        if wanted is not None and wanted in self._free:
            del self._free[wanted]
            block = wanted
        elif self._free:
            block, _ = self._free.popitem()
        elif self._cached:
            block = self._unnamed(self._cached.popitem(last=False)[0])
        else:
            raise IndexError("no free KV block")
        self._refs[block] = 1
        return block

    def _unnamed(self, block: int) -> int:
        del self._named[self._name_of.pop(block)]
        return block

    def give_back(self, block: int) -> None:
        """Drops one reference; an unreferenced named block stays cached, any other is free."""
        if self._refs[block] <= 0:
            raise ValueError(f"KV block {block} is not held")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._name_of:
                self._cached[block] = None
            else:
                self._free[block] = None

    def find(self, name: bytes) -> int | None:
        """The block that holds the named KV, or None."""
        return self._named.get(name) if self.caching else None

    def share(self, block: int) -> None:
        """Takes one more reference to a named block (a cached one leaves the cached list)."""
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def publish(self, block: int, name: bytes) -> None:
        """Names a held block whose KV is final. A name already held by another block keeps that block: this one
        stays unnamed and is freed as usual."""
        if not self.caching or name in self._named or block in self._name_of:
            return
        self._named[name] = block
        self._name_of[block] = name
