"""Admission of a step's items on the target: the checks that make an item INVALID, the KV that makes it EXHAUSTED,
and the undo of what an admitted item reserved.

An item either passes every check and gets its KV blocks, or changes nothing: the rest of the step runs without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.models.image_encoder import ImageEncoder, ImageError
from tandem.sampling.grammar import Grammars, GrammarState
from tandem.sampling.logprobs import MAX_TOP_LOGPROBS
from tandem.sampling.verify import VerifyOutcome, make_generator
from target_server.items import (
    MAX_DRAFT_TOKENS,
    TARGET_ONLY,
    ImageBytes,
    ImageInput,
    RequestError,
    RowStream,
    StepItem,
    TargetRequest,
)

# Forced tokens a constrained request's chain may get beyond its drafts (tandem.sampling.grammar.GrammarState.shaped).
MAX_FORCED = 8


@dataclass
class AdmittedItem:
    """An item admitted to the forward pass: where its rows are and what it reserved."""

    item: StepItem
    request: TargetRequest
    start_length: int  # kv.length before the step
    opened: bool
    previous_stream: RowStream  # the request's before the item
    scratch: SequenceKV | None  # the replay's sequence
    rows: slice = field(default_factory=lambda: slice(0))  # the item's rows in the packed batch
    scratch_rows: slice = field(default_factory=lambda: slice(0))  # the replay's rows
    logit_start: int = 0  # the item's first row among the scored rows
    reused: int = 0  # positions the item took from the prefix cache: start_length counts them, num_tokens does not
    outcome: VerifyOutcome | None = None  # decided with the step's batch on the device (commit.verify_batched)

    @property
    def reaches_end(self) -> bool:
        """Whether the item computes the last committed token, so that its logits decide the next tokens."""
        return self.start_length + self.item.num_tokens == len(self.request.tokens)

    @property
    def has_work(self) -> bool:
        return self.item.num_tokens > 0 or self.scratch is not None


class Admission:
    def __init__(
        self,
        cache: PagedKVCache,
        requests: dict[str, TargetRequest],
        max_context: int,
        vocab_size: int,
        grammars: Grammars | None = None,  # None: structured output is refused
        hidden_size: int | None = None,  # the width image features must have; None: unchecked
        images: ImageEncoder | None = None,  # encodes the images requests bring as bytes; None: refused
        image_limit: int = 0,  # images one prompt may hold as bytes
    ) -> None:
        self.cache = cache
        self.requests = requests  # the runner's: an item that opens a request adds it
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.grammars = grammars
        self.hidden_size = hidden_size
        self.images = images
        self.image_limit = image_limit

    def admit(self, item: StepItem) -> AdmittedItem:
        """Checks an item and reserves its KV blocks; raises RequestError or OutOfKVBlocks (changing nothing) when it
        cannot run."""
        opened = item.open is not None
        request = self._opened(item) if opened else self._running(item.request_id)
        self._check_item(item, request)
        item = self._shaped(item, request, request.kv.length)
        _check_whole_images(request.kv.length + item.num_tokens, request)
        reused = self._reuse(item, request)
        item = replace(item, num_tokens=item.num_tokens - reused)
        start = request.kv.length
        drafts = len(item.drafts)
        replay = item.replay and item.stream is not None and bool(item.stream.capture) and start > 0
        scratch = SequenceKV() if replay else None
        needed = self.cache.blocks_needed(request.kv, start + item.num_tokens + drafts)
        needed += self.cache.blocks_needed(scratch, start) if scratch is not None else 0
        if needed > self.cache.num_free_blocks:
            self.cache.truncate(request.kv, start - reused)
            raise OutOfKVBlocks(
                f"KV cache: request {item.request_id!r} needs {needed} more blocks, {self.cache.num_free_blocks} free"
            )
        self.cache.reserve(request.kv, start + item.num_tokens + drafts)
        if scratch is not None:
            self.cache.reserve(scratch, start)
        if opened:
            self.requests[item.request_id] = request
        previous_stream = request.stream
        if item.stream is not None:
            request.stream = item.stream
        return AdmittedItem(item, request, start, opened, previous_stream, scratch, reused=reused)

    def undo(self, entry: AdmittedItem) -> None:
        """Returns what an item reserved: its KV back to the start length (an item that opened the request: all)."""
        if entry.scratch is not None:
            self.cache.release(entry.scratch)
        entry.request.stream = entry.previous_stream
        if entry.opened:
            self.requests.pop(entry.item.request_id, None)
            self.cache.release(entry.request.kv)
        else:
            self.cache.truncate(entry.request.kv, entry.start_length - entry.reused)

    def _reuse(self, item: StepItem, request: TargetRequest) -> int:
        """Extends the request's KV with the prefix cache's blocks of the item's chunk (tandem.layers.block_pool);
        returns the positions gained. The last committed token is always computed: its logits decide the next one.
        A request whose rows stream to a draft reuses only where its KV starts, and only when the draft keeps a
        prefix cache of its own: the draft needs every row after the first it is sent."""
        stream = item.stream if item.stream is not None else request.stream
        if item.replay or item.drafts.tokens:
            return 0
        if stream.streams and not (stream.prefix_caching and request.kv.length == 0):
            return 0
        end = min(request.kv.length + item.num_tokens, len(request.tokens) - 1)
        reused = self.cache.reuse(request.kv, request.tokens, request.cache_salt, end, request.marks)
        if stream.streams and reused and (stream.prefix_shift or reused == item.num_tokens):
            # The last block found is computed again, and its rows sent, which also names the prefix to the replica:
            # an EAGLE-style draft's KV of a block depends on the token after it too (row p pairs with x[p + 1]), so
            # a replica holds it only if an earlier request went on with the same token; and a chunk found whole
            # would send the replica no rows, and so no prefix, before the rows of the next chunk.
            reused -= self.cache.block_size
            self.cache.truncate(request.kv, reused)
        return reused

    def _shaped(self, item: StepItem, request: TargetRequest, start: int) -> StepItem:
        """A constrained request's item with its drafts as its grammar shapes them (GrammarState.shaped), an item
        without drafts included once it reaches the last committed token (k = 0, a paused batch, target-only): forced
        tokens fill at most the KV blocks the item's own drafts need, so the orchestrator's block count holds."""
        if request.grammar is None or start + item.num_tokens < len(request.tokens):
            return item
        end = start + item.num_tokens + len(item.drafts)
        block_room = -(-end // self.cache.block_size) * self.cache.block_size - end
        room = len(item.drafts) + min(block_room, MAX_FORCED)
        room = min(room, MAX_DRAFT_TOKENS, self.max_context - len(request.tokens))
        return replace(item, drafts=request.grammar.shaped(item.drafts, room))

    def _opened(self, item: StepItem) -> TargetRequest:
        """The state of a request the item opens (not yet kept: admit keeps it once its KV is reserved)."""
        assert item.open is not None
        if item.request_id in self.requests:
            raise RequestError(f"request_id: {item.request_id!r} is already running")
        prompt, generated = list(item.open.prompt), list(item.open.generated)
        if not prompt or len(prompt) + len(generated) >= self.max_context:
            resumed = f" and {len(generated)} generated" if generated else ""
            raise RequestError(f"prompt: {len(prompt)} tokens{resumed}, the context holds {self.max_context}")
        self._check_ids("prompt", prompt)
        self._check_ids("generated", generated)
        sampling = item.open.sampling
        self._check_ids("sampling.stop_token_ids", sampling.stop_token_ids)
        self._check_ids("sampling.logit_bias", [token for token, _ in sampling.logit_bias])
        grammar = self._grammar(sampling.grammar)
        if grammar is not None:
            try:
                grammar.commit(generated)
            except RuntimeError as error:
                raise RequestError(f"generated: {error}") from None
        images = self._encoded(item.open.images)
        _check_images(images, len(prompt), self.hidden_size)
        return TargetRequest(
            item.request_id,
            prompt + generated,
            sampling,
            make_generator(sampling),
            TARGET_ONLY,
            prompt_length=len(prompt),
            end_token_ids=item.open.end_token_ids,
            grammar=grammar,
            cache_salt=item.open.cache_salt,  # and each image's digest names its blocks (TargetRequest.marks)
            images=images,
        )

    def _encoded(self, images: Sequence[ImageInput | ImageBytes]) -> tuple[ImageInput, ...]:
        """A request's images with their features: those that came as bytes encoded (or found by digest)."""
        brought = sum(isinstance(image, ImageBytes) and image.crop == 0 for image in images)  # crops count apart
        if brought and self.images is None:
            raise RequestError(
                "images: this target serves no images (--limit-mm-per-prompt, or no tower for its checkpoint)"
            )
        if brought > self.image_limit:
            raise RequestError(f"images: {brought} in one prompt, at most {self.image_limit} (--limit-mm-per-prompt)")
        encoded = []
        for index, image in enumerate(images):
            if isinstance(image, ImageBytes):
                assert self.images is not None
                try:
                    digest, features = self.images.features(image.data, image.crop)
                except ImageError as error:
                    raise RequestError(f"images[{index}]: {error}") from None
                image = ImageInput(image.start, features, digest)
            encoded.append(image)
        return tuple(encoded)

    def _grammar(self, grammar: str) -> GrammarState | None:
        if not grammar:
            return None
        if self.grammars is None:
            raise RequestError("sampling.grammar: this target serves no structured output (no tokenizer)")
        try:
            return self.grammars.state(grammar)
        except ValueError as error:
            raise RequestError(str(error)) from None

    def _running(self, request_id: str) -> TargetRequest:
        found = self.requests.get(request_id)
        if found is None:
            raise RequestError(f"request_id: {request_id!r} is not running on the target")
        return found

    def _check_item(self, item: StepItem, request: TargetRequest) -> None:
        """Raises RequestError naming the field an item gets wrong for its request."""
        uncomputed = len(request.tokens) - request.kv.length
        if not 0 <= item.num_tokens <= uncomputed:
            raise RequestError(
                f"num_tokens: {item.num_tokens}, request {item.request_id!r} has {uncomputed} tokens without KV"
            )
        drafts = item.drafts.tokens
        if drafts and item.num_tokens != uncomputed:
            raise RequestError("draft_tokens: only an item that reaches the last committed token can verify drafts")
        fault = item.drafts.fault(MAX_DRAFT_TOKENS, self.vocab_size)
        if fault:
            raise RequestError(fault)
        top = item.top_logprobs
        if top is not None and not 0 <= top <= min(MAX_TOP_LOGPROBS, self.vocab_size):
            raise RequestError(f"top_logprobs: {top}, at most {MAX_TOP_LOGPROBS}")
        if len(request.tokens) + len(drafts) > self.max_context:
            raise RequestError(
                f"draft_tokens: request {item.request_id!r} would reach {len(request.tokens) + len(drafts)} "
                f"tokens, the context holds {self.max_context}"
            )

    def _check_ids(self, name: str, tokens: Sequence[int]) -> None:
        for index, token in enumerate(tokens):
            if not 0 <= token < self.vocab_size:
                raise RequestError(f"{name}[{index}]: {token} is outside the vocabulary [0, {self.vocab_size})")


def _check_images(images: Sequence[ImageInput], prompt_length: int, hidden_size: int | None) -> None:
    """Raises RequestError naming an image outside the prompt, out of order, or of features the model cannot take."""
    end = 0
    for index, image in enumerate(images):
        if image.start < end or image.end > prompt_length or image.features.dim() != 2:
            raise RequestError(
                f"images[{index}]: tokens {image.start}..{image.end - 1} are not inside the {prompt_length}-token "
                f"prompt after the image before it (or its features are not [tokens, hidden])"
            )
        if hidden_size is not None and image.features.shape[1] != hidden_size:
            raise RequestError(f"images[{index}]: features {image.features.shape[1]} wide, the model's {hidden_size}")
        end = image.end


def _check_whole_images(end: int, request: TargetRequest) -> None:
    """Raises RequestError when an item's chunk of the prompt ends (at token `end`) inside an image: its tokens see
    each other both ways, so an image is computed in one chunk."""
    for image in request.images:
        if image.start < end < image.end:
            raise RequestError(
                f"num_tokens: the chunk ends at prompt token {end}, inside the image of tokens {image.start}.."
                f"{image.end - 1}, which is computed whole"
            )
