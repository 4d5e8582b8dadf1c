"""The WebSocket route's reader: frames a client has already sent are taken one a socket per
pass of the event loop, so a burst on one socket does not hold every other socket's turn."""

import asyncio
from types import SimpleNamespace

from actors.routes import websocket


class BufferedSocket:
    """A WebSocket whose frames have all arrived: `receive` returns without a suspension, as
    uvicorn's does while its queue holds messages."""

    headers: dict = {}

    def __init__(self, texts: list[str]) -> None:
        self.messages = [{"type": "websocket.receive", "text": t} for t in texts] + [{"type": "websocket.disconnect"}]

    async def accept(self, headers=None) -> None:
        pass

    async def receive(self) -> dict:
        return self.messages.pop(0)


def services(handled: list[str]) -> SimpleNamespace:
    class Session:
        closed = False

        async def on_frame(self, data: str) -> None:
            handled.append(data)

    async def open_socket(p, headers, send, close):
        return SimpleNamespace(session=Session())

    async def close_socket(socket):
        pass

    turns = SimpleNamespace(admit_socket=lambda headers: "principal", open_socket=open_socket,
                            close_socket=close_socket, abandon_socket=lambda p: None)
    return SimpleNamespace(turns=turns, config=SimpleNamespace(websocket=SimpleNamespace(max_frame_bytes=1024, send_stall_seconds=10.0)))


async def test_a_socket_with_a_burst_of_frames_takes_turns_with_the_others():
    handled: list[str] = []
    conn = services(handled)
    burst = BufferedSocket([f"hostile {i}" for i in range(64)])
    honest = BufferedSocket(["honest"])
    await asyncio.gather(websocket(burst, conn), websocket(honest, conn))
    assert len(handled) == 65
    assert handled.index("honest") <= 2  # not behind the 64 frames that were there first


def test_a_request_reaches_the_replicas_services_without_a_thread_hop(monkeypatch):
    """FastAPI runs a plain-`def` dependency in its thread pool: a thread hop on every request
    and WebSocket of the replica (11% of its event loop under load, measured)."""
    import fastapi.dependencies.utils as deps
    from fastapi.testclient import TestClient

    from actors.routes import build_app

    hops = []
    real = deps.run_in_threadpool

    async def counting(func, *args, **kwargs):
        hops.append(getattr(func, "__name__", func))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(deps, "run_in_threadpool", counting)
    async def ready():
        return None

    conn = SimpleNamespace(principal=lambda headers: "principal", config=SimpleNamespace(model=SimpleNamespace(name="m")),
                           not_ready=ready)
    r = TestClient(build_app(conn)).get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "m"
    assert hops == []


def test_until_a_turn_can_run_health_and_the_model_list_say_so_with_a_retry_after():
    """`/v1/models` answered 200 while the engine still loaded, and a request sent
    then waited ~100 s. Both it and `/health` read the same check of every deployment a turn
    needs: 503 with Retry-After until it passes, then 200, together."""
    from fastapi.testclient import TestClient

    from actors.routes import build_app
    from cluster.serving.connection import ConnectionServices

    engine_up = False

    async def health():
        if not engine_up:
            raise TimeoutError("the engine replica is not answering yet")

    state = SimpleNamespace(health=health)
    conn = SimpleNamespace(principal=lambda headers: "principal", config=SimpleNamespace(model=SimpleNamespace(name="m")),
                           not_ready=lambda: ConnectionServices.not_ready(state))
    client = TestClient(build_app(conn))
    for path in ("/health", "/v1/models"):
        r = client.get(path)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, path
    assert client.get("/v1/models").json()["error"]["code"] == "server_starting"
    engine_up = True
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
