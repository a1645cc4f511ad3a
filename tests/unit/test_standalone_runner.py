"""Standalone draft models: the target's token-only rows, the StandaloneRunner (ingest, greedy chains, rollback of
rejected drafts, replay from scratch, batching) and the start-up check of the draft's vocabulary.

The runner's proposals are checked against greedy decoding of the draft model recomputed from scratch (a fresh cache
per token), so that its KV bookkeeping cannot hide behind itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from draft_server.compat import IncompatibleDraft
from draft_server.formats import prepare_draft
from draft_server.runner import DraftRequestError, ProposeInput, TargetRows
from draft_server.settings import DraftSettings
from draft_server.standalone_runner import StandaloneRunner
from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.models.registry import TargetModel, load_target
from tandem.models.tokenizer_digest import tokenizer_digest
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from target_server.items import TARGET_ONLY, CapturedRows, OpenRequest, RowStream, StepItem
from target_server.runner import TargetRunner
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.tokenizer import write_tokenizer

GREEDY = SamplingParams()
TOKENS_ONLY = RowStream(tokens_only=True)
BLOCK_SIZE = 4
CACHE = KVCacheSettings(num_blocks=64, block_size=BLOCK_SIZE)
PROMPT = [1, 40, 41, 42, 43, 44, 45]
K = 4
# A smaller Llama with the target's vocabulary (320, TinyTargetSpec's default).
DRAFT_SPEC = TinyTargetSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


@pytest.fixture(scope="module")
def target(target_dir: Path) -> TargetModel:
    return load_target(target_dir)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    return load_target(write_tiny_target(tmp_path_factory.mktemp("draft"), DRAFT_SPEC))


def greedy_from_scratch(model: TargetModel, tokens: Sequence[int], num_new: int) -> list[int]:
    """The next num_new greedy tokens after `tokens`, each from one forward of the whole sequence on a fresh cache."""
    sequence = list(tokens)
    config = model.config
    for _ in range(num_new):
        cache = PagedKVCache.for_layout(
            config.num_layers, model.cache_layout, KVCacheSettings(num_blocks=16, block_size=8), torch.float32, "cpu"
        )
        metadata = cache.plan([(SequenceKV(), len(sequence))])
        with torch.no_grad():
            output = model(torch.tensor(sequence), metadata, cache)
            sequence.append(int(model.compute_logits(output.normed[-1:]).argmax()))
    return sequence[len(tokens) :]


def rows(start_position: int, tokens: Sequence[int]) -> TargetRows:
    return TargetRows(start_position, list(tokens), torch.empty((len(tokens), 0)))


def from_scratch(tokens: Sequence[int]) -> TargetRows:
    """Rows of a request's committed tokens from position -1, as the target streams them to a token-only draft."""
    return rows(-1, tokens)


def delivered(captured: CapturedRows | None) -> TargetRows:
    assert captured is not None
    return TargetRows(captured.start_position, captured.next_tokens, captured.features)


def open_tokens_only(runner: TargetRunner, request_id: str = "a") -> CapturedRows | None:
    item = StepItem(request_id, len(PROMPT), open=OpenRequest(PROMPT, GREEDY), stream=TOKENS_ONLY)
    (result,) = runner.step([item])
    return result.captured


# The target's token-only rows.


