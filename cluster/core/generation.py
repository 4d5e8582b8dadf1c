"""What a request asks the engine to generate, as one value (`Generation`): built once from the
request against the model's sampling defaults (`core/turn/controls.generation_of`), carried whole
by `EngineRequest`, mapped by each backend to its engine (vLLM: `SamplingParams`). A new sampling
option is the request's field (protocol/requests.py) and its line in `SAMPLING` here: the engine
runs it (vLLM's `SamplingParams` takes the same name) and the response echoes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

# Each sampling parameter a request may set, by its name in the request, the response and vLLM's
# `SamplingParams`, with vLLM's default: what runs when neither the request nor the model sets it.
SAMPLING: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def sampling_of(request: Any, model_defaults: Mapping[str, float]) -> dict[str, float]:
    """The sampling a request runs with: its own values, else the model's defaults (its
    generation_config.json), else vLLM's. What the engine runs and what the response reports
    (`build_response`) are this one value; given its own result again it returns it unchanged."""
    return {name: value if (value := getattr(request, name, None)) is not None else model_defaults.get(name, default)
            for name, default in SAMPLING.items()}


@dataclass(frozen=True, slots=True)
class Generation:
    max_tokens: int
    # `sampling_of` the request (a partial mapping: the engine's own defaults fill the rest).
    sampling: Mapping[str, float] = field(default_factory=dict)
    tools: Sequence[dict[str, Any]] = ()  # ToolSpec: the tools the model is offered, normalized
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    # The request's `text.format` ({"type": "json_schema", "schema": ...} | {"type": "json_object"}).
    text_format: Optional[dict[str, Any]] = None
