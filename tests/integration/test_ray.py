"""`tandem serve --launcher ray` on a machine of two CPUs.

Same greedy outputs as target-only decoding through the same stack, a clean stop on SIGTERM (orchestrator,
drafts, target in that order, every actor process gone), and killed actors started again as new actors at their
addresses, with the stack serving the same tokens after. The local cluster holds a stack that
asks Ray for more CPUs than the machine has; a joined cluster without room is refused at once, naming why.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import openai
import pytest

from launch.processes import ServeProcess
from tests.helpers.dflash_checkpoints import TinyDFlashSpec, write_tiny_dflash
from tests.integration.stack import Completion, generate, run_to_exit, serve
from tests.integration.test_greedy_equivalence import reference_greedy

RAY = ("--launcher", "ray")
PROMPTS = ["def fibonacci(n):", "The quick brown fox"]
MAX_NEW_TOKENS = 16
GONE_TIMEOUT_S = 20.0

# Not anchored at the line start: the launcher's line can land after half of a forwarded actor line.
SERVING = re.compile(r"tandem serve: (\S+) serving on (\S+) \(Ray actor, pid (\d+) on node ")
RANK1_LINE = re.compile(r"\(target-rank1 pid=(\d+)\)")
ENDED = re.compile(r"tandem serve: (\S+) (stopped|died .*)$")
LOG_TIMEOUT_S = 10.0
NO_ROOM_TIMEOUT_S = 60.0  # it is refused within seconds: Ray's start-up and one look at the free resources

# A Ray cluster of one CPU for a test to join: its driver prints the address, then holds the cluster until its
# stdin closes, and ends it on the way out (`ray stop` would end every Ray cluster on the machine).
ONE_CPU_HEAD = """
import sys
import ray
ray.init(address="local", num_cpus=1, num_gpus=0, include_dashboard=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


@pytest.fixture(autouse=True)
def two_cpus() -> Iterator[None]:
    """`tandem serve` sizes its local Ray cluster by the CPUs it may run on; two here, on any machine."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:2])
    yield
    os.sched_setaffinity(0, allowed)


def serving(log: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Each service's address and actor pid, from the launcher's own lines."""
    return {m.group(1): (m.group(2), int(m.group(3))) for m in map(SERVING.search, log) if m}


def endings(stack: ServeProcess, count: int) -> list[tuple[str, str]]:
    """The launcher's lines on how services ended, in the order it printed them; waits for `count` of them."""
    deadline = time.monotonic() + LOG_TIMEOUT_S
    while len(found := [(m.group(1), m.group(2)) for m in map(ENDED.search, list(stack.log)) if m]) < count:
        assert time.monotonic() < deadline, "".join(stack.log)
        time.sleep(0.1)  # the output pump may still be reading what the stopped process wrote
    return found


def is_running(pid: int) -> bool:
    """False once the process is gone or a zombie (exited, not yet reaped by whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def accepts_connections(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return False
    return True


def wait_until_gone(pids: Sequence[int], addresses: Sequence[str]) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while any(map(is_running, pids)) or any(map(accepts_connections, addresses)):
        assert time.monotonic() < deadline, "actor processes or their ports outlived tandem serve"
        time.sleep(0.2)


def greedy(address: str, disable_speculation: bool) -> list[Completion]:
    return [
        generate(
            address,
            prompt=prompt,
            max_new_tokens=MAX_NEW_TOKENS,
            ignore_eos=True,
            disable_speculation=disable_speculation,
        )
        for prompt in PROMPTS
    ]


def test_speculative_equals_target_only_killed_actors_start_again_and_sigterm_stops_every_actor(
    llama_target: Path, random_draft: Path
) -> None:
    arguments = (*RAY, "--draft-replicas", "2", "--speculative-num-steps", "3")
    with serve(llama_target, random_draft, *arguments) as stack:
        speculative = greedy(stack.address, disable_speculation=False)
        target_only = greedy(stack.address, disable_speculation=True)
        first = serving(stack.log)
        for _, pid in first.values():  # the job's runtime_env: tandem.settings.SERVICE_ENVIRONMENT
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"GOMP_SPINCOUNT=" + os.environ.get("GOMP_SPINCOUNT", "10000").encode() in environment
        # The orchestrator's actor serves the OpenAI-compatible HTTP API too, the same text as Generate.
        assert stack.http_url.startswith("http://127.0.0.1:"), "".join(stack.log)
        http = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
        expected = generate(stack.address, prompt="def main():", max_new_tokens=8, ignore_eos=True)
        served = http.completions.create(
            model=http.models.list().data[0].id,
            prompt="def main():",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert served.choices[0].text == expected.text
        for name, count in (("draft-0", 1), ("target", 2)):
            os.kill(first[name][1], signal.SIGKILL)
            ended, reason = endings(stack, count)[-1]
            assert ended == name and reason.startswith("died with its Ray actor"), reason
            assert reason.endswith("; starting it again at its address in 1 s"), reason
            again = started_again(stack, name)
            assert again[0] == first[name][0] and again[1] != first[name][1]  # its address, a new actor
            # Serving goes on with the same tokens (requests wait for a target; a replica rejoins on its probe).
            completion = generate(stack.address, prompt="def main():", max_new_tokens=8, ignore_eos=True)
            assert completion.token_ids == expected.token_ids
        assert stack.stop() == 0
    assert [c.token_ids for c in speculative] == [c.token_ids for c in target_only]
    assert all(len(c.token_ids) == MAX_NEW_TOKENS for c in speculative)
    assert all(c.stats.draft_tokens > 0 for c in speculative)  # the draft actors did propose
    assert any("(speculative, 2 draft replicas, 4 Ray actors)" in line for line in stack.log)
    assert list(first) == ["target", "draft-0", "draft-1", "orchestrator"]
    assert first["orchestrator"][0] == stack.address
    assert len({pid for _, pid in first.values()}) == 4  # one process per actor
    # Each death reported when noticed; then every service, as stop() found it on the way out: each stop returns
    # once that service's graceful shutdown has finished, so this is the order they ran in.
    ended = endings(stack, 6)
    assert [name for name, _ in ended[:2]] == ["draft-0", "target"]
    assert ended[2:] == [
        ("orchestrator", "stopped"),
        ("draft-1", "stopped"),
        ("draft-0", "stopped"),
        ("target", "stopped"),
    ]
    services = serving(stack.log)
    wait_until_gone([pid for _, pid in services.values()], [address for address, _ in services.values()])


def started_again(stack: ServeProcess, name: str) -> tuple[str, int]:
    """The address and pid of `name`'s second actor, once the launcher says it serves."""
    deadline = time.monotonic() + 120
    while len(found := [m.groups()[1:] for m in map(SERVING.search, list(stack.log)) if m and m[1] == name]) < 2:
        assert time.monotonic() < deadline, "".join(stack.log)
        time.sleep(0.1)
    return found[1][0], int(found[1][1])


def test_tensor_parallel_target_and_two_block_drafters_on_two_cpus(llama_target: Path, tmp_path: Path) -> None:
    """Two replicas of a DFlash drafter (random; block 4, so 3 drafts a round by default) pull the target's tables
    from the two ranks' vocab-parallel shards."""
    # Two rank bundles of a CPU and two replicas of half a CPU ask for three: the local cluster counts three.
    expected = [reference_greedy(llama_target, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    draft = write_tiny_dflash(tmp_path / "dflash", llama_target, TinyDFlashSpec(target_layer_ids=(0, 2, 5)))
    arguments = (*RAY, "--tp", "2", "--draft-replicas", "2", "--no-adaptive-k")
    with serve(llama_target, draft, *arguments) as stack:
        completions = greedy(stack.address, disable_speculation=False)
        services = serving(stack.log)
        assert stack.stop() == 0
    assert [c.token_ids for c in completions] == expected
    # More than 2 drafts a round on average: whole blocks of 3 (the last rounds ask only for the tokens left).
    assert all(c.stats.draft_tokens > 2 * c.stats.rounds for c in completions)
    assert any("starting a local Ray cluster of 3 CPUs: this process may run on 2," in line for line in stack.log)
    assert any("(speculative, 2 draft replicas, 5 Ray actors)" in line for line in stack.log)
    assert list(services) == ["target", "draft-0", "draft-1", "orchestrator"]  # rank 1 serves nothing
    rank1_pids = {int(m.group(1)) for m in map(RANK1_LINE.search, stack.log) if m}
    assert len(rank1_pids) == 1 and rank1_pids.isdisjoint(pid for _, pid in services.values())
    assert any("rank 1/2 joined the group" in line for line in stack.log)
    pids = [*rank1_pids, *(pid for _, pid in services.values())]
    wait_until_gone(pids, [address for address, _ in services.values()])


def test_joined_cluster_without_room_is_refused_naming_what_was_asked_and_what_is_free(
    llama_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster that ray.init starts takes token authentication by default, but a driver that joins one at an
    # explicit address only uses the token (~/.ray/auth_token) when told to, as a user joining it would be.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    head = subprocess.Popen(
        [sys.executable, "-c", ONE_CPU_HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert head.stdout is not None
        address = head.stdout.readline().strip()
        assert address, "the one-CPU Ray head did not start"
        arguments = ["serve", *RAY, "--ray-address", address, "--target", str(llama_target), "--tp", "2"]
        result = run_to_exit([*arguments, "--port", "0"], timeout_s=NO_ROOM_TIMEOUT_S)
    finally:
        assert head.stdin is not None
        head.stdin.close()
        head.wait(timeout=60)
    assert result.returncode == 1, result.stdout
    asked = "asked target placement group: 2 bundles of 1 CPU on one node (2 CPU in all); 1 CPU free of 1\n"
    assert f"tandem serve: the Ray cluster has no room for this stack: {asked}" in result.stdout
    assert "Traceback" not in result.stdout and "tandem ready" not in result.stdout
