"""A step's image tokens: where a prompt's images (target_server.items.ImageInput) fall among the step's rows.

For every sequence of the step (in the order the step plans them) `add` takes the prompt tokens it computes and
finds the images among them: their runs of new tokens, which see each other both ways (the page table's spans,
tandem.layers.page_table.chain_mask), and the rows of the packed step that take the images' features as their
embeddings (tandem.models.stack.CausalLM). Example: a sequence computing prompt tokens 10..19 from step row 32, with
an image at tokens 12..15: span (2, 6), rows 34..37 embedded as the image's features 0..3.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.models.stack import Embeddings
from tandem.wire import target_pb2
from tandem.wire.codec import tensor_to_proto
from target_server.items import ImageInput


class StepImages:
    def __init__(self) -> None:
        self.spans: list[list[tuple[int, int]]] = []  # per sequence: runs [begin, end) of its new tokens
        self._rows: list[torch.Tensor] = []
        self._features: list[torch.Tensor] = []

    def add(self, images: Sequence[ImageInput], begin: int, end: int, first_row: int) -> None:
        """The next sequence: it computes prompt tokens [begin, end) at step rows first_row on."""
        runs = []
        for image in images:
            low, high = max(image.start, begin), min(image.end, end)
            if low >= high:
                continue
            runs.append((low - begin, high - begin))
            self._rows.append(torch.arange(first_row + low - begin, first_row + high - begin))
            self._features.append(image.features[low - image.start : high - image.start])
        self.spans.append(runs)

    def embeddings(self, device: torch.device) -> Embeddings | None:
        """The step's image rows and their features; None: the step holds no image token."""
        if not self._rows:
            return None
        return torch.cat(self._rows).to(device), torch.cat(self._features).to(device)


def add_image_embeddings(message: target_pb2.HiddenStates, images: Sequence[ImageInput]) -> None:
    """Adds to a replica's rows the target's embedding of each next token that is an image's placeholder (the
    image's feature): row i pairs with the token at position start_position + i + 1. Example: rows from position 10,
    5 of them, an image at tokens 12..15: rows 1..4 carry the image's features 0..3."""
    first, count = message.start_position + 1, len(message.next_tokens)
    rows: list[int] = []
    values = []
    for image in images:
        low, high = max(image.start, first), min(image.end, first + count)
        if low < high:
            rows += range(low - first, high - first)
            values.append(image.features[low - image.start : high - image.start])
    if rows:
        message.image_rows.extend(rows)
        message.image_embeddings.CopyFrom(tensor_to_proto(torch.cat(values)))
