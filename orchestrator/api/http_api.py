"""The OpenAI-compatible HTTP API and /metrics, served by aiohttp on the orchestrator's event loop.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics. Completions run
through orchestrator.loop.generation, as gRPC Generate does, so a greedy request gives the same text on both APIs.

Every error is OpenAI-shaped JSON (orchestrator.api.openai_protocol.ApiError): 400 naming the field, 401 without the
right key, 404 for an unknown model or route, 429 when the waiting queue is full, 503 when the backends fail. An error
after a stream has started is sent as a last event `data: {"error": ...}`, then `data: [DONE]`. A client that
disconnects cancels its handler (handler_cancellation), which cancels its request and frees its KV.

The server speaks what the public gRPC port speaks (its TransportSecurity's http_server_context): HTTPS with the
orchestrator's --tls-cert/--tls-key when the public port serves TLS, plain HTTP otherwise. Clients are asked for no
certificate there, as on the gRPC port (the API key identifies them), and plain HTTP to an HTTPS port gets no answer:
the API key never crosses the network in the clear. /health and /metrics share the port, so probes and scrapers
speak HTTPS too.

`access_checks` is the one place to authorize a request: each check sees every /v1 request before its handler
and raises ApiError to refuse it (bearer_check: the API key).

Every response carries X-Request-Id, errors included: the client's id when it sent a valid one, else one made for
the request (also when the client's is refused: an id that fails the check is never echoed). A /v1 request with an
invalid id is refused with 400 naming x-request-id; other routes (probes, scrapes) just get a new id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from orchestrator.api.chat import chat_prompt_ids, resolve_chat_template
from orchestrator.api.media import NO_MEDIA, MediaPolicy, read_images
from orchestrator.api.openai_logprobs import LogprobShaper
from orchestrator.api.openai_protocol import ApiError, ParsedRequest, from_invalid, parse_chat, parse_completion
from orchestrator.api.openai_responses import DONE, ResponseShape, server_sent_event, usage_of
from orchestrator.api.tool_output import ChatTools, ToolReply
from orchestrator.api.tool_stream import Piece
from orchestrator.loop.generation import OPENAI_FINISH_REASONS, Generation
from orchestrator.loop.metrics import CONTENT_TYPE
from orchestrator.loop.output import Output, RequestFailed, ShuttingDown
from orchestrator.loop.prompt_images import image_size
from orchestrator.loop.scheduler import QueueFull
from orchestrator.loop.validation import InvalidRequest, client_request_id
from orchestrator.peers.backends import FailureKind
from orchestrator.settings import OrchestratorSettings
from tandem.auth import Unauthenticated, check_bearer
from tandem.transport import TransportSecurity

LOG = logging.getLogger(__name__)

STATUS_OF_FAILURE = {FailureKind.INVALID: 400, FailureKind.EXHAUSTED: 429, FailureKind.UNAVAILABLE: 503}
KIND_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}
MAX_BODY_BYTES = 64 * 2**20  # above the longest prompt check_bounds would read (context * 64 characters)
SHUTDOWN_TIMEOUT_S = 1.0  # as the gRPC server's grace
REQUEST_ID_HEADER = "X-Request-Id"  # the client's id for its request; echoed, and in the response's id
REQUEST_ID = web.RequestKey("request_id", str)  # the id a request is answered with (HttpApi._identify)

AccessCheck = Callable[[web.Request], None]


def bearer_check(api_key: str) -> AccessCheck:
    """Requires `Authorization: Bearer <api_key>` (tandem.auth.check_bearer, shared with the gRPC API)."""

    def check(request: web.Request) -> None:
        try:
            check_bearer(request.headers.get("Authorization"), api_key)
        except Unauthenticated as error:
            raise ApiError(401, str(error), kind="authentication_error", code="invalid_api_key") from error

    return check


class HttpApi:
    def __init__(
        self,
        generation: Generation,
        model_name: str,
        chat_template: str | None,
        access_checks: Sequence[AccessCheck] = (),
        tool_call_parser: str = "auto",  # HttpSettings.tool_call_parser
        media: MediaPolicy = NO_MEDIA,  # where images may come from (its limit: the target's)
    ) -> None:
        self.generation = generation
        self.model_name = model_name
        self.chat_template = chat_template
        self.tools = ChatTools(generation.scheduler.tokenizer, chat_template, tool_call_parser)
        self.access_checks = tuple(access_checks)
        self.media = media
        self.started = int(time.time())

    def application(self) -> web.Application:
        # Outermost first: errors become OpenAI-shaped answers, and the id is known before access is checked.
        app = web.Application(middlewares=[self._errors, self._identify, self._access], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status, headers=error.headers)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            kind = KIND_OF_STATUS.get(error.status, "invalid_request_error")
            message = f"{request.method} {request.path}: {error.reason}"
            return web.json_response(ApiError(error.status, message, kind=kind).body(), status=error.status)

    @web.middleware
    async def _identify(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            request[REQUEST_ID] = client_request_id(request.headers.get(REQUEST_ID_HEADER))
        except InvalidRequest as error:
            request[REQUEST_ID] = client_request_id(None)
            if request.path.startswith("/v1/"):
                raise from_invalid(error, "prompt") from error
        return await handler(request)

    @web.middleware
    async def _access(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            for check in self.access_checks:
                check(request)
        return await handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await _json_body(request), self.model_name)
        return await self._answer(request, parsed)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await _json_body(request), self.model_name)
        parsed.generate.images.extend(await read_images(parsed.images, self.media) if parsed.images else ())
        ids = await asyncio.to_thread(self._chat_prompt, parsed)
        parsed.generate.input_ids.extend(ids)
        tools = parsed.tools
        reply = self.tools.reply(tools, ids, parsed.generate.stop) if tools is not None else None
        return await self._answer(request, parsed, reply)

    def _chat_prompt(self, parsed: ParsedRequest) -> list[int]:
        """The chat's prompt ids (rendered with its tools), a forced tool choice's grammar set; off the loop."""
        if parsed.tools is not None:
            self.tools.prepare(parsed.tools, parsed.generate)
        limits = self.generation.limits
        return chat_prompt_ids(
            self.generation.scheduler.tokenizer,
            self.chat_template,
            parsed.messages,
            limits.max_context * limits.max_chars_per_token,
            parsed.tools.tools if parsed.tools is not None else None,
            self.tools.arguments_as_text,
            (limits.images, [image_size(data) for data in parsed.generate.images]) if limits.images else None,
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "tandem",
            "max_model_len": self.generation.limits.max_context,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.generation.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _answer(
        self, request: web.Request, parsed: ParsedRequest, reply: ToolReply | None = None
    ) -> web.StreamResponse:
        try:
            request_id = request[REQUEST_ID]
            shape = ResponseShape(parsed.chat, self.model_name, request_id, parsed.include_usage)
            tokenizer = self.generation.scheduler.tokenizer
            shaper = LogprobShaper(tokenizer, parsed.chat) if parsed.generate.logprobs else None
            async with aclosing(self.generation.stream(parsed.generate, request_id)) as outputs:
                if parsed.stream:
                    return await _stream(request, outputs, shape, shaper, reply)
                return web.json_response(await _whole(outputs, shape, shaper, reply))
        except InvalidRequest as error:
            raise from_invalid(error, "messages" if parsed.chat else "prompt") from error
        except QueueFull as error:
            raise ApiError(429, str(error), kind=KIND_OF_STATUS[429]) from error
        except RequestFailed as failure:
            raise _failure_error(failure) from failure


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Sets X-Request-Id on every response as its headers are sent (a stream's with its first event)."""
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers[REQUEST_ID_HEADER] = request_id


