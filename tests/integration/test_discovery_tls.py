"""Draft discovery with mutual TLS: the certificates name "localhost" only, while discovery dials the addresses
"localhost" resolves to (127.0.0.1). `--tls-server-name localhost` makes the found replica join; without it the
replica's certificate fails the check and it never joins."""

from __future__ import annotations

import time
from pathlib import Path

from tandem.certificates import make_certificates
from tests.integration.stack import READY_TIMEOUT_S, Service, generate, service, tandem_command

PROMPT = "def parse(text):\n    return"


def wait_for_line(process: Service, text: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any(text in line for line in process.log):
        assert time.monotonic() < deadline, f"{text!r} not in:\n{''.join(process.log)}"
        time.sleep(0.2)


def test_discovered_drafts_are_checked_for_the_server_name(
    tmp_path: Path, llama_target: Path, random_draft: Path
) -> None:
    files = make_certificates(tmp_path, common_name="draft", dns_names=("localhost",), ip_addresses=())
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]
    target_arguments = tandem_command("target", "--model", str(llama_target), "--port", "0", *tls)
    with service("target", target_arguments, tmp_path) as target:
        target_port = target.address.rpartition(":")[2]
        target_address = f"localhost:{target_port}"  # the name its certificate holds
        draft_arguments = ["draft", "--model", str(random_draft), "--target-address", target_address]
        draft_arguments += ["--replica-id", "draft-tls", "--port", "0", *tls]
        with service("draft", tandem_command(*draft_arguments), tmp_path) as draft:
            port = draft.address.rpartition(":")[2]
            orchestrator_arguments = ["orchestrator", "--target-address", target_address, *tls]
            orchestrator_arguments += ["--tokenizer", str(llama_target), "--speculative-num-steps", "3"]
            orchestrator_arguments += ["--draft-dns", f"localhost:{port}", "--draft-dns-interval", "0.5"]
            orchestrator_arguments += ["--admin-port", "0", "--port", "0", "--public-plaintext", "--no-adaptive-k"]
            named = [*orchestrator_arguments, "--tls-server-name", "localhost"]
            with service("named", tandem_command(*named), tmp_path) as orchestrator:
                wait_for_line(orchestrator, f"draft replica draft-tls at 127.0.0.1:{port} joined (found by DNS)")
                completion = generate(orchestrator.address, prompt=PROMPT, max_new_tokens=16, ignore_eos=True)
                assert completion.stats.draft_tokens > 0
            with service("unnamed", tandem_command(*orchestrator_arguments), tmp_path) as unnamed:
                wait_for_line(unnamed, f"no draft replica answers at 127.0.0.1:{port} yet")
                log = "".join(unnamed.log)
    assert "joined (found by DNS)" not in log
