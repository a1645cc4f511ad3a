"""orchestrator.loop.batching.plan_step on hand-built requests: decoding first with room for drafts, the newest running
request preempted when the pool is short, prompt chunks under the token budget, admission in arrival order."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from orchestrator.loop.batching import ActiveRequest, KVPool, OnTarget, StepPlan, plan_step
from orchestrator.loop.output import RequestOutput
from orchestrator.loop.text import IncrementalDetokenizer, StopStringMatcher
from orchestrator.loop.validation import ValidatedRequest
from orchestrator.peers.backends import PromptImage
from orchestrator.settings import SchedulerSettings
from tandem.sampling.params import SamplingParams
from tandem.settings import TreeShape
from tests.helpers.tokenizer import write_tokenizer

POOL = KVPool(num_blocks=6, block_size=4)
SETTINGS = SchedulerSettings(num_steps=3, max_num_seqs=4, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return AutoTokenizer.from_pretrained(str(directory))


def request(
    tokenizer: PreTrainedTokenizerBase, name: str, prompt: int, generated: int = 0, replica: str | None = "d"
) -> ActiveRequest:
    """A request with a prompt of `prompt` tokens that has generated `generated` tokens, all but the last with KV."""
    params = ValidatedRequest(tuple(range(3, 3 + prompt)), 64, SamplingParams(), (), True, False)
    output = RequestOutput(prompt, 64, True, IncrementalDetokenizer(tokenizer, params.input_ids), StopStringMatcher(()))
    output.generated.extend([5] * generated)
    active = ActiveRequest(
        name, params, output, replica, on_target=OnTarget.OPEN if generated > 0 else OnTarget.NOTHING
    )
    active.kv_length = prompt + generated - 1 if generated else 0
    return active


def test_decoding_first_then_a_chunk_and_an_admission(tokenizer: PreTrainedTokenizerBase) -> None:
    # A decodes: kv 9 of 10 tokens, 1 + 3 rows -> positions 9..12: blocks 3 -> 4 (1 block). 2 free after A.
    decoding = request(tokenizer, "A", prompt=8, generated=2)
    waiting = deque([request(tokenizer, "B", prompt=20), request(tokenizer, "C", prompt=3)])
    plan = plan_step([decoding], waiting, POOL, SETTINGS)
    assert [(s.request.request_id, s.num_tokens, s.max_drafts) for s in plan.decode] == [("A", 1, 3)]
    # B's first chunk is the 4 tokens left of the budget: 1 block, leaving 1, a block of headroom for A. C waits:
    # the budget is spent, and it may not overtake B anyway.
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("B", 4)]
    assert [r.request_id for r in plan.admitted] == ["B"] and plan.preempted == []
    # One block fewer: after A's block none would be left beside B's chunk, so B waits.
    plan = plan_step([decoding], waiting, KVPool(num_blocks=5, block_size=4), SETTINGS)
    assert [s.request.request_id for s in plan.decode] == ["A"]
    assert plan.admitted == [] and plan.chunks == []


def test_the_newest_running_request_is_preempted_for_an_older_one(tokenizer: PreTrainedTokenizerBase) -> None:
    old = request(tokenizer, "old", prompt=8, generated=4)  # kv 11: 3 blocks; verify to 15: 4 blocks
    new = request(tokenizer, "new", prompt=8, generated=4)  # 3 blocks
    tight = KVPool(num_blocks=6, block_size=4)
    plan = plan_step([old, new], deque(), tight, SETTINGS)
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [s.request.request_id for s in plan.decode] == ["old"]


def test_blocks_another_orchestrator_holds_are_not_this_ones(tokenizer: PreTrainedTokenizerBase) -> None:
    old = request(tokenizer, "old", prompt=8, generated=4)  # 3 blocks, 4 after verifying
    new = request(tokenizer, "new", prompt=8, generated=4)  # 3 blocks, 4 after verifying
    pool = KVPool(num_blocks=10, block_size=4)
    plan = plan_step([old, new], deque(), pool, SETTINGS)
    assert plan.preempted == [] and [s.request.request_id for s in plan.decode] == ["old", "new"]
    # 4 held elsewhere: 6 left, as in the tight pool above; the newest of this orchestrator's requests makes room.
    plan = plan_step([old, new], deque(), pool, SETTINGS, held_elsewhere=4)
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [s.request.request_id for s in plan.decode] == ["old"]


def test_a_request_alone_in_a_short_pool_preempts_itself(tokenizer: PreTrainedTokenizerBase) -> None:
    alone = request(tokenizer, "alone", prompt=8, generated=4)
    plan = plan_step([alone], deque(), KVPool(num_blocks=3, block_size=4), SETTINGS)
    assert plan.preempted == [alone] and plan.decode == []


def test_the_token_budget_splits_a_long_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    long = request(tokenizer, "long", prompt=30)
    plan = plan_step([], deque([long]), KVPool(num_blocks=32, block_size=4), SETTINGS)
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("long", 8)]
    long.kv_length = 24
    plan = plan_step([long], deque(), KVPool(num_blocks=32, block_size=4), SETTINGS)
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("long", 6)]  # the final chunk


def test_prefills_that_fill_the_pool_preempt_the_newest_for_the_oldest(tokenizer: PreTrainedTokenizerBase) -> None:
    older, newer = request(tokenizer, "older", prompt=16), request(tokenizer, "newer", prompt=16)
    older.kv_length = newer.kv_length = 8  # 2 blocks each: the pool of 4 is full, neither can take a chunk
    plan = plan_step([older, newer], deque(), KVPool(num_blocks=4, block_size=4), SETTINGS)
    assert plan.preempted == [newer]
    assert [(s.request.request_id, s.num_tokens) for s in plan.chunks] == [("older", 8)]


def test_decoding_without_drafts_takes_several_tokens_when_nothing_waits(tokenizer: PreTrainedTokenizerBase) -> None:
    # Target-only requests (no replica): 4 forward passes per step, as the pool allows; A (kv 9) grows to 13
    # positions (4 blocks), B (kv 5) to 9 (3 blocks): 7 of 8 blocks.
    a = request(tokenizer, "A", prompt=8, generated=2, replica=None)
    b = request(tokenizer, "B", prompt=4, generated=2, replica=None)
    settings = SchedulerSettings(num_steps=3, max_num_batched_tokens=8, num_scheduler_steps=4)
    plan = plan_step([a, b], deque(), KVPool(num_blocks=8, block_size=4), settings)
    assert [(s.request.request_id, s.num_tokens, s.decode_steps) for s in plan.decode] == [("A", 1, 4), ("B", 1, 4)]
    # One block short of the extra tokens: one token per step.
    plan = plan_step([a, b], deque(), KVPool(num_blocks=6, block_size=4), settings)
    assert [s.decode_steps for s in plan.decode] == [1, 1]
    # A request in the queue is not kept waiting for several passes.
    plan = plan_step([a, b], deque([request(tokenizer, "C", prompt=3)]), KVPool(num_blocks=8, block_size=4), settings)
    assert [s.decode_steps for s in plan.decode] == [1, 1] and [r.request_id for r in plan.admitted] == ["C"]
    # A request with drafts makes the step one verification.
    drafting = request(tokenizer, "D", prompt=4, generated=2)
    plan = plan_step([a, drafting], deque(), KVPool(num_blocks=8, block_size=4), settings)
    assert [(s.max_drafts, s.decode_steps) for s in plan.decode] == [(0, 1), (3, 1)]
    # Never beyond max_new_tokens (64 here): 2 tokens left, 2 passes.
    a.output.generated.extend([5] * 60)
    a.kv_length += 60
    plan = plan_step([a], deque(), KVPool(num_blocks=32, block_size=4), settings)
    assert [s.decode_steps for s in plan.decode] == [2]


def test_a_paused_batch_keeps_its_passes_beside_the_probes_drafts(tokenizer: PreTrainedTokenizerBase) -> None:
    # P and Q were paused by adaptive k (no replica, decoding target-only); D is the probe left on its replica, in
    # one of its exploration rounds (3 drafts). P and Q still take 4 passes; D verifies its drafts in the first.
    paused = [request(tokenizer, name, prompt=4, generated=2, replica=None) for name in ("P", "Q")]
    for each in paused:
        each.pause()
        each.on_target = OnTarget.OPEN  # a step since told the target: their rows go nowhere
    probe = request(tokenizer, "D", prompt=4, generated=2)
    settings = SchedulerSettings(num_steps=3, max_num_batched_tokens=16, num_scheduler_steps=4)
    plan = plan_step([*paused, probe], deque(), KVPool(num_blocks=12, block_size=4), settings)
    assert [(s.request.request_id, s.max_drafts, s.decode_steps) for s in plan.decode] == [
        ("P", 0, 4),
        ("Q", 0, 4),
        ("D", 3, 1),
    ]
    # A target-only request that was not paused (it asked for no drafts) keeps to one pass beside drafts: its passes
    # would hold up the rounds of the requests that speculate.
    plain = request(tokenizer, "T", prompt=4, generated=2, replica=None)
    plan = plan_step([plain, probe], deque(), KVPool(num_blocks=12, block_size=4), settings)
    assert [(s.request.request_id, s.decode_steps) for s in plan.decode] == [("T", 1), ("D", 1)]
    # Without room for the paused requests' extra tokens, one pass for all.
    plan = plan_step([*paused, probe], deque(), KVPool(num_blocks=8, block_size=4), settings)
    assert [s.decode_steps for s in plan.decode] == [1, 1, 1]


def test_a_tree_round_gets_room_for_every_node(tokenizer: PreTrainedTokenizerBase) -> None:
    # Topk 4 with 8 draft tokens: a round verifies up to 7 nodes at depth 3. A (kv 9) needs 1 + 7 rows -> 17
    # positions (5 blocks, 2 more), within a budget of 8 tokens; a chain of 3 would need 13 positions (1 more).
    tree = SchedulerSettings(num_steps=3, max_num_batched_tokens=8, tree=TreeShape(topk=4, num_draft_tokens=8))
    decoding = request(tokenizer, "A", prompt=8, generated=2)
    plan = plan_step([decoding], deque(), KVPool(num_blocks=5, block_size=4), tree)
    assert [(s.max_drafts, s.decode_steps) for s in plan.decode] == [(3, 1)] and plan.preempted == []
    # With 4 blocks the tree's rows do not fit (the chain's would): A preempts itself rather than fail at the target.
    plan = plan_step([decoding], deque(), KVPool(num_blocks=4, block_size=4), tree)
    assert plan.decode == [] and [r.request_id for r in plan.preempted] == ["A"]
    assert [s.max_drafts for s in plan_step([decoding], deque(), KVPool(4, 4), SETTINGS).decode] == [3]


def chunks_of(prompt: ActiveRequest, pool: KVPool, settings: SchedulerSettings) -> list[int]:
    """The chunks a waiting request's prompt is computed in, alone, step after step."""
    chunks = []
    plan = plan_step([], deque([prompt]), pool, settings)
    while plan.chunks:
        chunks.append(plan.chunks[0].num_tokens)
        prompt.kv_length += plan.chunks[0].num_tokens
        plan = plan_step([prompt], deque(), pool, settings) if prompt.uncomputed > 0 else StepPlan()
    return chunks


