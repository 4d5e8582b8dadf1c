"""Engine backends as registry records (cluster/config/backends.py): a new backend is its engine
class, its settings' class and one `register` call, touching nothing else in loopserve."""

from __future__ import annotations

from array import array

import pytest
from pydantic import ValidationError

from cluster.core.messages import Generation
from cluster.config import LoopserveConfig, StrictModel
from cluster.config.backends import BACKENDS, Backend, options_of, register
from cluster.engines.base import EngineDelta, EngineStats, KvFacts


class EchoSettings(StrictModel):
    """The test backend's settings (`engine.options`)."""

    max_tokens: int = 3
    prefix: str = "echo:"


class EchoEngine:
    """A test backend (named as such): answers with its prefix and the prompt's last tokens."""

    max_model_len = 4096
    pins_off_reason = "no pins"

    def __init__(self, model, settings: EchoSettings, *, encode, decode, decode_raw) -> None:
        self.settings, self.encode, self.decode = settings, encode, decode
        self.stats = EngineStats()

    async def start(self) -> None:
        pass

    async def generate(self, request):
        self.stats.requests += 1
        tail = list(request.prompt_token_ids)[-request.generation.max_tokens:]
        yield EngineDelta(text=self.settings.prefix, new_tokens=0, prompt_tokens=len(request.prompt_token_ids))
        yield EngineDelta(text=self.decode(tail), new_tokens=len(tail), finished=True, finish_reason="length",
                          prompt_tokens=len(request.prompt_token_ids), token_ids=tail)

    async def abort(self, request_id: str) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def check_health(self) -> None:
        pass

    def kv_facts(self) -> KvFacts:
        return KvFacts(0, 16, None)  # capacity unknown: nothing to budget

    def kv_in_use_tokens(self):
        return None

    def kv_stats(self):
        return {}

    def grammar_worker(self):
        return None


@pytest.fixture
def echo_backend():
    register(Backend("echo-test", f"{__name__}:EchoEngine", options_of(EchoSettings), lambda s: s.max_tokens))
    yield
    BACKENDS.pop("echo-test")


async def test_a_registered_backend_serves_a_turn_with_its_own_settings(echo_backend, tiny_model_dir):
    from cluster.core.messages import EngineDone, EngineRequest
    from cluster.engines.service import EngineService
    from cluster.serving.connection import turn_settings

    config = LoopserveConfig(engine={"backend": "echo-test", "options": {"max_tokens": 5, "prefix": ">> "}})
    assert turn_settings(config).default_max_tokens == 5  # from its settings, through its record
    service = await EngineService.build(config)
    assert isinstance(service.engine, EchoEngine) and service.engine.settings.prefix == ">> "
    prompt = array("i", service.engine.encode("hello there, general kenobi"))
    pieces = [p async for chunk in service.generate(EngineRequest("r1", "s", prompt, Generation(5))) for p in chunk]
    text = "".join(getattr(p, "text", "") for p in pieces)
    assert text.startswith(">> ") and isinstance(pieces[-1], EngineDone)
    await service.engine.shutdown()


def test_an_unknown_backend_is_refused_naming_the_registered_ones():
    with pytest.raises(ValidationError, match="unknown engine backend 'tgi'; registered: scripted, vllm"):
        LoopserveConfig(engine={"backend": "tgi"})
