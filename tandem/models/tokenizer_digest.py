"""A fingerprint of a model directory's vocabulary: which string each token id stands for.

A standalone draft model proposes token ids that the target verifies as its own, so both must mean the same strings
by the same ids. The target publishes the digest of its tokenizer.json's token -> id map (TargetInfo.tokenizer_digest)
and a standalone draft compares its own at start-up. Merges and normalizers are left out: they change how text is
split, not what an id means.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_digest(model_dir: Path) -> str:
    """sha256 (hex) of the token -> id map of model_dir/tokenizer.json, added tokens included; "" without one."""
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        return ""
    vocabulary = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)  # token -> id
    ordered = sorted(vocabulary.items(), key=lambda entry: (entry[1], entry[0]))
    return hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode()).hexdigest()
