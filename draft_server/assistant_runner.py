"""The draft's runner for Gemma 4's assistant (tandem.models.gemma4_assistant): it keeps the target's own keys and
values and drafts a round's tokens at one position.

A row from the target (position p) carries the target's final hidden state at p, then the keys and values of each
layer the assistant reads (SubscribeRequest capture indices num_layers + 1, then num_layers + 2 + layer, in the
order of `kept`). A request's KV here holds those keys and values for its verified positions [0, P], one pool layer
per kept target layer; nothing of the assistant's own is ever written. Each round its rows from s on are written
(a replay or a recompute starts at s = 0) and the drafts are made at position P + 1, the first token the target
has not run: step 1 takes that token x[P + 1] and the target's hidden of row P, step j the draft of step j - 1 and
the hidden step j - 1 handed on. A sliding layer reads the last sliding_window + 1 rows, a full layer every row.

Example: a prompt of 5 tokens whose first generated token is c: rows 0..4 (tokens x1..x4, c); every step sits at
position 5, reads rows 0..4 and starts from (c, hidden of row 4). The target accepts one draft d1 and corrects the
next to e: the rows of 5..6 (tokens d1, e) arrive, and the next round sits at 7.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_server.compat import IncompatibleDraft
from draft_server.prefixes import DraftNames, DraftPrefixes
from draft_server.proposals import PreparedDraft
from draft_server.runner import DraftRequestError, ProposeInput, check_batch_fits, check_continues, release_requests
from draft_server.settings import DraftSettings
from draft_server.shaping import shape_logits
from tandem.layers.kv_cache import CacheLayout, PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.models.aux_layers import CaptureSpec
from tandem.models.gemma4_assistant import (
    ARCHITECTURE,
    AssistantConfig,
    Gemma4Assistant,
    Rows,
    capture_indices,
    load_assistant,
)
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2

LOG = logging.getLogger(__name__)
GEMMA4_TARGETS = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")


@dataclass
class AssistantRequest:
    kv: SequenceKV = field(default_factory=SequenceKV)  # the target's K/V rows of positions [0, kv.length)
    names: DraftNames | None = None  # what names its blocks (draft_server.prefixes)


class AssistantRunner:
    def __init__(self, model: Gemma4Assistant, kept: Sequence[target_pb2.KeptKV], cache: KVCacheSettings) -> None:
        parameter = next(model.parameters())
        self.model = model
        self.kept = tuple(kept)
        self.widths = [kept_layer.num_kv_heads * kept_layer.head_dim for kept_layer in self.kept]
        prepack(model)
        width = max(self.widths)
        layout = CacheLayout(num_kv_heads=1, key_dim=width, value_dim=width)
        self.cache = PagedKVCache.for_layout(len(self.kept), layout, cache, parameter.dtype, parameter.device)
        self.requests: dict[str, AssistantRequest] = {}
        # A row's K/V depends on the tokens up to its own position: the target's block names hold (no shift).
        self.prefixes = DraftPrefixes(self.cache, self._request_for, shift=0) if cache.prefix_caching else None

    def _request_for(self, request_id: str) -> AssistantRequest:
        return self.requests.setdefault(request_id, AssistantRequest())

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Writes each request's rows, then drafts its num_steps tokens; every step is one batch over the requests."""
        for item in inputs:  # every item is checked before any state changes
            self._check(item)
        check_batch_fits(self.cache, [self._plan(item) for item in inputs])
        requests = [self._request_for(item.request_id) for item in inputs]
        last_rows = []  # each request's target hidden state of its last row, which the first step takes
        for request, item in zip(requests, inputs, strict=True):
            last_rows.append(self._write(request, item))
            if self.prefixes is not None:
                self.prefixes.ingested(request, item.rows)
        device = self.cache.device
        rows = [self._held(request) for request in requests]
        positions = torch.tensor([request.kv.length for request in requests], device=device)
        tokens = torch.tensor([item.rows.next_tokens[-1] for item in inputs], device=device)
        hidden = torch.stack(last_rows)
        proposals: list[list[int]] = [[] for _ in inputs]
        shapings = [item.shaping for item in inputs]
        for step in range(max(item.num_steps for item in inputs)):
            logits, hidden = self.model(tokens, hidden, positions, rows)
            tokens = shape_logits(logits, shapings, proposals).argmax(dim=-1)
            for index, token in enumerate(tokens.tolist()):
                if inputs[index].num_steps > step:
                    proposals[index].append(int(token))
        return proposals

    def _write(self, request: AssistantRequest, item: ProposeInput) -> torch.Tensor:  # -> [backbone]
        """The item's rows written from their start on; returns its last row's hidden state."""
        start, count = item.rows.start_position, len(item.rows.next_tokens)
        self.cache.truncate(request.kv, start)
        self.cache.reserve(request.kv, start + count)
        slots = self.cache.slots(request.kv, start, start + count).to(self.cache.device)
        features = item.rows.features.to(device=self.cache.device, dtype=self.cache.keys.dtype)
        backbone = self.model.config.backbone_hidden_size
        column = backbone
        for layer, width in enumerate(self.widths):
            self.cache.keys[layer, slots, 0, :width] = features[:, column : column + width]
            self.cache.values[layer, slots, 0, :width] = features[:, column + width : column + 2 * width]
            column += 2 * width
        request.kv.length = start + count
        return features[-1, :backbone]

    def _held(self, request: AssistantRequest) -> dict[bool, Rows]:
        """The request's rows of each layer type, [rows, num_kv_heads, head_dim] keys and values (a sliding layer
        reads the last of them, tandem.models.gemma4_assistant)."""
        length = request.kv.length
        slots = self.cache.slots(request.kv, 0, length).to(self.cache.device)
        rows = {}
        for layer, kept in enumerate(self.kept):
            width, shape = self.widths[layer], (length, kept.num_kv_heads, kept.head_dim)
            keys = self.cache.keys[layer, slots, 0, :width].view(shape)
            rows[kept.sliding] = (keys, self.cache.values[layer, slots, 0, :width].view(shape))
        return rows

    def _check(self, item: ProposeInput) -> None:
        """Raises DraftRequestError unless the item's rows carry tokens and continue its request's rows."""
        check_continues(self.requests, item)
        width = self.model.config.backbone_hidden_size + 2 * sum(self.widths)
        if item.rows.features.shape[-1] != width:
            raise DraftRequestError(
                f"request {item.request_id!r}: rows of {item.rows.features.shape[-1]} values, the assistant reads "
                f"{width} (the hidden state, then each kept layer's keys and values)"
            )

    def _plan(self, item: ProposeInput) -> tuple[SequenceKV | None, int, int]:
        request = self.requests.get(item.request_id)
        end = item.rows.start_position + len(item.rows.next_tokens)
        return (request.kv if request is not None else None, item.rows.start_position, end)

    def release(self, request_ids: Sequence[str]) -> None:
        release_requests(self.cache, self.requests, request_ids)


