"""Start-up check that a draft head fits the target it will serve; refuses with both values named."""

from __future__ import annotations

from tandem.errors import StartupError
from tandem.models.eagle3 import Eagle3Config
from tandem.wire import target_pb2


class IncompatibleDraft(StartupError):
    """The draft and the target disagree on a shape; the message names both values."""


def check_compatibility(draft: Eagle3Config, target: target_pb2.TargetInfo, has_embedding: bool) -> None:
    problems = []
    if draft.target_hidden_size != target.hidden_size:
        problems.append(
            f"hidden size: the draft expects target_hidden_size {draft.target_hidden_size}, "
            f"the target has hidden_size {target.hidden_size}"
        )
    if draft.vocab_size != target.vocab_size:
        problems.append(
            f"vocabulary: the draft has vocab_size {draft.vocab_size}, the target has vocab_size {target.vocab_size}"
        )
    if not has_embedding and draft.hidden_size != target.hidden_size:
        problems.append(
            f"embedding: the draft's hidden_size {draft.hidden_size} differs from the target's hidden_size "
            f"{target.hidden_size} and the draft checkpoint has no embed_tokens.weight to use instead"
        )
    if problems:
        raise IncompatibleDraft("draft does not fit the target: " + "; ".join(problems))
