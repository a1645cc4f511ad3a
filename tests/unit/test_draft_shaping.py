"""Drafts shaped by the request's penalties and logit_bias (draft_server.shaping), in every draft runner.

Every runner is asked for the same request with options under which the next tokens are known whatever the model:
logit_bias lifts A (50), Z (45) and B (40) far above the tiny models' logits (a few units), and a presence penalty
of 100 sinks every token already among the new tokens or on the row's own path. The new tokens hold Z, so a shaped
draft is A, then B (A is on its path now), then none of A, B, Z or the other new token W.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_server.mtp_runner import MTPRunner
from draft_server.runner import DraftRunner, ProposeInput, TargetRows
from draft_server.shaping import RequestShaping, shape_logits
from draft_server.standalone_runner import StandaloneRunner
from draft_server.tree_draft import TreeDrafter
from tandem.model_thread import ModelThread
from tandem.models.eagle3 import load_eagle3
from tandem.models.mtp import load_mtp
from tandem.models.registry import load_target
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.params import SamplingParams
from tandem.sampling.processing import Shaping, process_rows
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from tandem.wire.sampling import sampling_to_proto
from target_server.items import RowStream
from target_server.main import target_info
from target_server.runner import TargetRunner
from target_server.service import Subscriber, TargetService
from tests.helpers.checkpoints import (
    TinyEagle3Spec,
    TinyTargetSpec,
    target_ids_of_draft,
    write_tiny_eagle3,
    write_tiny_target,
)
from tests.helpers.mtp_checkpoints import TinyChainedMTPSpec, write_tiny_chained_mtp
from tests.helpers.target_rows import TINY_FEATURE_WIDTH
from tests.unit.test_draft_ahead import Replica, open_item, propose_request

CACHE = KVCacheSettings(num_blocks=64, block_size=4)
PROMPT = [1, 40, 41, 42, 43, 44, 45]
STEPS = 3


def eagle3_runner(scratch: Path, tree: bool = False) -> DraftRunner | TreeDrafter:
    target_dir = write_tiny_target(scratch / "target", TinyTargetSpec())
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    draft_dir = write_tiny_eagle3(scratch / "draft", target_dir, spec)
    runner = DraftRunner(load_eagle3(draft_dir)[0], CACHE)
    return TreeDrafter(runner, topk=2, num_draft_tokens=8) if tree else runner


def mtp_runner(scratch: Path) -> MTPRunner:
    target_dir = write_tiny_target(scratch / "target", TinyTargetSpec(num_layers=4))
    spec = TinyChainedMTPSpec(num_mtp_layers=STEPS, include_layer_copies=True, seed=3)
    loaded = load_mtp(write_tiny_chained_mtp(scratch / "mtp", target_dir, spec))
    target = load_target(target_dir)
    loaded.model.fill_shared("embed_tokens", target.model.embed_tokens.weight.detach())
    loaded.model.fill_shared("lm_head", target.lm_head.weight.detach())
    return MTPRunner(loaded.model, CACHE, chain=True)


def standalone_runner(scratch: Path) -> StandaloneRunner:
    spec = TinyTargetSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3)
    return StandaloneRunner(load_target(write_tiny_target(scratch / "draft", spec)), CACHE)


def biased_ids(scratch: Path) -> tuple[int, int, int]:
    """Three ids of the EAGLE3 head's reduced vocabulary, past the prompt's."""
    target_dir = write_tiny_target(scratch / "ids-target", TinyTargetSpec())
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    ids = [token for token in target_ids_of_draft(write_tiny_eagle3(scratch / "ids", target_dir, spec)) if token > 50]
    return ids[0], ids[1], ids[2]


CASES = {
    "eagle3-chain": (eagle3_runner, TINY_FEATURE_WIDTH),
    "eagle3-tree": (lambda scratch: eagle3_runner(scratch, tree=True), TINY_FEATURE_WIDTH),
    "chained-mtp": (mtp_runner, 64),
    "standalone": (standalone_runner, 0),
}


def request(feature_width: int, new_tokens: tuple[int, ...], sampling: SamplingParams | None) -> ProposeInput:
    tokens = [*PROMPT, *new_tokens]
    start = -1 if feature_width == 0 else 0
    next_tokens = tokens[start + 1 :]
    features = torch.randn(len(next_tokens), feature_width, generator=torch.Generator().manual_seed(5))
    rows = TargetRows(start, next_tokens, features)
    shaping = None if sampling is None else Shaping(sampling, len(PROMPT), tuple(tokens))
    return ProposeInput("r", rows, STEPS, shaping)


def drafted(runner: object, item: ProposeInput) -> DraftTree:
    proposal = runner.propose([item])[0]  # type: ignore[attr-defined]
    runner.release(["r"])  # type: ignore[attr-defined]
    return proposal if isinstance(proposal, DraftTree) else DraftTree.chain(proposal)


@pytest.mark.parametrize("kind", CASES)
def test_every_runner_drafts_as_the_options_shape_each_rows_path(kind: str, tmp_path: Path) -> None:
    build, width = CASES[kind]
    runner = build(tmp_path)
    a, b, z = biased_ids(tmp_path)
    w = 60 if z != 60 else 61
    sampling = SamplingParams(presence_penalty=100.0, logit_bias=((a, 50.0), (b, 40.0), (z, 45.0)))
    shaped = drafted(runner, request(width, (z, w), sampling))
    plain = drafted(runner, request(width, (z, w), None))
    paths = shaped.paths()[1:]
    best = max(paths, key=len)  # a tree's deepest path is its best first children, as a chain is its only one
    assert list(best) == [a, b, best[2]] and best[2] not in {a, b, z, w}, f"{kind}: {paths}"
    for path in paths:  # no path repeats a new token or its own tokens: each row counted its own path
        assert len(set(path)) == len(path) and not set(path) & {z, w}, f"{kind}: {path}"
    assert plain.tokens[0] != a, f"{kind}: unshaped drafts should not follow the bias: {plain}"


def test_a_reduced_vocabulary_is_shaped_in_the_targets_columns() -> None:
    """Draft columns placed at their target ids, processed there, read back: the same values process_rows gives
    the target's rows at those ids."""
    target_ids = torch.tensor([0, 3, 4, 9, 11])
    sampling = SamplingParams(repetition_penalty=1.7, frequency_penalty=0.4, logit_bias=((9, 2.0), (7, 5.0)))
    shaping = Shaping(sampling, 3, (3, 4, 2, 9, 9))
    logits = torch.randn(2, 5, generator=torch.Generator().manual_seed(1))
    full = torch.randn(2, 12, generator=torch.Generator().manual_seed(2))
    full[:, target_ids] = logits
    shaped = shape_logits(logits, [shaping, None], [[4], []], (target_ids, 12))
    expected = process_rows(full[:1], DraftTree(), sampling, (3, 4, 2, 9, 9, 4), 3)[0, target_ids]
    assert torch.equal(shaped[0], expected)
    assert torch.equal(shaped[1], logits[1])  # a request without options is left as it is
    assert shape_logits(logits, [None, None], [[], []], (target_ids, 12)) is logits


