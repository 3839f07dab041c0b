"""The one request path every generating route of every dialect goes through.

As TGI's routes all end in `generate_internal` (router `server.rs`), each handler here only parses
its body into engine requests (`prepare`) and shapes the answer (`answer`, or `encode` for a
stream); this module does the rest, once:

    started_at = record_start()                      # tgi_request_count
    requests, context = await prepare()              # the dialect's parsing and checks
    record_validated(...); handles = submit(...)     # every request or none
    non-stream: results, unless the client leaves    # a client that leaves cancels the engine work
    stream:     SSE of encode(generation)            # a client that leaves closes it, which cancels
    record_success(...) / record_failure(exc)        # tgi_request_success / _failure{err}
    errors -> policy.error(exc)                      # the dialect's one error-shape function

A client is gone when the ASGI receive channel says `http.disconnect` (uvicorn never cancels the
handler itself): the request's handles are cancelled then, at any point after the body was read,
while the prompt is tokenized, the grammar compiled, queued, or generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic
from connexion import context as connexion_context
from starlette.responses import Response

from opentgi.api import runtime
from opentgi.api.errors import ShuttingDownError
from opentgi.api.request_metrics import (
    record_failure,
    record_start,
    record_submitted,
    record_success,
    record_validated,
)
from opentgi.api.sse import Event, sse_response
from opentgi.api.tenants import table as tenant_table
from opentgi.engine.errors import OpenTGIError, ValidationError
from opentgi.engine.events import GenerationResult, Timings
from opentgi.engine.pooling import kinds
from opentgi.engine.request import GenerationRequest

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left: nobody reads it


class ErrorShape:
    """What a dialect's one error-shape function returns: status, JSON body and headers."""

    status: int
    body: Mapping[str, Any]
    headers: Mapping[str, str]

    def response(self) -> Response: ...


@dataclass(frozen=True)
class ErrorPolicy:
    """A dialect's error policy: how every failure on the path is answered (its one error-shape
    function) and how a stream ends on one. The only thing a dialect adds besides parsing and answers."""

    error: Callable[[BaseException], ErrorShape]  # the dialect's error shape (status, body)
    # The data sent after a stream's error event (OpenAI's " [DONE]"), if any.
    stream_end_after_error: str | None = None
    # TGI answers a streaming request it refuses with a 200 whose only event is the error.
    refuse_in_stream: bool = False
    # A stream's last event when it fails after opening, where it is not `error(exc).body`
    # (Anthropic's named `error` event, OpenAI Responses' numbered one).
    stream_error: Callable[[BaseException, Generation], Event] | None = None

    def error_event(self, exc: BaseException, generation: Generation) -> Event:
        return self.error(exc).body if self.stream_error is None else self.stream_error(exc, generation)


@dataclass
class Generation:
    """One request on its way: what `prepare` built, the engine handles, when it arrived."""

    started_at: float
    context: Any = None
    requests: list[GenerationRequest] = field(default_factory=list)
    handles: list = field(default_factory=list)
    durations: dict[str, float] | None = None  # recorded at success (TGI's timing headers quote them)
    lease: Any = None  # the tenant's slot (api/tenants/ledger.py), settled when the generation ends

    @property
    def handle(self):
        return self.handles[0]

    def success(self, generated_tokens: int, timings: Timings | None = None) -> dict[str, float]:
        """Records the success (an encoder calls it before its final event); returns the durations.
        Without `timings`, those of the first request's result, when delivered (streams)."""
        if timings is None and self.handles:
            final = getattr(self.handles[0], "final", None)
            timings = final.timings if final is not None else None
        self.durations = record_success(self.started_at, generated_tokens, timings)
        return self.durations

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()  # a no-op once a request is done
        if self.lease is not None:  # counts what the requests used, done or cancelled
            self.lease.settle(self.requests, self.handles)

    def admit_tenant(self) -> None:
        """Takes a slot of the caller's tenant (TenantQuotaError, a 429, past its quotas)."""
        ledger, tenant = runtime.state().tenants, tenant_table.current()
        if ledger is not None and tenant is not None:
            self.lease = ledger.admit(tenant)


Prepare = Callable[[], Awaitable[tuple[list[GenerationRequest], Any]]]
Answer = Callable[[Generation, list[GenerationResult]], Response]
Encode = Callable[[Generation], AsyncIterator[Event]]


def sum_generated_tokens(results: list[GenerationResult]) -> int:
    return sum(r.generated_tokens for r in results)


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def _client_gone() -> None:
    """Returns once the client has gone (the ASGI receive channel says http.disconnect); never
    returns outside a served request (a handler called directly, as in unit tests)."""
    try:
        receive = connexion_context.receive._get_current_object()
    except (LookupError, RuntimeError):
        await asyncio.Event().wait()
        return
    while (await receive())["type"] != "http.disconnect":
        pass


