"""Hidden rows leave the target in messages of bounded size (target_server.service.hidden_messages), and the draft
joins them back (draft_server.runner.TargetRows.followed_by)."""

from __future__ import annotations

import torch

from draft_server.runner import TargetRows
from tandem.wire.codec import tensor_from_proto
from target_server.runner import CapturedRows
from target_server.service import hidden_messages


def test_rows_are_split_in_bounded_messages_that_join_back() -> None:
    features = torch.arange(40, dtype=torch.float32).view(10, 4)  # 16 bytes a row
    rows = CapturedRows("r", 7, list(range(100, 110)), features)
    messages = hidden_messages(rows, round_number=3, chunk_bytes=48)  # 3 rows a message
    assert [len(m.next_tokens) for m in messages] == [3, 3, 3, 1]
    assert [m.start_position for m in messages] == [7, 10, 13, 16]
    assert {m.round for m in messages} == {3} and {m.request_id for m in messages} == {"r"}
    parts = [TargetRows(m.start_position, list(m.next_tokens), tensor_from_proto(m.features)) for m in messages]
    joined = parts[0]
    for part in parts[1:]:
        joined = joined.followed_by(part)
    assert joined.start_position == 7
    assert list(joined.next_tokens) == list(range(100, 110))
    assert torch.equal(joined.features, features)


def test_small_rows_and_token_only_rows_go_in_one_message() -> None:
    one = hidden_messages(CapturedRows("r", 0, [5, 6], torch.zeros(2, 8)), round_number=1)
    assert len(one) == 1 and list(one[0].next_tokens) == [5, 6]
    tokens_only = hidden_messages(CapturedRows("r", -1, [1, 2, 3], torch.zeros(3, 0)), round_number=1, chunk_bytes=1)
    assert len(tokens_only) == 1 and list(tokens_only[0].next_tokens) == [1, 2, 3]
