"""`--draft ngram`: prompt-lookup drafting in the orchestrator, a DraftBackend with no model and no draft process.

A request's next tokens are guessed from its own earlier tokens: the last n tokens (n from max_n down to min_n,
longest first) are looked up among the request's prompt and output so far, and the tokens that followed their most
recent earlier occurrence are proposed, k of them (where the tokens end, the copy goes on over its own proposal).
Code and structured text repeat themselves, so such guesses are often right, and they cost a lookup instead of a
forward pass.

It runs where the tokens already are: the scheduler hands each ProposeTask its request's tokens, so the drafter holds
no state (nothing to release, nothing to lose on preemption) and needs no hidden rows from the target. Its replica
joins the ReplicaPool with `hidden_rows=False`, so the target captures nothing for the requests it drafts. Verification
is the target's as for any draft, so greedy output equals target-only output.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence

from orchestrator.peers.backends import ProposedBatch, ProposeTask
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import NgramSettings, OrchestratorSettings
from tandem.errors import StartupError
from tandem.sampling.draft_tree import DraftTree

NGRAM_REPLICA = "ngram"  # the replica id of the drafter in the pool (ListReplicas, metrics)
NGRAM_ADDRESS = "in-process"
TOKEN_BYTES = array("i").itemsize  # token ids are stored as 32-bit ints: every vocabulary is below 2**31


def lookup(tokens: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """`num_tokens` tokens guessed to follow `tokens`: those that followed the most recent earlier occurrence of the
    longest suffix of `tokens` whose length is in max_n..min_n; [] when none of those suffixes occurs earlier.

    Example, max_n 3, min_n 1, num_tokens 2, tokens (positions under them):

        5 6 7 8 5 6 9 5 6
        0 1 2 3 4 5 6 7 8

    The 3-token suffix 9 5 6 occurs nowhere earlier; the 2-token suffix 5 6 occurs at 0 and at 4 (and as the suffix
    itself at 7, which does not count). The most recent, at 4, was followed by 9 5: the proposal.

    When the copy reaches the end of the tokens it goes on over what it has just proposed (an overlapping copy, as
    LZ77 decodes one): the guess is that the text keeps repeating with the period it shows. In 1 2 3 1 2 the suffix
    1 2 occurred at 0, followed by 3 1 2, and then, continuing the copy, by 3 1 2 again: 3 1 2 3 1 for 5 tokens.
    Taking the most recent occurrence and cutting the proposal where the tokens end proposed only 3 1 2, and in a
    2-token loop (7 8 7 8) only 2 tokens a round, whatever k is.
    """
    length = len(tokens)
    if num_tokens <= 0 or length < 2:
        return []
    # bytes.rfind scans for the suffix in C, from the end, which is the most recent match first.
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        start = _last_earlier(data, length, n)
        if start is not None:
            return _copy_on(tokens, start + n, num_tokens)
    return []


def _copy_on(tokens: Sequence[int], start: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens copied from `start` on; past the end of `tokens` the copy reads what it has written."""
    proposal = list(tokens[start : start + num_tokens])
    period = len(tokens) - start  # > 0: start lies before the end
    while len(proposal) < num_tokens:
        proposal.append(proposal[len(proposal) - period])
    return proposal


def _last_earlier(data: bytes, length: int, n: int) -> int | None:
    """The position of the most recent occurrence of the last n tokens that ends before the last token, or None."""
    suffix = data[-n * TOKEN_BYTES :]
    end = (length - 1) * TOKEN_BYTES  # an occurrence must lie within the tokens before the last one
    while (found := data.rfind(suffix, 0, end)) >= 0:
        if found % TOKEN_BYTES == 0:
            return found // TOKEN_BYTES
        # The bytes matched across token boundaries: look for an occurrence that starts further back.
        end = found + len(suffix) - 1
    return None


class NgramDrafter:
    """A DraftBackend that proposes by `lookup` over each task's tokens; it holds nothing and cannot fail."""

    def __init__(self, settings: NgramSettings) -> None:
        self.settings = settings

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        started = time.perf_counter()
        s = self.settings
        drafts = {
            task.request_id: DraftTree.chain(lookup(task.tokens, task.num_steps, s.min_n, s.max_n)) for task in tasks
        }
        return ProposedBatch(drafts, {}, time.perf_counter() - started)

    async def release(self, request_ids: Sequence[str]) -> None:
        return None  # no state: every task brings its tokens

    async def probe(self) -> None:
        return None


def add_ngram_replica(replicas: ReplicaPool, settings: NgramSettings) -> None:
    """Puts the n-gram drafter in the pool; the target streams it no hidden rows."""
    replicas.add(NGRAM_REPLICA, NGRAM_ADDRESS, NgramDrafter(settings), hidden_rows=False)


def check_one_draft_kind(settings: OrchestratorSettings) -> None:
    """One draft kind per stack for now: n-gram drafting is not balanced against draft model replicas."""
    if settings.ngram is not None and (settings.draft_addresses or settings.draft_discovery is not None):
        raise StartupError(
            "--draft ngram drafts in the orchestrator and takes no draft replicas: drop --draft-address and "
            "--draft-dns, or --draft ngram (one draft kind per stack)"
        )
