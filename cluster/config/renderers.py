"""Prompt renderers, each one record: the one place that names how a model family's prompt is made.

A renderer turns a conversation into the engine's token ids (`core/render/renderer.py` keeps it
incremental over a session). The model config picks one by name (`model.renderer`), or `auto`
picks the first record that claims the model. A new family's renderer is a function
(tokenizer, model config) -> IncrementalRenderer and one `register` call here. Data only: the
function is named by import path and loaded where a replica renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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


RENDERERS: dict[str, Renderer] = {}


def register(renderer: Renderer) -> Renderer:
    RENDERERS[renderer.name] = renderer
    return renderer


def renderer_of(model: ModelConfig) -> Renderer:
    if model.renderer != "auto":
        return RENDERERS[model.renderer]
    return next((r for r in RENDERERS.values() if r.claims(model)), RENDERERS["jinja"])


register(Renderer("mistral", "cluster.core.render.tokenizer:mistral_renderer",
                  claims=lambda model: model.tokenizer_mode == "mistral", reads_template=False))
register(Renderer("jinja", "cluster.core.render.tokenizer:jinja_renderer"))
