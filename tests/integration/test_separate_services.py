"""Target, draft and orchestrator started one by one, as a deployment runs them, each with its own /metrics (target
and draft on --metrics-port, the orchestrator on its HTTP port), read with prometheus_client's parser: the values
move as requests run and complete, and the two sides of each Propose agree. Also: an EOS id that only the target's
generation_config.json names ends requests; a demoted replica is counted with the requests it lost; a full queue and
a hung target answer 429 and 503 over HTTP with the request's X-Request-Id.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.grpc_util import channel_options
from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.helpers.checkpoints import EOS_TOKEN_ID
from tests.integration.stack import Service, generate, service, tandem_command
from tests.integration.test_greedy_equivalence import reference_greedy

PROMPT = "def parse(text):"
MODEL = "tiny"
TARGET_TIMEOUT = "3"
DRAFT_TIMEOUT = "1"
WAIT_S = 60.0
METRICS_LINE = re.compile(r"(target|draft) metrics on (\S+)")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Stack:
    target: Service
    draft: Service
    orchestrator: Service
    urls: dict[str, str]  # role -> its /metrics URL: "target", "draft", "orchestrator"
    client: openai.OpenAI
    extra_eos: int  # an id the target's generation_config.json names as EOS, which config.json does not
    reference: list[int]  # greedy tokens of PROMPT, EOS ignored


def extra_eos_id(reference: list[int]) -> int:
    """A token of the greedy reference, past its first two, that appears there first and after no EOS."""
    for index, token in enumerate(reference):
        if index >= 2 and token not in reference[:index] and EOS_TOKEN_ID not in reference[: index + 1]:
            return token
    raise AssertionError(f"no token fits as an extra EOS id in {reference}")


def target_copy(source: Path, directory: Path, eos_ids: list[int]) -> Path:
    """The target's files (linked), with a generation_config.json naming `eos_ids`."""
    directory.mkdir()
    for path in source.iterdir():
        if path.name != "generation_config.json":
            (directory / path.name).symlink_to(path)
    (directory / "generation_config.json").write_text(f'{{"eos_token_id": {eos_ids}}}')
    return directory


def metrics_url(log: list[str], role: str) -> str:
    for line in log:
        if (found := METRICS_LINE.search(line)) and found.group(1) == role:
            return found.group(2)
    raise AssertionError(f"no {role} metrics line in:\n{''.join(log)}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, llama_target: Path, random_draft: Path) -> Iterator[Stack]:
    reference = reference_greedy(llama_target, PROMPT, 24)
    extra_eos = extra_eos_id(reference)
    workdir = tmp_path_factory.mktemp("separate")
    target_dir = target_copy(llama_target, workdir / "target-model", [EOS_TOKEN_ID, extra_eos])
    common = ["--port", "0", "--metrics-port", "0", "--orphan-timeout", "2"]
    with service("target", tandem_command("target", "--model", str(target_dir), *common), workdir) as target:
        draft_arguments = ["draft", "--model", str(random_draft), "--target-address", target.address, *common]
        draft_arguments += ["--replica-id", "draft-0", "--speculative-num-steps", "3"]
        with service("draft", tandem_command(*draft_arguments), workdir) as draft:
            http_ready = workdir / "http.url"
            arguments = ["orchestrator", "--target-address", target.address, "--draft-address", draft.address]
            arguments += ["--tokenizer", str(target_dir), "--speculative-num-steps", "3", "--no-adaptive-k"]
            arguments += ["--port", "0", "--admin-port", "0", "--http-port", "0", "--http-ready-file", str(http_ready)]
            arguments += ["--served-model-name", MODEL]
            # One request runs at a time and one waits: a third finds the queue full.
            arguments += ["--max-num-seqs", "1", "--max-waiting", "1"]
            # A hung target: its step times out after 3 s, then the requests wait 2 s for it before they fail.
            arguments += ["--target-timeout", TARGET_TIMEOUT, "--target-wait", "2", "--draft-timeout", DRAFT_TIMEOUT]
            with service("orchestrator", tandem_command(*arguments), workdir) as orchestrator:
                http_url = http_ready.read_text().strip()
                urls = {
                    "target": metrics_url(target.log, "target"),
                    "draft": metrics_url(draft.log, "draft"),
                    "orchestrator": f"{http_url}/metrics",
                }
                client = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=120)
                yield Stack(target, draft, orchestrator, urls, client, extra_eos, reference)