def test_a_prompt_chunk_cut_by_the_budget_ends_at_a_block_boundary(tokenizer: PreTrainedTokenizerBase) -> None:
    # A budget of 7 tokens, blocks of 4: a 20-token prompt goes in chunks of 4 (positions 0..3), then from 4 to 8, so
    # that every chunk starts where the target's prefix cache can reuse whole blocks; its last chunk is what is left.
    settings = SchedulerSettings(num_steps=3, max_num_seqs=4, max_num_batched_tokens=7)
    pool = KVPool(num_blocks=16, block_size=4)
    prompt = request(tokenizer, "A", prompt=20)
    assert chunks_of(prompt, pool, settings) == [4, 4, 4, 4, 4]
    short = request(tokenizer, "B", prompt=9)
    short.kv_length = 3  # from 3, a budget of 3 reaches 6: the chunk stops at the boundary 4
    assert plan_step([short], deque(), pool, SchedulerSettings(max_num_batched_tokens=3)).chunks[0].num_tokens == 1
    short.kv_length = 1  # from 1, a budget of 2 reaches 3 and passes no boundary: the chunk is the budget's
    assert plan_step([short], deque(), pool, SchedulerSettings(max_num_batched_tokens=2)).chunks[0].num_tokens == 2
    # At a boundary with less than a block of the step left, a new request waits for the next step rather than
    # begin with a chunk that would end its prefix reuse; with a step smaller than a block, it takes what fits.
    decoding = request(tokenizer, "A", prompt=8, generated=2)
    plan = plan_step([decoding], deque([request(tokenizer, "C", prompt=12)]), pool, settings)
    assert (plan.admitted, [entry.request.request_id for entry in plan.decode]) == ([], ["A"])
    tiny = plan_step([], deque([request(tokenizer, "C", prompt=12)]), pool, SchedulerSettings(max_num_batched_tokens=3))
    assert [entry.num_tokens for entry in tiny.chunks] == [3]


