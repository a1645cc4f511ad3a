"""The target's /metrics (`--metrics-port`): a real TargetRunner behind TargetService, scraped over HTTP and read
with prometheus_client's parser."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.model_thread import ModelThread
from tandem.models.registry import load_target
from tandem.service_metrics import serve_metrics
from tandem.wire import common_pb2, target_pb2
from target_server.main import target_metrics
from target_server.runner import TargetRunner
from target_server.service import TargetService
from tests.helpers.checkpoints import TinyTargetSpec, write_tiny_target
from tests.unit.test_runners import BLOCK_SIZE, CACHE, PROMPT


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def test_target_metrics_follow_its_steps(target_dir: Path) -> None:
    model_thread = ModelThread("test-target")
    runner = TargetRunner(model_thread.call(load_target, target_dir), CACHE, max_context=64)
    service = TargetService(runner, target_pb2.TargetInfo(), model_thread, orphan_timeout_s=30.0)
    server, url = serve_metrics(target_metrics(service), "127.0.0.1", 0)
    try:
        before = scrape(url)
        assert before["tandem:target_step_seconds_count"] == 0
        assert before["tandem:target_running_requests"] == 0
        assert before["tandem:target_kv_cache_usage_perc"] == 0.0
        opening = target_pb2.StepItem(
            request_id="a",
            num_tokens=len(PROMPT),
            open=target_pb2.OpenRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams()),
        )
        response = asyncio.run(service._step(target_pb2.StepRequest(items=[opening]), session=""))
        assert not response.results[0].HasField("error")
        after = scrape(url)
        assert after["tandem:target_step_seconds_count"] == 1
        assert after["tandem:target_step_seconds_sum"] == pytest.approx(response.compute_seconds)
        assert after["tandem:target_running_requests"] == 1
        used = -(-len(PROMPT) // BLOCK_SIZE)
        assert after["tandem:target_kv_cache_usage_perc"] == pytest.approx(used / CACHE.num_blocks)
        assert after["tandem:target_pending_calls"] == 0
    finally:
        server.shutdown()
        model_thread.shutdown()
