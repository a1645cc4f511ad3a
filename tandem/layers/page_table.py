"""One step's planned attention metadata, in FlashInfer's paged-KV layout, and tree masks.

The KV pool of one layer is `[num_pages * page_size, num_kv_heads, dim]`, which viewed as
`[num_pages, page_size, num_kv_heads, dim]` is FlashInfer's "NHD" paged layout (a page is a KV-cache block). A step
packs the new tokens of `batch` sequences into `num_tokens` rows; sequence b owns query rows
`[qo_indptr[b], qo_indptr[b + 1])` and pages `kv_page_indices[kv_indptr[b] : kv_indptr[b + 1]]`, its last page
holding `kv_last_page_len[b]` (1..page_size) valid rows. Its new tokens are the last `query_len` rows of its KV
(`kv_len = (pages - 1) * page_size + last_page_len`); everything before them is context every new token sees.

Worked example (page_size 4), three sequences:
    A: pages [7, 2], KV of positions 0..4, adds 2 tokens (a chain);
    B: pages [5], nothing cached yet, adds 3 tokens (a prefill);
    C: pages [3, 6], KV of positions 0..3, adds a tree of 4 tokens with parents [-1, 0, 0, 1].
    qo_indptr        [0, 2, 5, 9]           rows 0..1 are A's, 2..4 B's, 5..8 C's
    kv_indptr        [0, 2, 3, 5]
    kv_page_indices  [7, 2, 5, 3, 6]
    kv_last_page_len [3, 3, 4]              A: kv_len 7 = 4 + 3; B: 3; C: 8 = 4 + 4
    positions        [5, 6, 0, 1, 2, 4, 5, 5, 6]    a tree token sits at the context length plus its depth
    write_slots      [9, 10, 20, 21, 22, 24, 25, 26, 27]   KV row r of a sequence: page r // 4, offset r % 4
    custom_masks     (None, None, C's [4, 4] mask)  None: causal
A bidirectional entry (a block drafter's block: every new token sees every other) is a chain's positions with an
all-ones mask, so both backends run it as they run a tree; a chain with spans (an image's tokens, which see each other
both ways) is the causal triangle with those blocks filled.
C's mask, row i over its new tokens j (i sees j when j is i or an ancestor of i):
    [[1, 0, 0, 0],
     [1, 1, 0, 0],
     [1, 0, 1, 0],
     [1, 1, 0, 1]]
A chain is the causal case: parents [-1, 0, 1, ...] give the lower triangle, which is why chains carry no mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import torch

from tandem.sampling.draft_tree import check_parents

HOST = torch.device("cpu")


@dataclass(frozen=True)
class PlanEntry:
    """One sequence of a step as the planner sees it, after its blocks were reserved."""

    block_ids: Sequence[int]  # the sequence's block table; covers at least start + num_new rows
    start: int  # KV rows [0, start) hold its context
    num_new: int  # new tokens, written at KV rows [start, start + num_new)
    parents: Sequence[int] | None = None  # per new token, the index of its parent among them, -1: the context
    bidirectional: bool = False  # the new tokens see each other both ways (a block drafter's block); no parents
    # Runs [begin, end) of the new tokens that see each other both ways in a chain (an image's tokens): causal plus
    # those blocks; no parents
    spans: Sequence[tuple[int, int]] = ()


@dataclass(frozen=True)
class PageTable:
    """Planned once per step (see the module docstring). Index tensors live on the host, in int32, as FlashInfer's
    planners take them; positions and write slots live on the cache's device, where every layer uses them."""

    page_size: int
    qo_indptr: torch.Tensor  # [batch + 1] int32
    kv_indptr: torch.Tensor  # [batch + 1] int32
    kv_page_indices: torch.Tensor  # [kv_indptr[-1]] int32
    kv_last_page_len: torch.Tensor  # [batch] int32
    positions: torch.Tensor  # [num_tokens] int64, rotary position of each new token
    write_slots: torch.Tensor  # [num_tokens] int64, pool row (page * page_size + offset) of each new token's KV
    custom_masks: tuple[torch.Tensor | None, ...]  # per sequence: None (causal) or [query_len, query_len] bool
    # Per sequence: its mask is a chain's with images' spans (causal once they are dropped); (): none has spans.
    spanned: tuple[bool, ...] = ()

    def without_spans(self) -> PageTable:
        """The same step with every image's tokens seeing only those before them (layers that attend causally over
        images: Gemma 4's full-attention layers, Kimi-K2.5); itself where no sequence has spans."""
        if not any(self.spanned):
            return self
        masks = tuple(None if spanned else mask for mask, spanned in zip(self.custom_masks, self.spanned, strict=True))
        return replace(self, custom_masks=masks, spanned=())

    @property
    def batch_size(self) -> int:
        return len(self.kv_last_page_len)

    def query_lens(self) -> list[int]:
        return (self.qo_indptr[1:] - self.qo_indptr[:-1]).tolist()

    def kv_lens(self) -> list[int]:
        num_pages = self.kv_indptr[1:] - self.kv_indptr[:-1]
        return ((num_pages - 1) * self.page_size + self.kv_last_page_len).tolist()

    def query_slices(self) -> list[slice]:
        """Each sequence's rows of the packed batch."""
        bounds = self.qo_indptr.tolist()
        return [slice(begin, end) for begin, end in pairwise(bounds)]

    def last_rows(self) -> torch.Tensor:  # -> [batch] int64 on the positions' device
        """The row of each sequence's last new token."""
        return (self.qo_indptr[1:] - 1).to(device=self.positions.device, dtype=torch.long)


