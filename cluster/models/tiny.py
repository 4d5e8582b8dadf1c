"""The default model: a tiny Llama with random weights, generated locally.

Nothing is downloaded: a byte-level BPE tokenizer is trained on text built
here from a fixed seed, and a 2-layer Llama is initialised from a fixed seed,
the way vLLM's dummy load format works. The chat template is ChatML with
Hermes-style tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`),
so vLLM's `hermes` tool parser decodes its tool calls.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

SEED = 1234
FORMAT_VERSION = "1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: decoded into output text so parsers can see them.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

def chatml_hermes_template(default_system: str = "") -> str:
    """ChatML with a Hermes tool section (`<tools>` in the system turn, `<tool_call>` JSON
    in assistant turns, `<tool_response>` in user turns): vLLM's `hermes` parser reads its
    calls. `default_system` is used when the conversation brings no system message."""
    default = ("{%- set default_system = " + json.dumps(default_system) + " %}") if default_system else \
        "{%- set default_system = '' %}"
    return default + (
        "{%- set has_system = messages and messages[0].role == 'system' %}"
        "{%- set system = messages[0].content if has_system else default_system %}"
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if system %}{{- system + '\\n\\n' }}{%- endif %}"
        "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
        "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
        "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
        "{%- elif system %}"
        "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'system' and loop.first %}"
        "{%- elif message.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
        "{%- for tc in message.tool_calls or [] %}"
        "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + tc.function.name + '\\\", \\\"arguments\\\": ' }}"
        "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
        "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHAT_TEMPLATE = chatml_hermes_template()

_WORDS = (
    "the of and to in is for that with on as it by this be are from at or an was have not can which "
    "file read write path line code function call tool result output input error test build run "
    "agent loop turn model token cache session response request server client socket stream event "
    "python import def class return self value list dict string number true false null json "
    "open close data config user assistant system message content text name arguments type "
    "shell command exit status directory src main index repo patch diff commit branch"
).split()


def _corpus(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(3000):
        n = rng.randint(4, 18)
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    for _ in range(400):
        args = {rng.choice(_WORDS): rng.choice(_WORDS) for _ in range(rng.randint(1, 3))}
        lines.append(json.dumps({"name": rng.choice(_WORDS), "arguments": args}))
        lines.append(f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(x, y=0):\n    return x + {rng.randint(0, 99)}")
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(ADDED_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_dir(path: Path, weights: bool = True) -> None:
    from transformers import GenerationConfig, LlamaConfig

    tokenizer = build_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=im_end,
        pad_token_id=eot,
        torch_dtype="float32",
    )
    generation = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot)
    save_random_model(path, "LlamaForCausalLM", config, generation, weights)
    tokenizer.save_pretrained(path)
    (path / "loopserve_model.json").write_text(json.dumps({"format": FORMAT_VERSION, "seed": SEED,
                                                           "weights": weights}))


def save_random_model(path: Path, model_class: str, config, generation, weights: bool) -> None:
    """A model of transformers' `model_class` initialised from SEED (as vLLM's dummy load format
    does) saved at `path`; without `weights`, its config only: what a node without torch serves
    the scripted engine with."""
    if weights:
        import torch
        import transformers

        torch.manual_seed(SEED)
        model = getattr(transformers, model_class)(config)
        model.generation_config = generation
        model.save_pretrained(path, safe_serialization=True)
    else:
        config.save_pretrained(path)
        generation.save_pretrained(path)


def _torch_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def ensure_tiny_model(path: str | os.PathLike, weights: bool | None = None) -> Path:
    """Generate the tiny model at `path` unless it is already there (safe across processes).

    `weights=None`: with weights when torch is installed (an engine node), else
    the tokenizer and config only (the scripted engine and the render path need
    no weights); a folder without weights gets them when an engine asks.
    """
    from cluster.models.folders import ensure_folder

    return ensure_folder(Path(path), FORMAT_VERSION, _torch_installed() if weights is None else weights,
                         build_model_dir)
