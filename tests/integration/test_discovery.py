"""`tandem orchestrator --draft-dns`: with no --draft-address, the draft replica is found through real DNS, and
AddReplica takes an address the name resolves to (and no other)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from tandem.wire import orchestrator_pb2, orchestrator_pb2_grpc
from tests.integration.stack import READY_TIMEOUT_S, generate, service, tandem_command, target_process

PROMPT = "def parse(text):\n    return"


def test_orchestrator_finds_its_draft_by_dns(tmp_path: Path, llama_target: Path, random_draft: Path) -> None:
    with target_process(llama_target, 1, tmp_path / "target.address") as target:
        draft_arguments = ["draft", "--model", str(random_draft), "--target-address", target.address]
        draft_arguments += ["--replica-id", "draft-dns"]
        with service("draft", tandem_command(*draft_arguments, "--port", "0"), tmp_path) as draft:
            host, _, port = draft.address.rpartition(":")
            assert host == "127.0.0.1"
            orchestrator_arguments = ["orchestrator", "--target-address", target.address]
            orchestrator_arguments += ["--tokenizer", str(llama_target), "--speculative-num-steps", "3"]
            # "localhost" resolves through the system resolver (/etc/hosts) to 127.0.0.1, maybe also ::1.
            orchestrator_arguments += ["--draft-dns", f"localhost:{port}", "--draft-dns-interval", "0.5"]
            orchestrator_arguments += ["--admin-port", "0", "--no-adaptive-k"]
            orchestrator_arguments += ["--port", "0"]
            with service("orchestrator", tandem_command(*orchestrator_arguments), tmp_path) as orchestrator:
                address = orchestrator.address
                # The orchestrator serves before discovery's first pass has connected: requests run target-only
                # until the replica joins, then speculate.
                deadline = time.monotonic() + READY_TIMEOUT_S
                while True:
                    speculative = generate(address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True)
                    if speculative.stats.draft_tokens > 0:
                        break
                    assert time.monotonic() < deadline, "".join(orchestrator.log)
                    time.sleep(0.2)
                target_only = generate(
                    address, prompt=PROMPT, max_new_tokens=24, ignore_eos=True, disable_speculation=True
                )
                log = "".join(orchestrator.log)
    assert speculative.token_ids == target_only.token_ids
    assert target_only.stats.draft_tokens == 0
    assert f"draft replica draft-dns at 127.0.0.1:{port} joined (found by DNS)" in log


def test_add_replica_takes_an_address_the_draft_dns_name_resolves_to(
    tmp_path: Path, llama_target: Path, random_draft: Path
) -> None:
    with target_process(llama_target, 1, tmp_path / "target.address") as target:
        draft_arguments = ["draft", "--model", str(random_draft), "--target-address", target.address]
        draft_arguments += ["--replica-id", "draft-dns"]
        with service("draft", tandem_command(*draft_arguments, "--port", "0"), tmp_path) as draft:
            port = draft.address.rpartition(":")[2]
            orchestrator_arguments = ["orchestrator", "--target-address", target.address]
            orchestrator_arguments += ["--tokenizer", str(llama_target), "--speculative-num-steps", "3"]
            # One pass at start, the next in an hour: whatever joins after the first pass joined through AddReplica.
            orchestrator_arguments += ["--draft-dns", f"localhost:{port}", "--draft-dns-interval", "3600"]
            admin_ready_file = tmp_path / "admin.address"
            orchestrator_arguments += ["--admin-port", "0", "--admin-ready-file", str(admin_ready_file)]
            orchestrator_arguments += ["--no-adaptive-k", "--port", "0"]
            with service("orchestrator", tandem_command(*orchestrator_arguments), tmp_path) as orchestrator:
                with grpc.insecure_channel(admin_ready_file.read_text().strip()) as channel:
                    admin = orchestrator_pb2_grpc.OrchestratorAdminStub(channel)
                    listing = orchestrator_pb2.ListReplicasRequest()
                    deadline = time.monotonic() + READY_TIMEOUT_S
                    while not admin.ListReplicas(listing).replicas:  # the first pass connects in the background
                        assert time.monotonic() < deadline, "".join(orchestrator.log)
                        time.sleep(0.2)
                    found = f"127.0.0.1:{port}"
                    assert admin_code(admin, found) == (
                        grpc.StatusCode.ALREADY_EXISTS,
                        f"address: {found} is already in the pool",
                    )
                    # Neither allow-listed nor resolved from the name: refused before any connection.
                    code, details = admin_code(admin, f"192.0.2.1:{port}")
                    assert code == grpc.StatusCode.PERMISSION_DENIED
                    assert details.endswith("allow it with --allow-draft-address (or have --draft-dns resolve to it)")
                    admin.RemoveReplica(orchestrator_pb2.RemoveReplicaRequest(replica_id="draft-dns"), timeout=60)
                    assert not admin.ListReplicas(listing).replicas
                    added = admin.AddReplica(orchestrator_pb2.AddReplicaRequest(address=found), timeout=60)
                    assert (added.replica_id, added.address, added.state) == ("draft-dns", found, "serving")
                completion = generate(orchestrator.address, prompt=PROMPT, max_new_tokens=8, ignore_eos=True)
                log = "".join(orchestrator.log)
    assert completion.stats.draft_tokens > 0  # the re-added replica drafts
    assert log.count(f"draft replica draft-dns at {found} joined (found by DNS)") == 2


def admin_code(admin: orchestrator_pb2_grpc.OrchestratorAdminStub, address: str) -> tuple[grpc.StatusCode, str]:
    """The refusal of AddReplica(address): its status code and details."""
    try:
        admin.AddReplica(orchestrator_pb2.AddReplicaRequest(address=address), timeout=60)
    except grpc.RpcError as error:
        failed: Any = error  # a grpc.Call as well
        return failed.code(), failed.details()
    raise AssertionError(f"AddReplica({address}) was accepted")
