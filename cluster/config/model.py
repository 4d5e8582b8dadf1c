"""`model`: the served model, its weights and its family's formats."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from cluster.config.base import TINY_MODEL_NAME, StrictModel
from cluster.config.renderers import RENDERERS
from cluster.models.names import TINY_VISION, BuiltinModel

SHIPPED_TEMPLATES = Path(__file__).resolve().parents[1] / "models" / "templates"  # chat templates loopserve ships


class ImageInputConfig(StrictModel):
    """`input_image` parts for a vision model (data URLs; the model's processor and chat template
    turn them into its image tokens, vLLM runs them as multimodal input)."""

    max_per_context: int = Field(8, ge=1, le=256)
    """Images one conversation may hold, its history included (vLLM's `limit_mm_per_prompt`)."""
    max_image_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Largest image file one part may carry (decoded bytes)."""
    max_image_pixels: int = Field(4096 * 4096, ge=64 * 64, le=12_000 * 12_000)
    """Largest image one part may carry, in pixels (width x height, read from the file's header
    before anything is decoded): a small PNG can expand to GBs of RGB."""
    placeholder: Optional[str] = None
    """The text the chat template sees for an image; unset: the processor's `image_token`."""


class ModelConfig(StrictModel):
    """The served model: a local HF folder or hub id (`path`), or with no `path` a built-in
    model made on this machine without a download (`cluster/models/builtin.py`):
    `loopserve-tiny` (random weights, tests) or `smollm2-135m-instruct` (a real model)."""

    name: str = TINY_MODEL_NAME
    """The model name clients send (`model`) and responses report."""
    path: Optional[str] = None
    """A local Hugging Face folder or hub id of the weights; unset: the `builtin` model."""
    builtin: BuiltinModel = TINY_MODEL_NAME
    """With no `path`: the built-in model made on this machine (no download at run time)."""
    tokenizer_mode: Literal["auto", "mistral"] = "auto"
    """`mistral`: Mistral models' own tokenizer and request encoding (mistral_common), as vLLM's
    tokenizer_mode="mistral" (the folder holds tekken.json or tokenizer.model.v*)."""
    renderer: str = "auto"
    """How prompts are made (`cluster/config/renderers.py`): `jinja` (the tokenizer's chat template), `mistral`
    (mistral_common's request encoding), `harmony` (gpt-oss: openai-harmony's renderer, output read from the token
    ids); `auto`: the family's own (`harmony` for a gpt_oss model, `mistral` with `tokenizer_mode: mistral`, else
    `jinja`)."""
    tool_parser: str = "hermes"
    """The model family's tool-call format, as vLLM's tool parser name (`hermes`, `qwen3_xml`, `llama3_json`,
    `mistral`, ...)."""
    reasoning_parser: Optional[str] = None
    """vLLM's reasoning parser for the model family (`qwen3`, `deepseek_r1`, ...); None: `<think>` tags."""
    chat_template: Optional[str] = None
    """A Jinja chat template used instead of the tokenizer's own, as vLLM's `--chat-template`: a file path, or
    the name of one loopserve ships (`deepseek-r1.jinja`: vLLM's DeepSeek-R1 tool template,
    `cluster/models/templates/`). Unset: the tokenizer's."""
    max_model_len: int = 32768
    """Context length in tokens: a turn's prompt plus its output must fit."""
    images: Optional[ImageInputConfig] = None
    """Set for a vision model: `input_image` parts are served. Unset: text only (an image is a 400)."""

    @field_validator("renderer")
    @classmethod
    def _known_renderer(cls, name: str) -> str:
        if name != "auto" and name not in RENDERERS:
            raise ValueError(f"unknown renderer {name!r}: one of {['auto', *RENDERERS]}")
        return name

    @model_validator(mode="after")
    def _vision_builtin_takes_images(self) -> "ModelConfig":
        if self.path is None and self.builtin == TINY_VISION and self.images is None:
            self.images = ImageInputConfig()
        return self

    def chat_template_text(self) -> Optional[str]:
        """The text of `chat_template` (None: unset); a ValueError naming the file when it cannot be read."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        if not path.is_absolute() and not path.exists() and (SHIPPED_TEMPLATES / path).is_file():
            path = SHIPPED_TEMPLATES / path
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"model.chat_template: cannot read {str(path)!r} ({e.__class__.__name__}: {e})") from None

    def resolved_path(self) -> str:
        if self.path:
            return self.path
        from cluster.models.builtin import builtin_path

        return str(builtin_path(self.builtin))

    @property
    def is_generated(self) -> bool:
        return self.path is None