def scrape(url: str) -> Samples:
    """Every sample, keyed by (sample name, sorted labels without model_name)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.1)


def idle(stack: Stack) -> bool:
    """Nothing held on target and draft (a request is released after its last message reaches the client)."""
    target, draft = scrape(stack.urls["target"]), scrape(stack.urls["draft"])
    held = ("tandem:target_running_requests", "tandem:target_kv_cache_usage_perc")
    return all(value(target, name) == 0 for name in held) and value(draft, "tandem:draft_running_requests") == 0


def test_each_service_metrics_move_as_requests_run_and_complete(stack: Stack) -> None:
    wait_for(lambda: idle(stack), "target and draft idle")
    before = {role: scrape(url) for role, url in stack.urls.items()}

    with grpc.insecure_channel(stack.orchestrator.address, options=channel_options()) as channel:
        request = orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=400, ignore_eos=True)
        call = orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=300)
        next(call)  # the request runs: it holds KV on the target and state on the draft
        running = {role: scrape(url) for role, url in stack.urls.items()}
        call.cancel()
    assert value(running["target"], "tandem:target_running_requests") == 1
    assert value(running["target"], "tandem:target_kv_cache_usage_perc") > 0
    assert value(running["orchestrator"], "vllm:num_requests_running") == 1
    assert value(running["orchestrator"], "tandem:replica_requests", replica="draft-0") == 1
    wait_for(lambda: idle(stack), "the cancelled request released")

    completions = [generate(stack.orchestrator.address, prompt=PROMPT, max_new_tokens=20, ignore_eos=True)]
    completions.append(generate(stack.orchestrator.address, prompt="import os\n", max_new_tokens=12, ignore_eos=True))
    after = {role: scrape(url) for role, url in stack.urls.items()}

    def delta(role: str, name: str, **labels: str) -> float:
        return value(after[role], name, **labels) - value(before[role], name, **labels)

    stats = [completion.stats for completion in completions]
    assert delta("orchestrator", "vllm:generation_tokens_total") >= sum(s.completion_tokens for s in stats) == 32
    assert delta("orchestrator", "vllm:request_success_total", finished_reason="length") == 2
    assert delta("orchestrator", "vllm:request_success_total", finished_reason="abort") == 1
    messages = sum(completion.messages for completion in completions)
    assert delta("orchestrator", "vllm:inter_token_latency_seconds_count") >= messages - len(completions)
    assert delta("orchestrator", "tandem:rounds_total") >= sum(s.rounds for s in stats)
    for part in ("draft", "verify", "wire", "scheduling"):
        assert delta("orchestrator", "tandem:round_seconds_total", part=part) > 0
    assert value(after["orchestrator"], "tandem:acceptance_collapsed") == 0  # no interval closed yet
    # Every step of the three requests is one timed target step; every Propose one timed proposal on the draft,
    # which the orchestrator counts too, and for each the draft timed its wait for the target's hidden rows.
    assert delta("target", "tandem:target_step_seconds_count") >= sum(s.rounds for s in stats) > 0
    assert delta("target", "tandem:target_step_seconds_sum") > 0
    proposals = delta("draft", "tandem:draft_propose_seconds_count")
    assert proposals == delta("orchestrator", "tandem:propose_seconds_count", replica="draft-0") > 0
    assert delta("draft", "tandem:draft_hidden_rows_wait_seconds_count") == proposals
    waited = delta("draft", "tandem:draft_hidden_rows_wait_seconds_sum")
    assert 0 <= waited < proposals * float(DRAFT_TIMEOUT)  # a wait as long as the call's deadline would fail it
    assert delta("draft", "tandem:draft_hidden_rows_wait_seconds_bucket", le="+Inf") == proposals
    wait_for(lambda: idle(stack), "the finished requests released")
    for role in ("target", "draft"):
        assert value(scrape(stack.urls[role]), f"tandem:{role}_pending_calls") == 0


def test_an_eos_id_from_generation_config_ends_requests(stack: Stack) -> None:
    reference = generate(stack.orchestrator.address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True)
    assert reference.token_ids == stack.reference  # the stack's greedy output is transformers'
    ending = stack.reference.index(stack.extra_eos) + 1
    ended = generate(stack.orchestrator.address, prompt=PROMPT, max_new_tokens=24)
    assert ended.finish_reason == "eos"
    assert ended.token_ids == stack.reference[:ending]
    over_http = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert over_http.choices[0].finish_reason == "stop"  # the OpenAI API's name for an end of sequence
    assert over_http.usage is not None and over_http.usage.completion_tokens == ending
    assert over_http.choices[0].text == ended.text


def test_a_demoted_replica_is_counted_with_the_requests_it_lost(stack: Stack) -> None:
    before = scrape(stack.urls["orchestrator"])
    finished: list[list[int]] = []
    with grpc.insecure_channel(stack.orchestrator.address, options=channel_options()) as channel:
        request = orchestrator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=24, ignore_eos=True)
        call = orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=300)
        first = next(call)
        os.kill(stack.draft.process.pid, signal.SIGSTOP)
        try:
            finished = [list(first.token_ids), *(list(response.token_ids) for response in call)]
            during = scrape(stack.urls["orchestrator"])
        finally:
            os.kill(stack.draft.process.pid, signal.SIGCONT)
    assert [token for tokens in finished for token in tokens] == stack.reference  # moved to target-only, unchanged
    assert value(during, "tandem:replica_failures_total") - value(before, "tandem:replica_failures_total") == 1
    assert value(during, "tandem:request_reassigns_total") - value(before, "tandem:request_reassigns_total") == 1
    assert value(during, "tandem:draft_replicas", state="demoted") == 1
    wait_for(
        lambda: value(scrape(stack.urls["orchestrator"]), "tandem:draft_replicas", state="serving") == 1,
        "the replica serves again",
    )


def http_error(stack: Stack, request_id: str) -> openai.APIStatusError:
    """The error a greedy completion ends with, sent with X-Request-Id `request_id`."""
    with pytest.raises(openai.APIStatusError) as caught:
        stack.client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Request-Id": request_id},
        )
    return caught.value


def test_a_full_queue_is_429_and_a_hung_target_503_both_with_the_request_id(stack: Stack) -> None:
    errors: dict[str, openai.APIStatusError] = {}

    def send(request_id: str) -> threading.Thread:
        thread = threading.Thread(target=lambda: errors.update({request_id: http_error(stack, request_id)}))
        thread.start()
        return thread

    def gauge(name: str) -> float:
        return value(scrape(stack.urls["orchestrator"]), name)

    os.kill(stack.target.process.pid, signal.SIGSTOP)
    try:
        running = send("trace-running")
        wait_for(lambda: gauge("vllm:num_requests_running") == 1, "the first request in a step")
        waiting = send("trace-waiting")
        wait_for(lambda: gauge("vllm:num_requests_waiting") == 1, "the second request waiting")
        full = http_error(stack, "trace-full")
        running.join(timeout=WAIT_S)
        waiting.join(timeout=WAIT_S)
    finally:
        os.kill(stack.target.process.pid, signal.SIGCONT)
    assert full.status_code == 429
    assert full.response.headers["x-request-id"] == "trace-full"
    assert isinstance(full.body, dict) and full.body["type"] == "rate_limit_error"
    assert "--max-waiting" in full.body["message"]
    for request_id in ("trace-running", "trace-waiting"):
        error = errors[request_id]
        assert error.status_code == 503, error
        assert error.response.headers["x-request-id"] == request_id
        assert isinstance(error.body, dict) and error.body["type"] == "service_unavailable"
        assert "target step" in error.body["message"]
    log = "".join(stack.orchestrator.log)
    assert "(client id trace-running)" in log  # the client's id names the request in the orchestrator's log
    # The target answers again: the stack serves on.
    wait_for(lambda: idle(stack), "target and draft idle")
    completion = stack.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
