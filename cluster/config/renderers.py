"""Prompt renderers, each one record: the one place that names how a model family's prompt is made.

A renderer turns a conversation into the engine's token ids (`core/render/renderer.py` keeps it
incremental over a session). The model config picks one by name (`model.renderer`), or `auto`
picks the first record that claims the model. A new family's renderer is a function
(tokenizer, model config) -> IncrementalRenderer and one `register` call here. Data only: the
function is named by import path and loaded where a replica renders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cluster.models.names import TINY_GPTOSS

ModelConfig = Any  # cluster.config.model.ModelConfig, which validates its renderer against this registry


@dataclass(frozen=True)
class Renderer:
    name: str
    build: str
    """`module:function` (tokenizer, model config) -> IncrementalRenderer."""
    claims: Callable[[ModelConfig], bool] = lambda model: False
    """With `renderer: auto`: whether this renderer is the model's (the first record that claims it wins)."""
    reads_template: bool = True
    """Its prompts come from the tokenizer's Jinja chat template: analysed and probed at start."""
    output: str = "text"
    """How the model's output is read: `text` (the decoded text, split by `model.tool_parser` and
    `model.reasoning_parser`) or `harmony` (the token ids, by openai-harmony's parser)."""


RENDERERS: dict[str, Renderer] = {}


def register(renderer: Renderer) -> Renderer:
    RENDERERS[renderer.name] = renderer
    return renderer


def renderer_of(model: ModelConfig) -> Renderer:
    if model.renderer != "auto":
        return RENDERERS[model.renderer]
    return next((r for r in RENDERERS.values() if r.claims(model)), RENDERERS["jinja"])


def _model_type(model: ModelConfig) -> str:
    """`model_type` of the model folder's config.json ("" when there is no local folder to read)."""
    try:
        return str(json.loads((Path(model.resolved_path()) / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError):
        return ""


register(Renderer("harmony", "cluster.core.render.harmony:harmony_renderer", reads_template=False, output="harmony",
                  claims=lambda model: (model.is_generated and model.builtin == TINY_GPTOSS)
                  or _model_type(model) == "gpt_oss"))
register(Renderer("mistral", "cluster.core.render.tokenizer:mistral_renderer",
                  claims=lambda model: model.tokenizer_mode == "mistral", reads_template=False))
register(Renderer("jinja", "cluster.core.render.tokenizer:jinja_renderer"))
