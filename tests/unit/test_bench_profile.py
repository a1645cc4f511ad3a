"""bench.profile: py-spy's raw stacks sorted into phases, and a process's time on and off the cores."""

from __future__ import annotations

import os
import time
from collections import Counter

from bench.profile import OTHER, Profile, phase_of, read_raw, schedstat

MODEL_CALL = (
    "_run_once (asyncio/base_events.py:1922);step (target_server/runner.py:88);"
    "forward (tandem/models/stack.py:120);forward (torch/nn/modules/linear.py:125)"
)


def test_a_stack_takes_the_phase_of_its_innermost_named_frame() -> None:
    assert phase_of(MODEL_CALL) == "model forward"  # the linear layer, not the event loop around it
    attention = "forward (tandem/models/stack.py:120);forward (tandem/layers/attention_backend.py:40)"
    assert phase_of(attention) == "attention and KV paging"
    assert phase_of("run (threading.py:1010);_encode (google/protobuf/internal/encoder.py:7)") == "serialization"
    assert phase_of("_run_once (asyncio/base_events.py:1922);plan (orchestrator/loop/batching.py:170)") == "scheduling"
    assert phase_of("<module> (launch/cli.py:3);main (tandem/flags.py:12)") == OTHER


def test_raw_lines_are_summed_by_phase() -> None:
    raw = f"{MODEL_CALL} 7\n{MODEL_CALL};relu (torch/nn/functional.py:1) 3\nmain (somewhere.py:1) 2\n\n"
    assert read_raw(raw) == {"model forward": 10, OTHER: 2}


def test_a_process_time_on_a_core_is_split_by_its_phases_shares() -> None:
    profile = Profile("target-only", tokens=50, on_core={"target": 0.5})
    profile.phases["target"] = Counter({"model forward": 30, "scheduling": 10})
    assert profile.ms_per_token("target") == 10.0  # 0.5 s over 50 tokens
    assert profile.ms_per_token("target", "model forward") == 7.5
    assert profile.ms_per_token("target", "gRPC") == 0.0
    assert profile.ms_per_token("draft", "model forward") == 0.0  # a process not measured


def test_schedstat_counts_this_process_on_a_core() -> None:
    on_core, waiting = schedstat(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    later, waited = schedstat(os.getpid())
    assert later - on_core >= 0.15 and waited >= waiting >= 0.0