def test_target_streams_committed_tokens_from_position_minus_one(target: TargetModel) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    captured = open_tokens_only(runner)
    tokens = list(runner.requests["a"].tokens)
    assert captured is not None
    assert (captured.start_position, captured.next_tokens) == (-1, tokens)  # x[0] .. the first new token
    assert captured.features.shape == (len(tokens), 0)

    # A verification streams its committed positions only: rows n.. with the tokens after them.
    (verified,) = runner.step([StepItem("a", 1, DraftTree.chain([7, 8]))])
    assert verified.captured is not None
    assert verified.captured.start_position == len(tokens) - 1
    assert verified.captured.next_tokens == verified.new_tokens

    # A replay (a move to this draft) and a recompute after preemption start from scratch again.
    committed = list(runner.requests["a"].tokens)
    (replayed,) = runner.step([StepItem("a", 1, stream=TOKENS_ONLY, replay=True)])
    assert replayed.captured is not None
    assert (replayed.captured.start_position, replayed.captured.next_tokens) == (-1, runner.requests["a"].tokens)
    runner.step([], preempt=["a"])
    (recomputed,) = runner.step([StepItem("a", len(runner.requests["a"].tokens) - 1)])
    assert recomputed.captured is not None
    assert recomputed.captured.start_position == -1
    assert recomputed.captured.next_tokens[: len(committed)] == committed


def test_target_only_requests_stream_nothing(target: TargetModel) -> None:
    runner = TargetRunner(target, CACHE, max_context=64)
    (result,) = runner.step([StepItem("a", len(PROMPT), open=OpenRequest(PROMPT, GREEDY), stream=TARGET_ONLY)])
    assert result.captured is None


# The StandaloneRunner.