def test_a_prompt_chunk_never_ends_inside_an_image(tokenizer: PreTrainedTokenizerBase) -> None:
    # Blocks of 4, a 30-token prompt with an image at tokens 6..15 (its tokens see each other both ways: the target
    # computes an image in one chunk). A budget of 8 would end at 8: the chunk stops at the image (0..5); the image
    # (10 tokens) is then taken whole, above the budget, as no step's budget holds it; then block-aligned chunks.
    settings = SchedulerSettings(num_steps=3, max_num_seqs=4, max_num_batched_tokens=8)
    pool = KVPool(num_blocks=16, block_size=4)
    prompt = request(tokenizer, "A", prompt=30)
    image = PromptImage(6, 16, b"png", "digest")
    prompt.params = replace(prompt.params, images=(image,))
    assert chunks_of(prompt, pool, settings) == [6, 10, 8, 6]
    # A step's budget holds the image, but not what a decoding request leaves of it: the image waits for the next.
    roomy = SchedulerSettings(num_steps=3, max_num_seqs=4, max_num_batched_tokens=12)
    prompt.kv_length = 6
    decoding = request(tokenizer, "B", prompt=8, generated=2)
    plan = plan_step([decoding, prompt], deque(), KVPool(num_blocks=32, block_size=4), roomy)
    assert [entry.request.request_id for entry in plan.chunks] == []
    plan = plan_step([prompt], deque(), KVPool(num_blocks=32, block_size=4), roomy)
    assert [entry.num_tokens for entry in plan.chunks] == [10]
