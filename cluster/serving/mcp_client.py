"""The cluster's client of remote MCP servers (streamable HTTP, the `mcp` package's own client):
list a server's tools, call one. Every request is checked before it connects (cluster/core/mcp.py:
scheme, host, and every address the host resolves to, redirects the transport follows
included), every answer is read up to `mcp.max_result_bytes`, every exchange has a deadline, and
each key has at most `mcp.max_concurrent_calls_per_tenant` in flight. Failures are `McpRefused`
with a message the client may see; the request's headers never reach a log, a span or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import httpx2

from cluster import telemetry
from cluster.config.mcp import McpConfig
from cluster.core.mcp import ListedTool, McpRefused, McpServer, ToolLists, UrlPolicy, result_text, tools_from_listing

log = logging.getLogger("loopserve.mcp")
Resolve = Callable[[str, int], Awaitable[list[str]]]
MAX_LIST_PAGES = 10


async def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in the resolver's order of preference."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class _TooLarge(Exception):
    pass


class _BoundedStream(httpx2.AsyncByteStream):
    """A response body, read up to `limit` bytes: past it the exchange fails (nothing more is read)."""

    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = 0
        async for chunk in self.inner:
            read += len(chunk)
            if read > self.limit:
                raise _TooLarge()
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class _GuardedTransport(httpx2.AsyncBaseTransport):
    """Each request's URL and resolved addresses checked before it connects, and the connection
    made to the address checked (the URL's host is the Host header and the TLS name): a name
    resolved again to connect could answer otherwise the second time (DNS rebinding). Its
    answer bounded."""

    def __init__(self, policy: UrlPolicy, limit: int, resolver: Resolve) -> None:
        self.policy, self.limit, self.resolver = policy, limit, resolver
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        host, port = self.policy.host_of(str(request.url))
        try:
            addresses = await self.resolver(host, port)
        except OSError:
            raise McpRefused(f"The host '{host}' did not resolve.") from None
        self.policy.check_addresses(host, addresses)
        if addresses and addresses[0] != host:
            request = httpx2.Request(request.method, request.url.copy_with(host=addresses[0]),
                                     headers=request.headers,  # Host: the name, as the server expects
                                     stream=request.stream,
                                     extensions={**request.extensions, "sni_hostname": host})
        response = await self.inner.handle_async_request(request)
        return httpx2.Response(response.status_code, headers=response.headers,
                               stream=_BoundedStream(response.stream, self.limit), extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _cause(exc: BaseException) -> Optional[BaseException]:
    """Our own failure inside what the MCP client raised (a task group wraps it, a transport chains it)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, (McpRefused, _TooLarge)):
            return e
        stack += list(getattr(e, "exceptions", ()) or ()) + [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


class McpClient:
    def __init__(self, config: McpConfig, *, tracer: Any = None, resolver: Resolve = resolve) -> None:
        self.config = config
        self.policy = UrlPolicy(config.allowed_hosts, config.allow_private_networks, config.allow_http)
        self.lists = ToolLists(config.tools_ttl_s, config.max_cached_lists)
        self.tracer = tracer or telemetry.tracer()
        self.resolver = resolver
        self._in_flight: dict[str, int] = {}  # tenant -> MCP exchanges running (a key's concurrency)
        self._sessions: "OrderedDict[tuple, _HeldSession]" = OrderedDict()  # (tenant, url, headers) -> its session
        self.max_calls = config.max_calls_per_response

    async def list_tools(self, server: McpServer, tenant: str, trace: Any = None) -> list[ListedTool]:
        """The server's tools (reused from an earlier list of this tenant's for `tools_ttl_s`)."""
        key = server.list_key(tenant)
        cached = self.lists.get(key, time.monotonic())
        if cached is not None:
            return cached

        async def listing(client: Any) -> list[ListedTool]:
            raw, cursor = [], None
            for _ in range(MAX_LIST_PAGES):
                page = await client.list_tools(cursor=cursor)
                raw += [t.model_dump(by_alias=True, exclude_none=True) for t in page.tools]
                cursor = page.next_cursor
                if not cursor:
                    break
            return tools_from_listing(raw)

        tools = await self._exchange(server, tenant, "mcp.list_tools", listing, self.config.list_timeout_s, trace)
        self.lists.put(key, tools, time.monotonic())
        return tools

    async def call_tool(self, server: McpServer, tenant: str, name: str, arguments: str, trace: Any = None) -> str:
        """The tool's result as the model reads it; a tool's own error is `McpRefused` with its text."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            raise McpRefused("The call's arguments are not valid JSON.") from None
        if not isinstance(args, dict):
            raise McpRefused("The call's arguments must be a JSON object.")

        async def calling(client: Any) -> str:
            result = await client.call_tool(name, args)
            content = [part.model_dump(by_alias=True, exclude_none=True) for part in result.content]
            text = result_text(content, getattr(result, "structured_content", None))
            if result.is_error:
                raise McpRefused(f"The tool '{name}' failed: {text[:2000]}", tool_error=content)
            return text

        return await self._exchange(server, tenant, "mcp.call_tool", calling, self.config.call_timeout_s, trace,
                                    tool=name)

    async def _exchange(self, server: McpServer, tenant: str, span_name: str, work: Callable[[Any], Awaitable[Any]],
                        timeout_s: float, trace: Any, tool: Optional[str] = None) -> Any:
        if self._in_flight.get(tenant, 0) >= self.config.max_concurrent_calls_per_tenant:
            raise McpRefused(f"This key has {self.config.max_concurrent_calls_per_tenant} MCP requests in flight "
                             "already; retry when they end.")
        host, _ = self.policy.host_of(server.url)  # refused before anything connects
        span = self.tracer.start_span(span_name, context=trace, kind=telemetry.SpanKind.CLIENT)
        span.set_attribute("mcp.server_label", server.label)
        span.set_attribute("server.address", host)
        if tool is not None:
            span.set_attribute("mcp.tool", tool)
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                return await self._session(server, work, tenant)
        except Exception as exc:  # noqa: BLE001 - whatever the server or the network did, a clear error
            cause = _cause(exc)
            if deadline.expired() or isinstance(_leaf(exc), httpx2.TimeoutException):  # (maybe in a task group)
                raise self._failed(span, "timeout", f"The MCP server '{server.label}' did not answer within "
                                                    f"{timeout_s:g} s.") from None
            if isinstance(cause, _TooLarge):
                message = f"The MCP server '{server.label}' answered more than {self.config.max_result_bytes} bytes."
            elif isinstance(cause, McpRefused):
                if cause.tool_error is not None:
                    raise cause from None  # the tool answered: its error is its result
                message = str(cause)
            else:
                leaf = _leaf(exc)
                log.info("MCP %s on %s failed: %s", span_name, server.label, type(leaf).__name__)
                message = f"The MCP server '{server.label}' could not be used: {_kind(leaf)}."
            raise self._failed(span, type(cause or exc).__name__, message) from None
        finally:
            self._in_flight[tenant] -= 1
            if not self._in_flight[tenant]:
                del self._in_flight[tenant]
            span.end()

    def _failed(self, span: Any, kind: str, message: str) -> McpRefused:
        span.set_attribute("error.type", kind)
        span.set_status(telemetry.StatusCode.ERROR, message[:200])
        return McpRefused(message)

    async def _session(self, server: McpServer, work: Callable[[Any], Awaitable[Any]], tenant: str) -> Any:
        """`work` on a session of this tenant's with `server`, held open between exchanges (a
        session costs an `initialize` round trip and its close: ~30 ms a call on loopback); one
        that failed an exchange is closed, never reused."""
        key = server.list_key(tenant)
        held = self._sessions.pop(key, None)
        if held is None or held.task.done():
            held = _HeldSession(self._open(server))
        self._sessions[key] = held  # most recently used last
        while len(self._sessions) > self.config.max_cached_lists:
            self._sessions.pop(next(iter(self._sessions))).close()
        try:
            return await held.run(work)
        except McpRefused as err:
            if err.tool_error is None:
                self._sessions.pop(key, None)
                held.close()
            raise
        except BaseException:
            self._sessions.pop(key, None)
            held.close()
            raise

    @contextlib.asynccontextmanager
    async def _open(self, server: McpServer) -> AsyncIterator[Any]:
        from mcp.client.client import Client
        from mcp.client.streamable_http import streamable_http_client

        transport = _GuardedTransport(self.policy, self.config.max_result_bytes, self.resolver)
        longest = max(self.config.call_timeout_s, self.config.list_timeout_s) + 1  # each exchange's deadline first
        async with httpx2.AsyncClient(transport=transport, headers=dict(server.headers),
                                      timeout=httpx2.Timeout(longest)) as http:
            async with Client(streamable_http_client(server.url, http_client=http,
                                                     max_sse_event_size=self.config.max_result_bytes),
                              raise_exceptions=True) as client:
                yield client

    async def close(self) -> None:
        for held in self._sessions.values():
            held.close()
        self._sessions.clear()


class _HeldSession:
    """An MCP session kept open by a task of its own (the MCP client's scopes belong to the task
    that opened them), closed after `IDLE_S` unused. An exchange waits for its result or for the
    session to die (its transport failed: the error is the exchange's)."""

    IDLE_S = 60.0

    def __init__(self, opener: Any) -> None:
        self._opener = opener
        self._client: "asyncio.Future[Any]" = asyncio.get_running_loop().create_future()
        self._used = asyncio.Event()
        self._closing = asyncio.Event()
        self.task = asyncio.ensure_future(self._hold())

    async def _hold(self) -> None:
        try:
            async with self._opener as client:
                self._client.set_result(client)
                while not self._closing.is_set():
                    self._used.clear()
                    try:
                        await asyncio.wait_for(self._used.wait(), self.IDLE_S)
                    except TimeoutError:
                        break
        except BaseException as exc:
            if not self._client.done():
                self._client.set_exception(exc)
            raise

    async def run(self, work: Callable[[Any], Awaitable[Any]]) -> Any:
        self._used.set()
        client = await asyncio.shield(self._client) if not self._client.done() else self._client.result()
        call = asyncio.ensure_future(work(client))
        try:
            await asyncio.wait([call, self.task], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            call.cancel()
            raise
        if call.done():
            self._used.set()
            return call.result()
        call.cancel()  # the session died under it
        exc = self.task.exception() if not self.task.cancelled() else None
        raise exc or McpRefused("The MCP session ended.")

    def close(self) -> None:
        """Closed now: one that failed may be stuck opening (an `initialize` never answered)."""
        self._closing.set()
        self._used.set()
        if not self._client.done() or self._client.exception() is not None:
            self.task.cancel()


def _leaf(exc: BaseException) -> BaseException:
    """The first exception that is not a group of others (what the MCP client's task group raised)."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]
    return exc


def _kind(exc: BaseException) -> str:
    """What went wrong, in words that hold nothing the request sent."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if "jsonrpc" in text or "validation" in text or "json" in text or "parse" in text:
        return "it did not answer with valid MCP (JSON-RPC) messages"
    if "redirect" in text:
        return "it redirected the request elsewhere, which is not followed"
    if "connect" in text or "refused" in text:
        return "it could not be reached"
    if type(exc).__name__ == "MCPError":  # the server's own JSON-RPC error (an HTTP error status, ...)
        return f"it answered with an error: {str(exc)[:200]}"
    return type(exc).__name__
