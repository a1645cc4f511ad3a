"""Structured output: a request's grammar as a mask over the rows the target verifies (llguidance).

A grammar travels as llguidance's grammar text (a JSON document: a JSON schema, a regex or a Lark grammar), made by the
orchestrator from the request (orchestrator/loop/structured.py). The target keeps one matcher per constrained request,
advanced by the committed tokens only. For a step's rows it computes each row's allowed tokens in the state its own
draft path reaches (DraftTree.paths: consume the path, read the mask, roll back), so a row allows exactly what it would
allow had its path been committed token by token: greedy constrained output is the same with and without speculation,
and the sampled rule verifies against the masked distribution.

Compiling a grammar takes milliseconds to seconds: `Grammars` compiles each text once per process and hands out
copies of the compiled matcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llguidance
import torch

from tandem.sampling.draft_tree import DraftTree

COMPILED = 64  # compiled grammars kept per process, the most recently used


class Grammars:
    """The matchers of one model's vocabulary: the tokenizer read from `tokenizer_dir` when the first grammar comes."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size  # the model's rows, which may exceed the tokenizer's
        self._tokenizer: Any = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def state(self, grammar: str) -> GrammarState:
        """A fresh matcher for the grammar; raises ValueError naming what is wrong with it."""
        with self._lock:
            compiled = self._compiled.pop(grammar, None)
            if compiled is None:
                compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
                if compiled.is_error():
                    raise ValueError(f"sampling.grammar: {compiled.get_error()}")
            self._compiled[grammar] = compiled
            if len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
            return GrammarState(compiled.deep_copy(), self.vocab_size)

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            # Here, with the tokenizer: llguidance.hf imports transformers, which a target needs for nothing else.
            import llguidance.hf
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            hf = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
            if not isinstance(hf, PreTrainedTokenizerFast):
                raise ValueError(
                    f"sampling.grammar: structured output needs a fast tokenizer, {type(hf).__name__} is not"
                )
            self._tokenizer = llguidance.hf.from_tokenizer(hf)
        return self._tokenizer


class GrammarState:
    """A request's matcher, at its committed tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the model's rows

    def allowed(self, tree: DraftTree, rows: int, device: torch.device) -> torch.Tensor:  # [rows, vocab] bool
        """Each scored row's allowed tokens in the state its path reaches. A row whose path the grammar forbids can
        never be reached by verification (its path's last token is masked in the row before): it gets its parent's
        mask, so that no row is empty."""
        masks: list[bytes | None] = []
        for path in tree.paths()[:rows]:
            if self.matcher.validate_tokens(list(path)) < len(path):  # no state change, no error state
                masks.append(None)
                continue
            self.matcher.consume_tokens(list(path))
            masks.append(self.matcher.compute_bitmask())
            self.matcher.rollback(len(path))
        parents = [-1, *tree.parents]
        for row in range(rows):
            if masks[row] is None:
                masks[row] = masks[parents[row] + 1]
        words = torch.frombuffer(bytearray(b"".join(mask or b"" for mask in masks)), dtype=torch.int32)
        return _unpacked(words.view(rows, -1), self.vocab_size).to(device)

    def shaped(self, tree: DraftTree, room: int) -> DraftTree:
        """The drafts worth verifying: none the grammar forbids (it would mask them, so verification could only
        reject them), and on a chain, after its allowed drafts, the tokens the grammar forces (llguidance's
        fast-forward tokens: keys, punctuation, enum tails), up to `room` tokens in all. A tree whose root the
        grammar forces on becomes the chain of forced tokens when that reaches deeper than the tree's allowed nodes.
        Forced tokens are deterministic drafts like any other: verification accepts them only where the target's
        masked choice is theirs, so the output is what it would be without them."""
        if not tree.is_chain:
            trimmed, forced = self._trimmed(tree), self._chain((), room)
            return forced if len(forced) > trimmed.depth else trimmed
        return self._chain(tree.tokens, room)

    def _chain(self, drafts: Sequence[int], room: int) -> DraftTree:
        """The chain's drafts up to the first the grammar forbids, then forced tokens, `room` in all."""
        chosen = list(drafts[: max(0, room)])
        chosen = chosen[: self.matcher.validate_tokens(chosen)]
        self.matcher.consume_tokens(chosen)
        try:
            while len(chosen) < room and not self.matcher.is_stopped():
                forced = self.matcher.compute_ff_tokens()[: room - len(chosen)]
                forced = forced[: self.matcher.validate_tokens(forced)]
                if not forced:
                    break
                self.matcher.consume_tokens(forced)
                chosen += forced
        finally:
            self.matcher.rollback(len(chosen))
        return DraftTree.chain(chosen)

    def _trimmed(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar forbids and their subtrees (the rest keep their order)."""
        index_of: dict[int, int] = {}  # old node -> new node
        tokens: list[int] = []
        parents: list[int] = []
        for node, path in enumerate(tree.paths()[1:]):
            parent = tree.parents[node]
            if parent >= 0 and parent not in index_of:
                continue
            if self.matcher.validate_tokens(list(path)) < len(path):
                continue
            index_of[node] = len(tokens)
            tokens.append(path[-1])
            parents.append(-1 if parent < 0 else index_of[parent])
        return DraftTree(tuple(tokens), tuple(parents))

    def commit(self, tokens: Sequence[int]) -> None:
        """Advances past committed tokens (each allowed by the mask it was chosen under)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(token):
                error = self.matcher.get_error()
                raise RuntimeError(f"grammar: token {token} was committed against its mask ({error})")


def _unpacked(words: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [rows, vocab_size] bool
    """llguidance's bitmask (int32 words, bit i of word w allows token 32 w + i) as booleans over the model's rows;
    ids past the tokenizer's vocabulary are never allowed."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, words, 32]
    allowed = bits.flatten(1).bool()[:, :vocab_size]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    return allowed
