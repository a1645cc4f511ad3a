"""The demo's measurement (bench/quickstart.py): modes interleaved in rotating order, rates, and the same-tokens
check, with a stand-in for the stack and transformers."""

from __future__ import annotations

import asyncio

from bench.quickstart import MODES, SPECULATIVE, TARGET_ONLY, TRANSFORMERS, Completion, measure, summary

SECONDS = {SPECULATIVE: 0.5, TARGET_ONLY: 1.0, TRANSFORMERS: 2.0}  # for 64 tokens


class FakeDemo:
    def __init__(self, differ_on: str | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.differ_on = differ_on

    async def run(self, mode: str, prompt: str, max_new_tokens: int) -> Completion:
        self.calls.append((mode, prompt))
        tokens = tuple(range(max_new_tokens))
        if mode == self.differ_on and prompt == "b":
            tokens = (*tokens[:-1], 999)
        return tokens, SECONDS[mode] * max_new_tokens / 64


def test_every_mode_is_warmed_then_measured_in_a_rotating_order() -> None:
    demo = FakeDemo()
    rates, same = asyncio.run(measure(demo, ["a", "b", "c"], 64))  # type: ignore[arg-type]
    assert [mode for mode, _ in demo.calls[:3]] == list(MODES)  # the warm-up
    measured = demo.calls[3:]
    assert [mode for mode, prompt in measured if prompt == "a"] == [SPECULATIVE, TARGET_ONLY, TRANSFORMERS]
    assert [mode for mode, prompt in measured if prompt == "b"] == [TARGET_ONLY, TRANSFORMERS, SPECULATIVE]
    assert [mode for mode, prompt in measured if prompt == "c"] == [TRANSFORMERS, SPECULATIVE, TARGET_ONLY]
    assert rates == {SPECULATIVE: [128.0] * 3, TARGET_ONLY: [64.0] * 3, TRANSFORMERS: [32.0] * 3}
    assert same
    lines = summary(rates, same)
    assert "speculation over target only: 2.00x (range 2.00x-2.00x)" in lines
    assert "speculation over transformers greedy: 4.00x (range 4.00x-4.00x)" in lines
    assert lines[-1] == "greedy tokens identical in the three modes: yes"


def test_a_mode_whose_tokens_differ_is_reported() -> None:
    rates, same = asyncio.run(measure(FakeDemo(differ_on=SPECULATIVE), ["a", "b"], 64))  # type: ignore[arg-type]
    assert not same
    assert summary(rates, same)[-1] == "greedy tokens identical in the three modes: NO"
