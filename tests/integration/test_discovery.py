"""`tandem orchestrator --draft-dns`: with no --draft-address, the draft replica is found through real DNS."""

from __future__ import annotations

import time
from pathlib import Path

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