def test_ingest_then_propose_is_the_draft_models_greedy_chain(draft: TargetModel) -> None:
    runner = StandaloneRunner(draft, CACHE)
    committed = [*PROMPT, 50]
    (proposal,) = runner.propose([ProposeInput("a", from_scratch(committed), K)])
    assert proposal == greedy_from_scratch(draft, committed, K)
    # KV for the committed tokens and the drafts fed back (d_1 .. d_{k-1}); d_k is never fed.
    request = runner.requests["a"]
    assert request.kv.length == len(committed) + K - 1
    assert request.tokens == [*committed, *proposal[:-1]]
    assert len(request.kv.block_ids) == -(-request.kv.length // BLOCK_SIZE)


@pytest.mark.parametrize("accepted", [0, 1, K])
def test_rejected_drafts_are_rolled_back_on_the_next_ingest(draft: TargetModel, accepted: int) -> None:
    runner = StandaloneRunner(draft, CACHE)
    committed = [*PROMPT, 50]
    (proposal,) = runner.propose([ProposeInput("a", from_scratch(committed), K)])
    # The target accepts `accepted` drafts and adds a correction (a token other than the next draft) or a bonus.
    correction = (proposal[accepted] + 1) % 320 if accepted < K else 9
    new_tokens = [*proposal[:accepted], correction]
    (following,) = runner.propose([ProposeInput("a", rows(len(committed) - 1, new_tokens), K)])
    assert following == greedy_from_scratch(draft, [*committed, *new_tokens], K)
    assert runner.requests["a"].kv.length == len(committed) + len(new_tokens) + K - 1


def test_replay_from_scratch_and_rows_with_a_gap(draft: TargetModel) -> None:
    runner = StandaloneRunner(draft, CACHE)
    committed = [*PROMPT, 50]
    (first,) = runner.propose([ProposeInput("a", from_scratch(committed), K)])
    # A replay resends every token from position 0; the runner ends where a fresh request would.
    (replayed,) = runner.propose([ProposeInput("a", from_scratch(committed), K)])
    assert replayed == first
    # Past the committed tokens (8) lie drafts the target has not confirmed: rows may not skip over them.
    with pytest.raises(
        DraftRequestError, match=r"from position 9 but the draft holds committed tokens up to position 8"
    ):
        runner.propose([ProposeInput("a", rows(8, [5]), K)])
    with pytest.raises(DraftRequestError, match="request 'b'"):
        runner.propose([ProposeInput("b", rows(3, [5]), K)])  # a request the runner never saw must start at -1


def test_batched_requests_draft_as_they_would_alone(draft: TargetModel) -> None:
    runner = StandaloneRunner(draft, CACHE)
    long, short = [*PROMPT, 50, 51, 52], [1, 60, 61]
    proposals = runner.propose([ProposeInput("a", from_scratch(long), 3), ProposeInput("b", from_scratch(short), 1)])
    assert proposals == [greedy_from_scratch(draft, long, 3), greedy_from_scratch(draft, short, 1)]


def test_a_batch_that_does_not_fit_changes_nothing(draft: TargetModel) -> None:
    runner = StandaloneRunner(draft, KVCacheSettings(num_blocks=4, block_size=BLOCK_SIZE))
    runner.propose([ProposeInput("a", from_scratch(PROMPT), 2)])  # 8 positions: 2 blocks
    held = (list(runner.requests["a"].tokens), runner.cache.num_free_blocks)
    with pytest.raises(OutOfKVBlocks, match="needs 3 more blocks, 2 free"):
        runner.propose([ProposeInput("a", rows(6, [50]), 2), ProposeInput("b", from_scratch(PROMPT), 2)])
    assert (list(runner.requests["a"].tokens), runner.cache.num_free_blocks) == held
    assert "b" not in runner.requests
    runner.release(["a"])
    assert runner.cache.num_free_blocks == 4


def test_the_target_as_its_own_draft_is_accepted_in_full(target: TargetModel) -> None:
    target_runner = TargetRunner(target, CACHE, max_context=64)
    draft_runner = StandaloneRunner(target, CACHE)
    captured = open_tokens_only(target_runner)
    for _ in range(4):
        (proposal,) = draft_runner.propose([ProposeInput("a", delivered(captured), K)])
        (result,) = target_runner.step([StepItem("a", 1, DraftTree.chain(proposal))])
        assert result.accepted == K
        assert result.new_tokens[:K] == proposal
        captured = result.captured


# Start-up against the target.


def target_info(target_dir: Path) -> target_pb2.TargetInfo:
    """What the target at target_dir publishes (the fields a standalone draft checks)."""
    return target_pb2.TargetInfo(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        vocab_size=320,
        num_layers=4,
        tokenizer_digest=tokenizer_digest(target_dir),
    )


def test_a_target_format_checkpoint_without_mtp_layers_is_a_standalone_draft(tmp_path: Path, target_dir: Path) -> None:
    directory = write_tiny_target(tmp_path / "draft", DRAFT_SPEC)
    assert tokenizer_digest(directory) == tokenizer_digest(target_dir) != ""
    prepared = prepare_draft(DraftSettings(directory, "unused:0", "draft-0"), target_info(target_dir))
    assert (prepared.kind, prepared.tokens_only, prepared.capture.indices, prepared.missing_tables) == (
        "standalone",
        True,
        (),
        (),
    )
    assert isinstance(prepared.build_runner(CACHE), StandaloneRunner)


def test_a_draft_with_another_vocabulary_is_refused_naming_both_sizes(tmp_path: Path, target_dir: Path) -> None:
    directory = write_tiny_target(tmp_path / "draft", TinyTargetSpec(vocab_size=384, num_layers=2))
    with pytest.raises(IncompatibleDraft, match=r"the draft has vocab_size 384, the target has vocab_size 320"):
        prepare_draft(DraftSettings(directory, "unused:0", "draft-0"), target_info(target_dir))


def test_a_draft_with_another_tokenizer_is_refused_naming_both_digests(tmp_path: Path, target_dir: Path) -> None:
    # The same model vocabulary (320 rows), but a tokenizer of 300 tokens: the ids past the bytes mean other merges.
    directory = write_tiny_target(tmp_path / "draft", DRAFT_SPEC)
    write_tokenizer(directory, 300)
    ours, theirs = tokenizer_digest(directory)[:16], tokenizer_digest(target_dir)[:16]
    assert ours != theirs
    expected = f"tokenizer: .* the draft has {ours}, the target has {theirs}"
    with pytest.raises(IncompatibleDraft, match=expected):
        prepare_draft(DraftSettings(directory, "unused:0", "draft-0"), target_info(target_dir))
