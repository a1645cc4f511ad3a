"""Hidden rows leave the target in messages of bounded size (target_server.service.hidden_messages), written in
batches of bounded size (hidden_batches), and the draft joins them back (draft_server.runner.TargetRows.followed_by)."""

from __future__ import annotations

import torch

from draft_server.runner import TargetRows
from tandem.wire.codec import tensor_from_proto
from target_server.items import CapturedRows
from target_server.service import hidden_batches, hidden_messages


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


def test_a_steps_messages_are_written_in_as_few_bounded_batches_as_keep_their_order() -> None:
    sizes = [3, 2, 2, 1, 4, 0]  # rows of 16 bytes each; the last a tokens-only message
    messages = [
        message
        for index, rows in enumerate(sizes)
        for message in hidden_messages(
            CapturedRows(f"r{index}", 0, list(range(rows)), torch.zeros(rows, 4 if rows else 0)), round_number=2
        )
    ]
    batches = hidden_batches(messages, chunk_bytes=64)  # 4 rows a batch
    assert [[message.request_id for message in batch.rows] for batch in batches] == [
        ["r0"],  # 48 bytes; r1 would make 80
        ["r1", "r2"],
        ["r3"],  # 16 bytes; r4's 64 would make 80
        ["r4", "r5"],  # a message without features fits anywhere
    ]
    assert [message.request_id for batch in batches for message in batch.rows] == [f"r{i}" for i in range(6)]
    assert len(hidden_batches(messages)) == 1  # the default bound, 4 MiB, holds them all
