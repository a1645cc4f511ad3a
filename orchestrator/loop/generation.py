"""The one path from a public request to its stream of outputs; the gRPC and HTTP front ends are thin shells over it.

Both front ends express a request as the public GenerateRequest (the HTTP API translates OpenAI's fields into it), so
the same request gives the same tokens on both, and each front end only maps the outcomes below to its own errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

from orchestrator.loop.batching import ActiveRequest
from orchestrator.loop.metrics import Metrics
from orchestrator.loop.output import Output, RequestFailed, ShuttingDown
from orchestrator.loop.scheduler import Scheduler
from orchestrator.loop.validation import Limits, check_bounds, validate_request
from tandem.background import settled
from tandem.wire import orchestrator_pb2

LOG = logging.getLogger(__name__)

# finish_reason as the OpenAI API (and vLLM's metrics) name it: the end of sequence token is a "stop".
OPENAI_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
# After the streams of a drain end: how long their releases on the target and the replicas may take.
RELEASE_WAIT_S = 5.0


class Generation:
    def __init__(self, scheduler: Scheduler, limits: Limits, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.limits = limits
        self.metrics = metrics
        self.draining = False  # new requests are refused (a shutdown drains the streams in flight)
        self._streams: dict[str, ActiveRequest] = {}  # by request id
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Refuses new requests and waits up to `timeout_s` for the streams in flight to end, then ends the rest with
        ShuttingDown (UNAVAILABLE) and waits for what they held on the target and the replicas to be released.
        Returns how many streams it ended."""
        self.draining = True
        running = len(self._streams)
        LOG.info("draining: %d streams in flight, new requests refused, up to %g s", running, timeout_s)
        ended = 0
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            message = f"the orchestrator shut down before this request ended (--shutdown-timeout {timeout_s:g} s)"
            for active in self._streams.values():
                active.output.messages.put_nowait(ShuttingDown(message))
                ended += 1
            LOG.warning("draining: %d streams still running after %g s end with UNAVAILABLE", ended, timeout_s)
        await self._released(RELEASE_WAIT_S)
        LOG.info("drained: %d streams finished, %d ended by the shutdown", running - ended, ended)
        return ended

    async def _released(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` until the loop holds no request and the releases it started have ended."""
        deadline = time.monotonic() + timeout_s
        while (self.scheduler.waiting or self.scheduler.running) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the loop drops ended requests at its next wake and starts their releases
        await settled(max(0.0, deadline - time.monotonic()))

    async def stream(self, request: orchestrator_pb2.GenerateRequest, client_id: str) -> AsyncGenerator[Output, None]:
        """Validates and queues the request, then yields its messages; the last one has a finish_reason.

        `client_id` is the id the client gave the request (orchestrator.loop.validation.client_request_id); the log
        lines of the request's start and end name it beside the internal id, which stays a uuid unique across restarts.

        Raises InvalidRequest (naming the field) or QueueFull before the first message, RequestFailed after. Closing
        the iterator before the last message (the client went away) cancels the request, which frees its KV on
        target and draft: use it under contextlib.aclosing so that this happens at once.
        """
        if self.draining:
            raise ShuttingDown("the orchestrator is shutting down and takes no new requests: send it to another")
        check_bounds(request, self.limits)
        # Tokenizing a long prompt takes a while: off the event loop, which keeps streaming to other clients.
        params = await asyncio.to_thread(validate_request, request, self.scheduler.tokenizer, self.limits)
        active = self.scheduler.submit(params)
        self._streams[active.request_id] = active
        self._idle.clear()
        LOG.info(
            "request %s (client id %s): %d prompt tokens, at most %d new",
            active.request_id,
            client_id,
            len(params.input_ids),
            params.max_new_tokens,
        )
        counted = False
        ending = "abort"
        try:
            while True:
                output = await active.output.messages.get()
                if isinstance(output, RequestFailed):
                    counted, ending = True, f"error ({output})"
                    self.metrics.observe(active.output, "error")
                    raise output
                if output.finish_reason:
                    # Counted before the client sees the last message: a scrape after it includes this request.
                    counted, ending = True, output.finish_reason
                    self.metrics.observe(active.output, OPENAI_FINISH_REASONS[output.finish_reason])
                yield output
                if output.finish_reason:
                    return
        finally:
            self.scheduler.cancel(active)
            self._streams.pop(active.request_id, None)
            if not self._streams:
                self._idle.set()
            if not counted:
                self.metrics.observe(active.output, "abort")
            stats = active.output.stats
            LOG.info(
                "request %s (client id %s) ended: %s, %d new tokens, %d rounds, %d of %d drafts accepted",
                active.request_id,
                client_id,
                ending,
                len(active.output.generated),
                stats.rounds,
                stats.accepted_tokens,
                stats.draft_tokens,
            )
