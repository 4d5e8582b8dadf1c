"""Where model folders live, and building one once, atomically, across processes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

MODEL_CACHE = Path(os.environ.get("LOOPSERVE_MODEL_CACHE", Path.home() / ".cache" / "loopserve"))
DEFAULT_MODEL_DIR = Path(
    os.environ.get("LOOPSERVE_MODEL_DIR", Path.home() / ".cache" / "loopserve" / "tiny-chat")
)


def _complete(marker: Path, fmt: str, weights: bool) -> bool:
    if not marker.exists():
        return False
    meta = json.loads(marker.read_text())
    return meta.get("format") == fmt and (meta.get("weights", True) or not weights)


def ensure_folder(path: Path, fmt: str, weights: bool, build: Callable[[Path, bool], None]) -> Path:
    """Build a model folder once, atomically, safe across processes (replicas start together)."""
    marker = path / "loopserve_model.json"
    if _complete(marker, fmt, weights):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _complete(marker, fmt, weights):
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            build(tmp, weights)
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return path


def save_random_model(path: Path, config, generation, weights: bool, seed: int = 1234) -> None:
    """A generated model's folder: random weights from `config` in its dtype (seeded: every build
    is the same model), or its config and generation config alone (`weights=False`: a tokenizer-only
    folder for the scripted engine)."""
    if not weights:
        config.save_pretrained(path)
        generation.save_pretrained(path)
        return
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, str(config.dtype).removeprefix("torch.")))
    model.generation_config = generation
    model.save_pretrained(path, safe_serialization=True)