def tree_mask(parents: Sequence[int]) -> torch.Tensor:  # -> [n, n] bool on the host
    """Row i sees column j when j is i or one of its ancestors (tandem.sampling.draft_tree's rules)."""
    check_parents(parents, len(parents))
    mask = torch.zeros((len(parents), len(parents)), dtype=torch.bool, device=HOST)
    for index, parent in enumerate(parents):
        if parent >= 0:
            mask[index] = mask[parent]
        mask[index, index] = True
    return mask


def chain_mask(
    num_new: int, bidirectional: bool, spans: Sequence[tuple[int, int]]
) -> torch.Tensor | None:  # -> [n, n] bool on the host; None: causal
    """A chain's mask: all ones when bidirectional, else the causal triangle with each span's block seen both ways
    (an image's tokens, Gemma 3: row i sees j when j <= i or both lie in one span), None when that is causal."""
    if bidirectional:
        return torch.ones((num_new, num_new), dtype=torch.bool, device=HOST)
    spans = [(begin, end) for begin, end in spans if end - begin > 1]
    if not spans:
        return None
    mask = torch.ones((num_new, num_new), dtype=torch.bool, device=HOST).tril()
    for begin, end in spans:
        if not 0 <= begin < end <= num_new:
            raise ValueError(f"a span [{begin}, {end}) outside the {num_new} new tokens")
        mask[begin:end, begin:end] = True
    return mask


def build_page_table(
    entries: Sequence[PlanEntry], page_size: int, device: torch.device
) -> PageTable:  # every entry's blocks reserved
    qo_indptr, kv_indptr = [0], [0]
    page_indices: list[int] = []
    last_page_lens: list[int] = []
    positions: list[int] = []
    write_slots: list[int] = []
    masks: list[torch.Tensor | None] = []
    spanned: list[bool] = []
    for entry in entries:
        end = entry.start + entry.num_new
        num_pages = -(-end // page_size)
        if end == 0:
            raise ValueError("a sequence with no KV rows and no new tokens has nothing to attend")
        if num_pages > len(entry.block_ids):
            raise ValueError(f"{end} KV rows need {num_pages} pages; the block table holds {len(entry.block_ids)}")
        pages = entry.block_ids[:num_pages]
        qo_indptr.append(qo_indptr[-1] + entry.num_new)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        page_indices += pages
        last_page_lens.append(end - (num_pages - 1) * page_size)
        write_slots += [pages[row // page_size] * page_size + row % page_size for row in range(entry.start, end)]
        if entry.parents is None:
            positions += range(entry.start, end)
            masks.append(chain_mask(entry.num_new, entry.bidirectional, entry.spans))
            spanned.append(masks[-1] is not None and not entry.bidirectional)
            continue
        check_parents(entry.parents, entry.num_new)
        mask = tree_mask(entry.parents)
        depths = mask.sum(dim=1) - 1  # ancestors of each token
        positions += (depths + entry.start).tolist()
        masks.append(mask)
        spanned.append(False)
    return PageTable(
        page_size=page_size,
        qo_indptr=torch.tensor(qo_indptr, dtype=torch.int32, device=HOST),
        kv_indptr=torch.tensor(kv_indptr, dtype=torch.int32, device=HOST),
        kv_page_indices=torch.tensor(page_indices, dtype=torch.int32, device=HOST),
        kv_last_page_len=torch.tensor(last_page_lens, dtype=torch.int32, device=HOST),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
        custom_masks=tuple(masks),
        spanned=tuple(spanned) if any(spanned) else (),
    )
