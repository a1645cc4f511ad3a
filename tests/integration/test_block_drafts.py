"""DFlash, DFlash2 and DSpark block drafts through the real stack (`tandem serve`): greedy output equal to target-only
and to transformers' greedy generate, and the rounds (how many, drafts proposed, drafts accepted) equal to a reference
of the published loop (tests.helpers.dflash_reference) run on transformers' target.

- Llama target, random 2-layer draft (a sliding-window layer, features of layers 0, 2 and the last, whose output is
  the target's final norm's), block 4: drafts seldom accepted;
- Qwen3 target and draft both with a zero final norm, block 5: every logit is 0, so the target always produces
  token 0 and the draft always drafts it: every draft accepted, rows of a whole block each round. Under a presence
  penalty the target's choice becomes the lowest id not produced yet; the draft shapes its block row by row with the
  drafts before it, so it still drafts exactly that and every draft is still accepted;
- a Gemma 3 target (tied embedding, sliding layers) and a random DFlash draft that scales the block's embedding rows
  by its input_embedding_scale and caps its logits;
- a DFlash replica killed mid-stream: its requests replayed on the other, outputs unchanged;
- a DSpark draft whose drafts would all be accepted but are scored 0 by its confidence head, with adaptive k: once
  measured, no draft is verified; outputs unchanged;
- Qwen3 target, random DSpark draft (features of the embedding, layer 1 and the last, a Markov head, a confidence head,
  its own copy of the target's tables), block 4: 4 drafts a round, each corrected by the one before;
- Qwen3 target, random DFlash2 draft (a dynamic convolution around each sublayer, each draft chosen among its row's
  top 4 candidates by the selector, from the one before), block 4: 3 drafts a round.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.helpers.dflash_checkpoints import (
    TinyDFlash2Spec,
    TinyDFlashSpec,
    TinyDSparkSpec,
    write_tiny_dflash,
    write_tiny_dflash2,
    write_tiny_dspark,
)
from tests.helpers.dflash_reference import reference_generate
from tests.helpers.gemma3_checkpoints import TinyGemma3Spec, write_tiny_gemma3
from tests.integration.stack import draft_info, generate, serve, service_addresses
from tests.integration.test_greedy_equivalence import reference_greedy
from tests.integration.test_replicas import greedy, replica_pid, target_only
from tests.integration.test_separate_services import scrape, value

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os"]
MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_target(tmp_path_factory.mktemp("llama"), TinyTargetSpec(family="llama"))
    return target, write_tiny_dflash(tmp_path_factory.mktemp("llama-dflash"), target, TinyDFlashSpec())


@pytest.fixture(scope="module")
def accepting_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_target(tmp_path_factory.mktemp("qwen3"), TinyTargetSpec(family="qwen3", zero_final_norm=True))
    spec = TinyDFlashSpec(block_size=5, block_size_location="dflash_config", zero_final_norm=True, seed=1)
    return target, write_tiny_dflash(tmp_path_factory.mktemp("qwen3-dflash"), target, spec)


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), TinyGemma3Spec())
    spec = TinyDFlashSpec(dflash_fields=(("input_embedding_scale", 8.0), ("final_logit_softcapping", 2.0)))
    return target, write_tiny_dflash(tmp_path_factory.mktemp("gemma3-dflash"), target, spec)


@pytest.mark.parametrize(("pair", "tp"), [("llama_pair", 1), ("llama_pair", 2), ("gemma_pair", 1)])
def test_rounds_and_outputs_equal_the_reference(pair: str, tp: int, request: pytest.FixtureRequest) -> None:
    """At tp 2 the draft assembles the target's embedding and LM head from the two ranks' vocab-parallel shards. The
    Gemma 3 target's drafter scales the stored embedding rows by its config's input_embedding_scale."""
    target, draft = request.getfixturevalue(pair)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    with serve(target, draft, "--no-adaptive-k", "--tp", str(tp)) as stack:
        served = [generate(stack.address, prompt=p, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
        target_only = [
            generate(stack.address, prompt=p, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, disable_speculation=True)
            for p in PROMPTS
        ]
        # Seeded sampling draws each token from (seed, position) alone: block drafts must not change one of them.
        sampled = {"prompt": PROMPTS[0], "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.9, "seed": 7}
        seeded = [generate(stack.address, **sampled, disable_speculation=off) for off in (False, True)]
        info = draft_info(service_addresses(stack.log)["draft"])
    assert seeded[0].token_ids == seeded[1].token_ids and seeded[0].stats.draft_tokens > 0
    # No --speculative-num-steps: the whole block, B - 1 = 3 drafts.
    assert (info.kind, list(info.capture_indices), info.num_steps) == ("dflash", [1, 3, 5], 3)
    for prompt, completion, alone in zip(PROMPTS, served, target_only, strict=True):
        reference = reference_generate(target, draft, tokenizer(prompt).input_ids, MAX_NEW_TOKENS)
        assert completion.token_ids == alone.token_ids == reference.tokens
        assert completion.token_ids == reference_greedy(target, prompt, MAX_NEW_TOKENS)
        stats = completion.stats
        assert stats.rounds == len(reference.accepted)
        assert stats.draft_tokens == sum(len(drafts) for drafts in reference.drafts)
        assert stats.accepted_tokens == sum(reference.accepted)


def test_whole_blocks_accepted_with_and_without_a_penalty(accepting_pair: tuple[Path, Path]) -> None:
    target, draft = accepting_pair
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    with serve(target, draft, "--speculative-num-steps", "4", "--no-adaptive-k") as stack:  # B - 1 = 4
        plain = generate(stack.address, prompt=PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        options = {"prompt": PROMPTS[0], "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "presence_penalty": 1.0}
        penalised = generate(stack.address, **options)
        penalised_alone = generate(stack.address, **options, disable_speculation=True)
    reference = reference_generate(target, draft, tokenizer(PROMPTS[0]).input_ids, MAX_NEW_TOKENS)
    assert plain.token_ids == reference.tokens == [0] * MAX_NEW_TOKENS
    # 1 token from the prefill, then rounds of 4 drafts + 1: 19 tokens in 4 rounds (the last asks for 3 drafts).
    assert (plain.stats.rounds, plain.stats.draft_tokens, plain.stats.accepted_tokens) == (4, 15, 15)
    assert reference.accepted == [4, 4, 4, 3]
    assert penalised.token_ids == penalised_alone.token_ids
    assert len(set(penalised.token_ids)) == MAX_NEW_TOKENS  # the penalty made every token a new one
    assert penalised.stats.accepted_tokens == penalised.stats.draft_tokens == plain.stats.draft_tokens


# The kind a replica reports, its capture indices on the 4-layer target and the drafts of its whole block.
DRAFTS_ON_QWEN3 = {
    "dspark": (lambda d, t: write_tiny_dspark(d, t, TinyDSparkSpec()), [0, 2, 5], 4),
    "dflash2": (lambda d, t: write_tiny_dflash2(d, t, TinyDFlash2Spec()), [1, 3, 5], 3),
}


@pytest.mark.parametrize("kind", list(DRAFTS_ON_QWEN3))
def test_qwen3_block_rounds_and_outputs_equal_the_reference(kind: str, tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "qwen3", TinyTargetSpec(family="qwen3"))
    write_draft, capture, num_steps = DRAFTS_ON_QWEN3[kind]
    draft = write_draft(tmp_path / kind, target)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    with serve(target, draft, "--no-adaptive-k") as stack:
        served = [generate(stack.address, prompt=p, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
        info = draft_info(service_addresses(stack.log)["draft"])
    assert (info.kind, list(info.capture_indices), info.num_steps) == (kind, capture, num_steps)
    for prompt, completion in zip(PROMPTS, served, strict=True):
        reference = reference_generate(target, draft, tokenizer(prompt).input_ids, MAX_NEW_TOKENS)
        assert completion.token_ids == reference.tokens == reference_greedy(target, prompt, MAX_NEW_TOKENS)
        stats = completion.stats
        assert (stats.rounds, stats.draft_tokens, stats.accepted_tokens) == (
            len(reference.accepted),
            sum(len(drafts) for drafts in reference.drafts),
            sum(reference.accepted),
        )


def test_dspark_confidence_cuts_drafts_and_not_the_output(tmp_path: Path) -> None:
    """A DSpark draft whose every draft would be accepted (zero final norms, no Markov head; the target's choice is
    token 0, or under a presence penalty the lowest id not produced yet) but whose confidence head scores each 0 (on
    zero rows, its bias of -200 alone): with adaptive k, once the costs are measured the orchestrator verifies none of
    them, however little a row costs (counted in tandem:drafts_cut_by_confidence), and the output is target-only's."""
    target = write_tiny_target(tmp_path / "qwen3", TinyTargetSpec(family="qwen3", zero_final_norm=True))
    spec = TinyDSparkSpec(markov_rank=0, confidence_with_markov=False, zero_final_norm=True, confidence_bias=-200.0)
    draft = write_tiny_dspark(tmp_path / "dspark", target, spec)
    requests = [
        {"prompt": prompt, "max_new_tokens": 24, "ignore_eos": True, "presence_penalty": penalty}
        for prompt in PROMPTS
        for penalty in (0.0, 1.0)
    ]
    with serve(target, draft, "--http-port", "0", "--adaptive-k") as stack:
        alone = [generate(stack.address, **request, disable_speculation=True) for request in requests]
        served = [generate(stack.address, **request) for request in requests * 2]
        cut = value(scrape(f"{stack.http_url}/metrics"), "tandem:drafts_cut_by_confidence_total")
    assert [c.token_ids for c in served] == [a.token_ids for a in alone] * 2
    assert len(set(served[1].token_ids)) == 24  # the penalty made every token a new one
    # Until the costs are measured (16 Proposes) the drafts are verified, and all accepted; after, none is.
    assert 0 < sum(c.stats.draft_tokens for c in served) < sum(c.stats.completion_tokens for c in served)
    assert cut > 0 and served[-1].stats.draft_tokens == 0


def test_a_killed_block_replica_costs_no_request(llama_pair: tuple[Path, Path]) -> None:
    """Two DFlash replicas, one SIGKILLed while 16 streams run: its requests move to the other, which takes their
    whole context from position 0 (a replay), and every output still equals target-only."""
    target, draft = llama_pair
    prompts = [f"def function_{index}(value):\n    return" for index in range(16)]
    with serve(target, draft, "--draft-replicas", "2", "--no-adaptive-k") as stack:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(greedy, stack.address, prompt, 120) for prompt in prompts]
            time.sleep(1.0)  # the streams are running
            os.kill(replica_pid(stack, "draft-1"), signal.SIGKILL)
            speculative = [future.result(timeout=300) for future in futures]
        assert any("draft replica draft-1 demoted" in line for line in stack.log)
        reference = target_only(stack.address, prompts, 120)
    assert speculative == reference