def _failure_error(failure: RequestFailed) -> ApiError:
    status = STATUS_OF_FAILURE[failure.kind]
    headers = {"Retry-After": str(failure.retry_after_s)} if isinstance(failure, ShuttingDown) else None
    return ApiError(status, str(failure), kind=KIND_OF_STATUS[status], headers=headers)


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as error:
        raise ApiError(400, f"body: not valid JSON ({error})") from error
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    return body


async def _whole(
    outputs: AsyncIterator[Output], shape: ResponseShape, shaper: LogprobShaper | None, reply: ToolReply | None
) -> dict[str, Any]:
    """The answer without stream: every message's text (or content and tool calls), then the last one's finish
    reason and counts."""
    pieces: list[Piece] = []
    logprobs = []
    async for output in outputs:
        pieces += reply.pieces(output) if reply is not None else [output.text]
        logprobs += output.logprobs
        if output.finish_reason:
            usage = usage_of(output)
            shaped = shaper.shape(logprobs) if shaper is not None else None
            reason = OPENAI_FINISH_REASONS[output.finish_reason]
            if reply is not None:
                return reply.full(shape, pieces, reason, usage, shaped)
            return shape.full("".join(str(piece) for piece in pieces), reason, usage, shaped)
    raise AssertionError("a request's messages end with one that has a finish_reason")


