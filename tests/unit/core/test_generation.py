"""One source of sampling: what the engine runs is what the response reports, whoever set it."""

from cluster.core.events import build_response
from cluster.core.generation import SAMPLING, sampling_of
from cluster.core.turn.controls import generation_of
from cluster.protocol.requests import parse_request


def turn(body: dict, model_defaults: dict):
    """The response's echo and the engine's value for one request, as the driver builds them."""
    req = parse_request({"model": "m", "input": "hi", **body})
    sampling = sampling_of(req, model_defaults)
    response = build_response(response_id="r", model="m", request=req, previous_response_id=None, sampling=sampling)
    return {name: response[name] for name in SAMPLING}, dict(generation_of(req, [], 16, sampling).sampling)


def test_the_request_then_the_model_then_vllms_defaults_and_the_echo_is_what_runs():
    echoed, runs = turn({"presence_penalty": 0.5}, {"temperature": 0.0, "top_p": 0.9})
    assert echoed == runs == {"temperature": 0.0, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.0}
    echoed, runs = turn({"temperature": 0.7}, {"temperature": 0.0})
    assert echoed == runs == {"temperature": 0.7, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    echoed, runs = turn({}, {})  # no model defaults: vLLM's own
    assert echoed == runs == SAMPLING


def test_a_queued_or_background_response_reports_the_same_from_the_model_defaults():
    """Before a turn runs (`response.queued`, a background job) the response is built from the
    model's defaults directly; resolving again is a no-op, so it reports what will run."""
    req = parse_request({"model": "m", "input": "hi", "top_p": 0.5})
    direct = build_response(response_id="r", model="m", request=req, previous_response_id=None,
                            sampling={"temperature": 0.0})
    resolved = sampling_of(req, {"temperature": 0.0})
    assert {n: direct[n] for n in SAMPLING} == resolved == sampling_of(req, resolved)
