"""The built-in models' names: the one place they are written (config, CLI and builders read them here)."""

from __future__ import annotations

from typing import Literal, get_args

BuiltinModel = Literal["smollm2-135m-instruct", "loopserve-tiny", "loopserve-tiny-vision", "loopserve-tiny-gptoss",
                       "loopserve-tiny-qwen3", "loopserve-tiny-llama3",
                       "loopserve-tiny-qwen3-coder", "loopserve-tiny-deepseek-r1"]
BUILTIN_NAMES: tuple[str, ...] = get_args(BuiltinModel)
SMOLLM2, TINY, TINY_VISION, TINY_GPTOSS, TINY_QWEN3, TINY_LLAMA3, TINY_QWEN3_CODER, TINY_DEEPSEEK_R1 = BUILTIN_NAMES