def test_the_replica_follows_committed_tokens_through_rows() -> None:
    kept = RequestShaping(SamplingParams(presence_penalty=1.0), 2, [7])  # x0 = 7, from the options' message
    assert kept.add(0, [8, 9, 10])  # rows 0..2 bring x1..x3
    assert kept.add(3, [11])
    assert kept.add(2, [12, 13])  # a rewind (rows again from position 2) replaces x3 on
    assert kept.tokens == [7, 8, 9, 12, 13]
    assert kept.at(3).tokens == (7, 8, 9, 12)  # a proposal for rows ending at position 3 sees x0..x3
    assert not kept.add(9, [1])  # a gap: the tokens between are unknown


def test_the_target_sends_the_options_and_the_replica_drafts_by_them(tmp_path: Path) -> None:
    """Through the two services: the rows that start a request carry its options (no grammar) once, and the
    replica's Propose drafts by them; a request without options carries none."""
    target_dir = write_tiny_target(tmp_path / "target", TinyTargetSpec())
    spec = TinyEagle3Spec(draft_vocab_size=48, include_embedding=True, layer_ids=[1, 2, 3])
    draft_dir = write_tiny_eagle3(tmp_path / "draft", target_dir, spec)
    a, b, _ = biased_ids(tmp_path)
    sampling = SamplingParams(presence_penalty=100.0, logit_bias=((a, 50.0), (b, 40.0)), grammar='start: "x"')
    runner = TargetRunner(load_target(target_dir), CACHE, 256)
    target = TargetService(runner, target_info(runner, "float32"), ModelThread("target-test", 1), 30.0)
    subscriber = target.subscribers["r0"] = Subscriber(RowStream((1, 2, 3)))

    def opened(request_id: str, options: SamplingParams) -> target_pb2.StepItem:
        item = open_item(request_id, PROMPT)
        item.open.sampling.CopyFrom(sampling_to_proto(options))
        return item

    async def scenario() -> None:
        async with Replica(target_dir, draft_dir) as replica:
            plain = replace(sampling, presence_penalty=0.0, logit_bias=(), grammar="")
            step = target_pb2.StepRequest(
                items=[opened("shaped", replace(sampling, grammar="")), opened("plain", plain)]
            )
            response = await target._step(step, "session")
            assert list(response.results[0].new_tokens) == [a]  # the bias chose the first token
            batches = [subscriber.queue.get_nowait() for _ in range(subscriber.queue.qsize())]
            messages = {message.request_id: message for batch in batches if batch for message in batch.rows}
            assert not messages["plain"].HasField("shaping")
            sent = messages["shaped"].shaping
            assert (sent.prompt_length, sent.first_token) == (len(PROMPT), PROMPT[0])
            assert dict(sent.sampling.logit_bias) == {a: 50.0, b: 40.0} and not sent.sampling.grammar
            await replica.forward(*batches)
            asked = propose_request("shaped", 1, STEPS, len(PROMPT))
            (result,) = (await replica.service._propose(asked, "session")).results
            assert result.drafts.tokens[0] == b and a not in result.drafts.tokens  # A is a new token now
            await replica.service._release({"shaped", "plain"})
            assert not replica.service._shaping.requests
        await target.stop()

    asyncio.run(scenario())
