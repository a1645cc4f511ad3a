"""The demo corpus: the Python standard library of the running interpreter, split by package, and its tokenizer.

Every source file is assigned to exactly one split by its top-level package (or module) name:
- held out: the packages in HELD_OUT_PACKAGES; evaluation prompts come from here, and nothing of them is trained on,
  the tokenizer included.
- skipped: test folders (any path component in TEST_DIRECTORIES), generated tables and docs (SKIPPED_TOP_LEVEL),
  third-party code (site-packages) and build leftovers.
- train: everything else.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HELD_OUT_PACKAGES = ("email", "http", "json", "urllib", "xml")
TEST_DIRECTORIES = frozenset({"test", "tests", "idle_test"})
# encodings is ~100 generated charmap tables; pydoc_data is prose (the help topics), not code.
SKIPPED_TOP_LEVEL = frozenset({"site-packages", "encodings", "pydoc_data", "lib-dynload", "__pycache__"})

END_OF_TEXT = "<|endoftext|>"  # separates files; also the end-of-sequence token
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, PAD)  # ids 0 and 1


@dataclass(frozen=True)
class CorpusSplit:
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]
    root: Path

    def package_of(self, path: Path) -> str:
        return top_level_name(path.relative_to(self.root))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def top_level_name(relative: Path) -> str:
    """`json/decoder.py` -> `json`; `argparse.py` -> `argparse`."""
    first = relative.parts[0]
    return first[: -len(".py")] if len(relative.parts) == 1 and first.endswith(".py") else first


def is_skipped(relative: Path) -> bool:
    if any(part in TEST_DIRECTORIES for part in relative.parts[:-1]):
        return True
    top = relative.parts[0]
    return top in SKIPPED_TOP_LEVEL or top.startswith("config-")


def split_corpus(root: Path, held_out: Sequence[str] = HELD_OUT_PACKAGES) -> CorpusSplit:
    """All .py files under root, sorted, assigned to the train or held-out split (the rest skipped)."""
    train: list[Path] = []
    evaluation: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if is_skipped(relative):
            continue
        (evaluation if top_level_name(relative) in held_out else train).append(path)
    return CorpusSplit(tuple(train), tuple(evaluation), root)


def read_sources(paths: Sequence[Path]) -> Iterator[str]:
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    bos_token: str = END_OF_TEXT,
    eos_token: str = END_OF_TEXT,
    pad_token: str = PAD,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte has a token, so any text round-trips; merges learned from texts.

    The special tokens take the first ids, in order; the vocabulary holds at most vocab_size tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decode(encode(text)) == text, which streaming detokenization relies on.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        # Cleanup rewrites spaces around punctuation, which would break the round trip of code.
        clean_up_tokenization_spaces=False,
    )


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r} is not a single token")
    return found


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> torch.Tensor:  # -> [num_tokens]
    """One token stream: every document followed by END_OF_TEXT."""
    end = token_id(tokenizer, END_OF_TEXT)
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(end)
    return torch.tensor(stream, dtype=torch.long)


def pack_blocks(stream: torch.Tensor, block_length: int) -> torch.Tensor:  # [num_tokens] -> [num_blocks, length]
    """Cuts the stream into consecutive blocks (the ragged tail is dropped)."""
    num_blocks = stream.numel() // block_length
    return stream[: num_blocks * block_length].view(num_blocks, block_length)


def sample_prompts(
    stream: torch.Tensor,  # [num_tokens]
    count: int,
    length: int,
    seed: int,
    forbidden: int,  # a prompt never contains this token (END_OF_TEXT), so it lies inside one file
) -> torch.Tensor:  # -> [count, length]
    """`count` windows of `length` tokens at seeded random offsets that stay inside one document."""
    rng = random.Random(seed)
    boundaries = (stream == forbidden).cumsum(0)  # [num_tokens] document index of each position
    prompts: list[torch.Tensor] = []
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 100 * count:
            raise ValueError(f"could not find {count} windows of {length} tokens inside single documents")
        start = rng.randrange(0, stream.numel() - length - 1)
        if boundaries[start] == boundaries[start + length] and stream[start + length] != forbidden:
            prompts.append(stream[start : start + length])
    return torch.stack(prompts)
