"""What a target step is made of: the items the runner takes, their results, and the request state it keeps.

`StepItem` is one request's share of a step (the orchestrator's StepItem, the wire's StepItem); `StepResult` what
the step did with it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.layers.kv_cache import SequenceKV
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.grammar import GrammarState
from tandem.sampling.logprobs import TokenLogprob
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import process_rows

# Draft tokens one item may carry: far above any useful chain, low enough that a faulty draft cannot make one
# request's verification the size of a prefill.
MAX_DRAFT_TOKENS = 64


class RequestError(ValueError):
    """An item the runner cannot serve (unknown id, duplicate id, too long); the message says why."""


class ItemStatus(enum.Enum):
    OK = "ok"
    INVALID = "invalid"  # the item is wrong; nothing changed
    EXHAUSTED = "exhausted"  # the KV pool cannot hold the item now; nothing changed


@dataclass(frozen=True)
class RowStream:
    """What a request's draft gets of each committed position: the rows of these capture indices, or (tokens_only,
    a standalone draft model) the committed tokens with zero-width features. The default sends nothing: target-only."""

    capture: tuple[int, ...] = ()
    tokens_only: bool = False
    # The draft keeps its own prefix cache (SubscribeRequest.prefix_caching): positions the target takes from its
    # cache are not streamed, and the rows that start a request carry its tokens up to them (CapturedRows.prefix).
    prefix_caching: bool = False
    prefix_shift: int = 1  # the draft's state of row p depends on x[0 .. p + prefix_shift] (SubscribeRequest)
    image_embeddings: bool = False  # rows before an image's tokens carry their embeddings (SubscribeRequest)

    @property
    def streams(self) -> bool:
        return bool(self.capture) or self.tokens_only


TARGET_ONLY = RowStream()


@dataclass
class TargetRequest:
    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    stream: RowStream  # what goes to the request's draft
    kv: SequenceKV = field(default_factory=SequenceKV)
    prompt_length: int = 0  # tokens[prompt_length:] are the request's new tokens
    end_token_ids: frozenset[int] = frozenset()  # a multi-token decode stops after one of these
    grammar: GrammarState | None = None  # structured output: the matcher at the committed tokens
    cache_salt: str = ""  # requests share prefix-cache blocks only with requests of the same salt
    images: tuple[ImageInput, ...] = ()  # in prompt order, apart (OpenRequest.images)

    @property
    def marks(self) -> tuple[tuple[int, str], ...]:
        """Its images' (first token, digest): its KV blocks from each image's on are named by the image's content."""
        return tuple((image.start, image.digest) for image in self.images)

    def processed(self, logits: torch.Tensor, tree: DraftTree) -> torch.Tensor:  # [1 + len(tree), vocab] both
        """An item's scored rows as the request's options make them, each row with its own path (bias, penalties,
        min_tokens and the grammar's mask; tandem.sampling.processing)."""
        allowed = None if self.grammar is None else self.grammar.allowed(tree, logits.shape[0], logits.device)
        return process_rows(logits, tree, self.sampling, self.tokens, self.prompt_length, allowed)

    def commit(self, new_tokens: Sequence[int]) -> None:
        """Appends tokens the step decided (the grammar advances past them)."""
        self.tokens.extend(new_tokens)
        if self.grammar is not None:
            self.grammar.commit(new_tokens)


@dataclass(frozen=True)
class CapturedRows:
    """Aux features of committed positions [start_position, start_position + n) and their next tokens."""

    request_id: str
    start_position: int  # -1 for token-only rows from scratch (position -1 has no feature; its next token is x[0])
    next_tokens: list[int]  # n tokens
    features: torch.Tensor  # [n, len(capture) * hidden]; [n, 0] for a token-only draft
    # Rows that start the request over, to a draft with a prefix cache: tokens x[0 .. start_position]; () otherwise.
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True)
class ImageInput:
    """An image of a prompt as the target takes it: its tokens' embeddings (the image encoder's features, one row per
    placeholder token) from prompt token `start` on. In prefill the image's tokens see each other both ways
    (Gemma 3), so a chunk of the prompt never ends inside one (tandem's admission refuses it)."""

    start: int
    features: torch.Tensor  # [tokens, hidden], on the target's device
    digest: str  # the image's content hash: its KV blocks are named by it (a request's cache salt)

    @property
    def end(self) -> int:
        return self.start + self.features.shape[0]


@dataclass(frozen=True)
class ImageBytes:
    """An image of a prompt as the wire brings it: its encoded bytes, and the prompt token where its placeholder
    tokens start; the target's image encoder makes it an ImageInput when the request opens."""

    start: int
    data: bytes
    crop: int = 0  # 0: the image itself; k: its k-th pan-and-scan crop (PromptImage.crop)


@dataclass(frozen=True)
class OpenRequest:
    """What a request's first item carries: its prompt and how to sample."""

    prompt: Sequence[int]
    sampling: SamplingParams
    end_token_ids: frozenset[int] = frozenset()  # tokens that end the request (EOS, stop ids)
    generated: Sequence[int] = ()  # tokens it generated before: a request resumed on a restarted target
    cache_salt: str = ""  # mixed into the names of its KV blocks (tandem.layers.block_pool)
    images: tuple[ImageInput | ImageBytes, ...] = ()  # in prompt order, apart


@dataclass(frozen=True)
class StepItem:
    request_id: str
    num_tokens: int  # committed tokens to compute, from where the request's KV ends
    # Drafts to verify after the last committed token: only on an item that reaches it. A tree (not a chain) is
    # verified with a tree mask and tandem.sampling.tree_verify.
    drafts: DraftTree = field(default_factory=DraftTree)
    open: OpenRequest | None = None  # on the request's first item
    stream: RowStream | None = None  # a new stream (open, or a move to another draft); None: unchanged
    # Recompute the aux rows of every position the request's KV holds, for a draft that starts from scratch; the
    # request's own KV is not rewritten (a recomputed KV could differ in the last bits, and with it the outputs).
    replay: bool = False
    top_logprobs: int | None = None  # report each new token's logprob and this many best tokens; None: no logprobs
    # Without drafts, at the last committed token: decode up to this many tokens in this step, one forward pass
    # each, stopping after an end token or when the KV pool has no room for the next one.
    decode_steps: int = 1


@dataclass(frozen=True)
class StepResult:
    request_id: str
    status: ItemStatus
    message: str = ""  # why, when not OK
    accepted: int = 0  # draft tokens accepted
    new_tokens: list[int] = field(default_factory=list)  # accepted drafts + correction/bonus; [] for a prompt chunk
    captured: CapturedRows | None = None  # replayed rows, then the rows this item committed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token when the item asked
    cached_tokens: int = 0  # tokens of the item whose KV came from the prefix cache instead of being computed
