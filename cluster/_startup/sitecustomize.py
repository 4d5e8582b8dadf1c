"""Runs at the start of every Python process whose PYTHONPATH holds this folder.

Engine processes get it (`cluster.app.engine_options`), and so do the
processes vLLM starts from them (it inspects models in a subprocess), so the
torch-extension guard (`cluster/torch_extras.py`) applies before transformers is
imported anywhere. Loaded by path: nothing else of loopserve is imported here.
Then the `sitecustomize` this one shadows, if any, runs as before.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_loopserve_torch_extras",
                                               os.path.join(os.path.dirname(_here), "torch_extras.py"))
_guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_guard)
_guard.hide_mismatched_extensions()

from importlib.machinery import PathFinder  # noqa: E402

_other = PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _other is not None and _other.loader is not None:
    _module = importlib.util.module_from_spec(_other)
    _other.loader.exec_module(_module)