def check_assistant(config: AssistantConfig, info: target_pb2.TargetInfo) -> list[target_pb2.KeptKV]:
    """The target layers the assistant reads, one per layer type it has, in the target's order; refuses an assistant
    that does not fit the target, naming both values."""
    if info.architecture not in GEMMA4_TARGETS:
        raise IncompatibleDraft(
            f"architecture: a Gemma 4 assistant drafts for Gemma 4 targets ({', '.join(GEMMA4_TARGETS)}); "
            f"the target is {info.architecture}"
        )
    text = config.text
    problems = [
        f"{what}: the assistant has {ours}, the target has {theirs}"
        for what, ours, theirs in (
            ("backbone_hidden_size", config.backbone_hidden_size, info.hidden_size),
            ("vocab_size", text.vocab_size, info.vocab_size),
        )
        if ours != theirs
    ]
    kept = {layer.sliding: layer for layer in info.kept_kv}
    for index, spec in enumerate(text.layers):
        kind = "sliding" if spec.sliding else "full"
        theirs = kept.get(spec.sliding)
        if theirs is None:
            problems.append(f"layer_types: assistant layer {index} is a {kind} layer, the target keeps no {kind} K/V")
        elif (spec.num_kv_heads, spec.head_dim) != (theirs.num_kv_heads, theirs.head_dim):
            problems.append(
                f"{kind} layers' K/V heads: the assistant has {spec.num_kv_heads} of {spec.head_dim}, the target's "
                f"layer {theirs.layer} has {theirs.num_kv_heads} of {theirs.head_dim}"
            )
    if problems:
        raise IncompatibleDraft("Gemma 4 assistant does not fit the target: " + "; ".join(dict.fromkeys(problems)))
    read = {spec.sliding for spec in text.layers}
    return sorted((layer for sliding, layer in kept.items() if sliding in read), key=lambda layer: layer.layer)


def prepare_assistant(settings: DraftSettings, info: target_pb2.TargetInfo) -> PreparedDraft:
    model = load_assistant(settings.model_dir, dtype=getattr(torch, settings.dtype), device=settings.device)
    kept = check_assistant(model.config, info)
    indices = capture_indices(info.num_layers, (layer.layer for layer in kept))
    LOG.info(
        "Gemma 4 assistant: %d layers, hidden %d; reads the target's final hidden state and the K/V of layers %s; "
        "%s head",
        len(model.config.text.layers),
        model.config.text.hidden_size,
        [layer.layer for layer in kept],
        "a centroid" if model.config.centroids is not None else "an LM",
    )

    def fill(name: str, table: torch.Tensor) -> None:
        model.target_embed.weight.data.copy_(table)

    return PreparedDraft(
        architecture=ARCHITECTURE,
        kind="gemma4-assistant",
        capture=CaptureSpec(indices, "assistant", None),
        missing_tables=("embed_tokens",),
        fill_table=fill,
        build_runner=lambda cache: AssistantRunner(model, kept, cache),
    )