CUT_MESSAGE = "the server shut down before the request finished (--shutdown-timeout)"


async def unless_client_gone(work: Awaitable):
    """`work`'s value; raises ClientGone (after cancelling `work`) when the client leaves first, and
    ShuttingDownError when the server's shutdown deadline comes first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone())
    cut = asyncio.ensure_future(runtime.state().drain.cut())
    try:
        await asyncio.wait({task, gone, cut}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request's own task was cancelled: so is its work
        task.cancel()
        raise
    finally:
        gone.cancel()
        cut.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        if gone.done() and not gone.cancelled():
            raise ClientGone()
        raise ShuttingDownError(CUT_MESSAGE)
    return task.result()


async def _until_cut(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """`events`, ended by ShuttingDownError at the server's shutdown deadline."""
    drain = runtime.state().drain
    iterator = events.__aiter__()
    cut = asyncio.ensure_future(drain.cut())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, cut}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ShuttingDownError(CUT_MESSAGE)
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield event
    finally:
        cut.cancel()
        if step is not None and not step.done():  # closed (client gone, shutdown) mid-event: stop the source
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(RuntimeError):  # already closed by its cancelled step
                await aclose()


async def submit_all(engine, requests: list[GenerationRequest]) -> list:
    """Submit every request or none: a refusal (or the client leaving) cancels those already queued."""
    handles = []
    try:
        for request in requests:
            handles.append(await engine.submit(request))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def _start(prepare: Prepare, generation: Generation) -> None:
    if runtime.state().drain.draining:
        raise ShuttingDownError("the server is shutting down")
    info = runtime.engine().info
    if getattr(info, "model_kind", "generation") != "generation":  # a pooling model: refused before parsing
        raise kinds.refusal(info.model_id, info.model_kind, "generation")
    try:
        requests, generation.context = await prepare()
    except pydantic.ValidationError as exc:  # the document and the generated model disagree
        first = exc.errors()[0]
        raise ValidationError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from exc
    generation.requests = list(requests)
    tenant = generation.lease.tenant if generation.lease is not None else None
    for request in generation.requests:
        record_validated(request)
        if tenant is not None:  # the scheduler shares the batch by tenant
            request.tenant, request.tenant_weight = tenant.name, tenant.weight
    generation.handles = await submit_all(runtime.engine(), generation.requests)
    record_submitted(generation.requests)


async def generate(prepare: Prepare, policy: ErrorPolicy, answer: Answer, *,
                   generated_tokens: Callable[[list[GenerationResult]], int] = sum_generated_tokens) -> Response:
    """A non-streaming generation: `answer(generation, results)` once every request is done."""
    generation = Generation(started_at=record_start())
    try:
        generation.admit_tenant()
        await unless_client_gone(_start(prepare, generation))
        results = await unless_client_gone(asyncio.gather(*(h.result() for h in generation.handles)))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except OpenTGIError as exc:
        record_failure(exc)
        return policy.error(exc).response()
    finally:
        generation.cancel()
    generation.success(generated_tokens(results), results[0].timings if results else None)
    return answer(generation, results)


async def stream(prepare: Prepare, policy: ErrorPolicy, encode: Encode, *,
                 headers: Mapping[str, str] | None = None) -> Response:
    """A streaming generation: SSE of `encode(generation)`; an error after the stream opened is its
    last event in the dialect's error shape. Before it opens, a refusal is a plain error response (unless
    the dialect refuses in the stream, as TGI does)."""
    generation = Generation(started_at=record_start())
    try:  # a tenant past its quota gets a plain 429, never a stream
        generation.admit_tenant()
    except OpenTGIError as exc:
        record_failure(exc)
        return policy.error(exc).response()
    if not policy.refuse_in_stream:
        try:
            await unless_client_gone(_start(prepare, generation))
        except ClientGone:
            generation.cancel()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except OpenTGIError as exc:
            generation.cancel()
            record_failure(exc)
            return policy.error(exc).response()
    return sse_response(_events(prepare, policy, encode, generation), headers=headers, handle=generation,
                        error_event=lambda exc: policy.error_event(exc, generation))


async def _events(prepare: Prepare, policy: ErrorPolicy, encode: Encode,
                  generation: Generation) -> AsyncIterator[Event]:
    try:
        if not generation.handles:
            await _start(prepare, generation)
        async for event in _until_cut(encode(generation)):
            yield event
    except OpenTGIError as exc:
        record_failure(exc)
        yield policy.error_event(exc, generation)
        if policy.stream_end_after_error is not None:
            yield policy.stream_end_after_error
    finally:
        generation.cancel()  # the client left (the stream was closed) or the request ended