async def _stream(
    request: web.Request,
    outputs: AsyncIterator[Output],
    shape: ResponseShape,
    shaper: LogprobShaper | None,
    reply: ToolReply | None,
) -> web.StreamResponse:
    """Server-sent events: one chunk per message (with tools, its content and calls), the usage chunk when asked,
    then [DONE].

    The response starts with the first message, so that a request refused before any token still gets its status.
    """
    stream: web.StreamResponse | None = None
    usage = None
    try:
        async for output in outputs:
            first = stream is None
            if stream is None:
                stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await stream.prepare(request)
            finish_reason = OPENAI_FINISH_REASONS[output.finish_reason] if output.finish_reason else None
            shaped = shaper.shape(output.logprobs) if shaper is not None else None
            if reply is None:
                chunks = [shape.chunk(output.text, finish_reason, first, shaped)]
            else:
                chunks = reply.chunks(shape, output, finish_reason, first, shaped)
            for chunk in chunks:
                await stream.write(server_sent_event(chunk))
            if finish_reason:
                usage = usage_of(output)
    except RequestFailed as failure:
        if stream is None:
            raise
        LOG.warning("request failed after its stream started: %s", failure)
        await stream.write(server_sent_event(_failure_error(failure).body()))
    assert stream is not None
    if usage is not None and shape.include_usage:
        await stream.write(server_sent_event(shape.usage_chunk(usage)))
    await stream.write(DONE)
    return stream


@dataclass
class HttpServer:
    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http(api: HttpApi, host: str, port: int, security: TransportSecurity) -> HttpServer:
    """Serves the API on host:port (0: a free port) on the running event loop, HTTPS where `security` serves TLS;
    returns its URL."""
    context = security.http_server_context()  # before binding: unusable certificate files fail here, by name
    runner = web.AppRunner(
        api.application(), handler_cancellation=True, shutdown_timeout=SHUTDOWN_TIMEOUT_S, access_log=None
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=context)
    await site.start()
    bound_port = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL is bracketed
    scheme = "http" if context is None else "https"
    return HttpServer(runner, f"{scheme}://{shown}:{bound_port}")


async def serve_http_api(
    settings: OrchestratorSettings, host: str, security: TransportSecurity, generation: Generation
) -> HttpServer | None:
    """Starts the HTTP API when settings.http.port is set (None otherwise), with the public port's `security`, and
    writes its URL to the ready file."""
    http = settings.http
    if http.port is None:
        return None
    template = resolve_chat_template(generation.scheduler.tokenizer, http.chat_template)
    if template is None:
        LOG.warning("the tokenizer has no chat template: /v1/chat/completions answers 400 (see --chat-template)")
    checks = [bearer_check(settings.api_key)] if settings.api_key is not None else []
    images = generation.limits.images
    media = MediaPolicy(
        images.limit if images is not None else 0,
        frozenset(domain.lower() for domain in http.allowed_media_domains),
        http.allowed_local_media_path,
    )
    api = HttpApi(generation, settings.model_name, template, checks, http.tool_call_parser, media)
    tool_format = api.tools.format.name if api.tools.format is not None else "none (tools only with tool_choice none)"
    LOG.info("tool calls: %s format", tool_format)
    server = await start_http(api, host, http.port, security)
    if http.ready_file is not None:
        partial = http.ready_file.with_suffix(".partial")
        partial.write_text(server.url)
        os.replace(partial, http.ready_file)
    LOG.info("OpenAI-compatible HTTP API and /metrics on %s (model %r)", server.url, settings.model_name)
    return server
