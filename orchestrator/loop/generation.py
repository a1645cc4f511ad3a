"""The one path from a public request to its stream of outputs; the gRPC and HTTP front ends are thin shells over it.

Both front ends express a request as the public GenerateRequest (the HTTP API translates OpenAI's fields into it), so
the same request gives the same tokens on both, and each front end only maps the outcomes below to its own errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

from orchestrator.loop.metrics import Metrics
from orchestrator.loop.output import Output, RequestFailed
from orchestrator.loop.scheduler import Scheduler
from orchestrator.loop.validation import Limits, check_bounds, validate_request
from tandem.wire import orchestrator_pb2

LOG = logging.getLogger(__name__)

# finish_reason as the OpenAI API (and vLLM's metrics) name it: the end of sequence token is a "stop".
OPENAI_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class Generation:
    def __init__(self, scheduler: Scheduler, limits: Limits, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.limits = limits
        self.metrics = metrics

    async def stream(self, request: orchestrator_pb2.GenerateRequest, client_id: str) -> AsyncGenerator[Output, None]:
        """Validates and queues the request, then yields its messages; the last one has a finish_reason.

        `client_id` is the id the client gave the request (orchestrator.loop.validation.client_request_id); the log
        lines of the request's start and end name it beside the internal id, which stays a uuid unique across restarts.

        Raises InvalidRequest (naming the field) or QueueFull before the first message, RequestFailed after. Closing
        the iterator before the last message (the client went away) cancels the request, which frees its KV on
        target and draft: use it under contextlib.aclosing so that this happens at once.
        """
        check_bounds(request, self.limits)
        # Tokenizing a long prompt takes a while: off the event loop, which keeps streaming to other clients.
        params = await asyncio.to_thread(validate_request, request, self.scheduler.tokenizer, self.limits)
        active = self.scheduler.submit(params)
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
