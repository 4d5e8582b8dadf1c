"""What a request asks the engine to generate, as one value (`Generation`): built once from the
request against the model's sampling defaults (`core/turn/controls.generation_of`), carried whole
by `EngineRequest`, mapped by each backend to its engine (vLLM: `SamplingParams`). A new sampling
option is a field here, its line in `generation_of`, and its line in the backend's mapping."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class Generation:
    max_tokens: int
    temperature: Optional[float] = None  # None: the engine's own default (no model default known)
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    tools: Sequence[dict[str, Any]] = ()  # ToolSpec: the tools the model is offered, normalized
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    # The request's `text.format` ({"type": "json_schema", "schema": ...} | {"type": "json_object"}).
    text_format: Optional[dict[str, Any]] = None

    def sampling(self) -> dict[str, float]:
        """The sampling parameters it sets (an engine's defaults fill the rest)."""
        return {name: value for name in SAMPLING if (value := getattr(self, name)) is not None}
