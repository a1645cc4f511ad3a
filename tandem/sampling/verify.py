"""Verification of draft tokens against the target model: which drafts to keep, and which token comes after them.

Terms, defined here once for all of Tandem:

- draft tokens: the k tokens x_0 .. x_{k-1} that the draft model proposes after the committed prefix.
- target logits: [k + 1, vocab], scored by the target in one pass. Row i is the target's prediction at the parent
  of draft i (the position that draft i claims); row k is the prediction after the last draft.
- accepted: how many leading draft tokens are kept (0 .. k). The first rejection discards every later draft.
- correction token: the token the target samples in place of the first rejected draft.
- bonus token: when all k drafts are accepted, one more token from row k, free because the target already scored it.
- acceptance length = accepted + 1: the tokens one verification step commits. Every step ends with exactly one
  correction or bonus token, so a step always makes progress even when every draft is rejected.

The lossless rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): at a
position where the target samples from p and the draft proposed x sampled from q, accept x with probability
min(1, p(x) / q(x)); on rejection sample from norm(max(p - q, 0)). The committed token is then distributed exactly
as p, because P(x) = q(x) min(1, p(x)/q(x)) + (1 - beta) norm(max(p - q, 0))(x) = min(p, q)(x) + max(p - q, 0)(x)
= p(x), where beta = sum(min(p, q)) is the total acceptance probability. A deterministic (argmax) draft has a one-hot
q: accept x with probability p(x), on rejection sample p with x removed. Greedy decoding is the temperature-0 case,
where p is one-hot at the target argmax: accept while the draft equals the argmax.

A seeded request decides each token by the Gumbel-max form of sampling instead: the token at sequence position t is
the argmax of log p_t(v) + g_t(v), where g_t is Gumbel(0, 1) noise drawn from (seed, t) alone (`seeded_scores`). That
token is distributed exactly as p_t, and it depends on nothing but the seed, the context and the position: not on
the drafts, on how many rounds it took, on speculation being on, or on a restart between two rounds. Verification is
then greedy verification over those scores: a draft is kept while it equals the noisy argmax of its row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling.params import SamplingParams


@dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # number of draft tokens accepted, 0 .. k
    tokens: list[int]  # the accepted draft tokens, then one correction or bonus token; len == accepted + 1


def target_probs(
    logits: torch.Tensor,  # [num_rows, vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [num_rows, vocab] float32, each row sums to 1
    """The distribution the target samples from: softmax after temperature, top_k and top_p, in that order.

    Greedy parameters give a one-hot row at the argmax, the distribution that greedy decoding samples from.
    """
    logits = logits.float()
    vocab_size = logits.shape[-1]
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), vocab_size).float()
    # Shifting by the row maximum first changes no probability and keeps the division finite: logits / 1e-40 would
    # overflow to inf and the softmax would give NaN, while every shifted logit is <= 0, so the largest becomes 0 and
    # the others at worst -inf (the greedy limit of a tiny temperature).
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < vocab_size:
        kth_largest = logits.topk(params.top_k, dim=-1).values[:, -1:]  # [num_rows, 1]
        # Tokens tied with the k-th largest logit are all kept: nothing principled picks among them.
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    # top_p == 1 skips the filter: rounding in the cumulative sum could otherwise drop the least likely tokens.
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return probs


def _keep_top_p(
    probs: torch.Tensor,  # [num_rows, vocab]
    top_p: float,
) -> torch.Tensor:  # [num_rows, vocab]
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p, then renormalise."""
    sorted_probs, sorted_tokens = probs.sort(dim=-1, descending=True)
    # A token stays when the mass of the tokens ranked above it is still short of top_p. Example, top_p = 0.7 and
    # sorted probs [0.5, 0.3, 0.2]: mass above = [0, 0.5, 0.8], so the first two stay. The top token always stays.
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, sorted_tokens, mass_above < top_p)
    kept = probs.masked_fill(~keep, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_token(
    logits: torch.Tensor,  # [vocab]
    params: SamplingParams,
    generator: torch.Generator,  # CPU, from make_generator
) -> int:
    """One token from the target distribution; the argmax when params are greedy."""
    if params.is_greedy:
        return int(logits.argmax())
    probs = target_probs(logits.unsqueeze(0).cpu(), params)[0]
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_greedy(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: Sequence[int],  # [k]
) -> VerifyOutcome:
    """Accept drafts while each equals the target argmax at its parent; then one correction or bonus argmax.

    Worked example, k = 3: drafts [5, 7, 9] and row argmaxes [5, 7, 2, 4] accept 5 and 7, and the correction 2
    replaces 9: tokens [5, 7, 2], accepted 2. Had the third argmax been 9, the bonus 4 would follow all three
    drafts: tokens [5, 7, 9, 4], accepted 3.
    """
    _check_shapes(target_logits, len(draft_tokens), draft_probs=None)
    target_choices = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == target_choices[accepted]:
        accepted += 1
    # target_choices[accepted] is the correction when a draft was rejected and the bonus when none was.
    return VerifyOutcome(accepted=accepted, tokens=[*map(int, draft_tokens[:accepted]), target_choices[accepted]])


def verify_sampled(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: Sequence[int],  # [k]
    params: SamplingParams,
    generator: torch.Generator,  # CPU, from make_generator
    draft_probs: torch.Tensor | None = None,  # [k, vocab], the q each draft token was sampled from; None: one-hot
) -> VerifyOutcome:
    """The lossless rule of the module docstring, for one sequence of drafts.

    draft_probs None means a deterministic draft (q one-hot at each draft token): accept with probability p(x) and
    on rejection sample p with x removed. The generator draws k uniforms, then one token.
    """
    num_drafts = len(draft_tokens)
    _check_shapes(target_logits, num_drafts, draft_probs)
    probs = target_probs(target_logits.cpu(), params)  # [k + 1, vocab]
    drafts = torch.tensor(list(draft_tokens), dtype=torch.long, device=probs.device)  # [k]
    rows = torch.arange(num_drafts, device=probs.device)  # [k]
    target_mass = probs[rows, drafts]  # [k], p(x_i)
    draft_rows = None if draft_probs is None else draft_probs.to("cpu", torch.float32)  # [k, vocab]
    if draft_rows is None:
        accept_probs = target_mass
    else:
        draft_mass = draft_rows[rows, drafts]  # [k], q(x_i)
        if bool((draft_mass <= 0.0).any()):
            raise ValueError("a draft token has zero probability in draft_probs, so it was not sampled from them")
        accept_probs = (target_mass / draft_mass).clamp(max=1.0)

    # Uniforms lie in [0, 1), so a draft with p(x) == 0 is always rejected and one with p(x) >= q(x) always kept.
    accepts = torch.rand(num_drafts, generator=generator, device=probs.device) < accept_probs  # [k]
    # Only the leading run of acceptances counts: cumprod turns [1, 1, 0, 1] into [1, 1, 0, 0], which sums to 2.
    accepted = int(accepts.int().cumprod(dim=0).sum())

    if accepted == num_drafts:
        next_probs = probs[num_drafts]  # bonus token
    else:
        rejected_draft_row = None if draft_rows is None else draft_rows[accepted]
        next_probs = _residual_probs(probs[accepted], int(drafts[accepted]), rejected_draft_row)  # correction token
    next_token = int(torch.multinomial(next_probs, 1, generator=generator))
    return VerifyOutcome(accepted=accepted, tokens=[*map(int, draft_tokens[:accepted]), next_token])


def _residual_probs(
    target_row: torch.Tensor,  # [vocab], p
    rejected_token: int,
    draft_row: torch.Tensor | None,  # [vocab], q; None: one-hot at rejected_token
) -> torch.Tensor:  # [vocab]
    """norm(max(p - q, 0)), the distribution of the correction token after a rejection."""
    if draft_row is None:
        residual = target_row.clone()
        residual[rejected_token] = 0.0
    else:
        residual = (target_row - draft_row).clamp(min=0.0)
    total = residual.sum()
    if total <= 0.0:
        # max(p - q, 0) sums to zero only when p <= q everywhere, i.e. p == q since both sum to 1. Then every draft
        # is accepted with probability min(1, p/q) = 1 and this rejection has probability 0; only float rounding
        # gets here, and p, which equals q, is the distribution to fall back to.
        return target_row
    return residual / total


def verify(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    draft_tokens: Sequence[int],  # [k]
    params: SamplingParams,
    generator: torch.Generator,  # CPU, from make_generator
    draft_probs: torch.Tensor | None = None,  # [k, vocab] or None, see verify_sampled
    position: int | None = None,  # the sequence position of the token row 0 decides; None: no seeded rule
) -> VerifyOutcome:
    """Greedy verification for greedy params; for a seed (and `position`), greedy verification of the seeded scores
    (module docstring); the lossless sampled rule otherwise.

    Greedy and seeded ignore draft_probs: the target's choice is deterministic, so the draft's distribution has no
    bearing on what is committed.
    """
    if params.is_greedy:
        return verify_greedy(target_logits, draft_tokens)
    if params.seed is not None and position is not None:
        positions = range(position, position + len(draft_tokens) + 1)
        return verify_greedy(seeded_scores(target_logits, params, positions), draft_tokens)
    return verify_sampled(target_logits, draft_tokens, params, generator, draft_probs)


def _check_shapes(
    target_logits: torch.Tensor,  # [k + 1, vocab]
    num_drafts: int,
    draft_probs: torch.Tensor | None,  # [k, vocab]
) -> None:
    if target_logits.dim() != 2 or target_logits.shape[0] != num_drafts + 1:
        raise ValueError(
            f"target_logits must be [num_drafts + 1, vocab] with num_drafts = {num_drafts}, "
            f"got {list(target_logits.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, target_logits.shape[1]):
        raise ValueError(
            f"draft_probs must be [num_drafts, vocab] = [{num_drafts}, {target_logits.shape[1]}], "
            f"got {list(draft_probs.shape)}"
        )


def seeded_scores(
    target_logits: torch.Tensor,  # [rows, vocab]
    params: SamplingParams,  # with a seed, not greedy
    positions: Sequence[int],  # [rows]: the sequence position of the token each row decides
) -> torch.Tensor:  # [rows, vocab] float32: log p + Gumbel noise; the argmax of a row is its token
    """Scores whose row argmax is a sample of the target distribution, keyed by (seed, position) (module docstring)."""
    assert params.seed is not None
    log_probs = target_probs(target_logits.cpu(), params).log()  # -inf where top-k, top-p or a mask left nothing
    generator = torch.Generator(device="cpu")
    noise = []
    for position in positions:
        generator.manual_seed(_noise_key(params.seed, position))
        uniform = torch.rand(log_probs.shape[-1], generator=generator, device="cpu")
        uniform = uniform.clamp_(min=torch.finfo(torch.float32).tiny)
        noise.append(-torch.log(-torch.log(uniform)))
    return log_probs + torch.stack(noise)


def _noise_key(seed: int, position: int) -> int:
    """A 64-bit generator seed of (seed, position), the same in every process and on every machine."""
    digest = hashlib.blake2b(f"tandem-gumbel/{seed}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def make_generator(params: SamplingParams) -> torch.Generator:
    """A CPU generator seeded from params.seed, or from fresh entropy when the seed is None.

    Sampling draws on the CPU so that a seed gives the same tokens whatever device the logits came from.
    """
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator
