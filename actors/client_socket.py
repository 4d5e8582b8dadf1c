"""Sending on a client's WebSocket without waiting for ever on a client that reads nothing.

A send waits while the socket's buffers are full: the client has taken nothing for as long as
they took to fill (the kernel's, the ingress's and its own, megabytes). Past `stall_s` of no
progress the connection is cut, because a close handshake cannot reach such a client: the
close frame queues behind what it has not read, and uvicorn's close waits for its send buffer
to drain before it closes the TCP connection, which it never does. Behind HAProxy the replica
then stops reading while the connection stays open; the client's sends block on full buffers
and nothing ends it before HAProxy's client timeout (an hour). So the cut is an abort.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

log = logging.getLogger("loopserve.connection")


class ClientStalled(WebSocketDisconnect):
    """The client took nothing of what waited for it for `stall_s`: its connection was cut."""

    def __init__(self, stall_s: float) -> None:
        super().__init__(code=1006, reason=f"the client read nothing for {stall_s:g} s")


async def send_text(ws: WebSocket, text: str, stall_s: float) -> None:
    """`ws.send_text`, or the connection cut (and `ClientStalled`) after `stall_s` without progress."""
    await _within(ws, ws.send_text(text), stall_s)


async def close(ws: WebSocket, code: int, reason: str, stall_s: float) -> None:
    """The close frame, or the connection cut when the client has not read what precedes it."""
    await _within(ws, ws.close(code=code, reason=reason), stall_s)


async def _within(ws: WebSocket, sending, stall_s: float) -> None:
    # Neither `wait_for` nor `asyncio.timeout`: on Python 3.11 `wait_for` swallows the caller's
    # cancellation when the send completes in the same pass of the loop (a lane cancelled because
    # its client left then ran on to the end of its answer, the engine never aborted), and
    # `asyncio.timeout` cancels the caller itself inside Ray's and uvicorn's send (a flood through
    # HAProxy was then left open). The send runs as its own task; the caller's cancellation
    # cancels it and propagates.
    task = asyncio.ensure_future(sending)
    try:
        done, _ = await asyncio.wait({task}, timeout=stall_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        task.result()
        return
    task.cancel()
    cut = abort(ws)
    log.warning("websocket: the client read nothing for %.0f s; connection %s", stall_s,
                "cut" if cut else "left to the ingress (no transport to abort)")
    raise ClientStalled(stall_s)


def abort(ws: WebSocket) -> bool:
    """Drop the TCP connection without a handshake (a reset: the ingress then ends the client's
    side). ASGI has no abort. Where the app reads the server's socket itself, which is how
    loopserve's HAProxy ingress runs a WebSocket (Ray passes uvicorn's receive through with
    `x-request-disconnect-disabled`), the receive callable is bound to uvicorn's protocol, whose
    asyncio transport aborts. Elsewhere (Serve's own proxy relays frames and buffers sends, so
    none stalls here) there is nothing to abort: False."""
    protocol = getattr(getattr(ws, "_receive", None), "__self__", None)
    transport = getattr(protocol, "transport", None)
    if transport is None or not callable(getattr(transport, "abort", None)):
        return False
    transport.abort()
    return True
