"""loopserve: the OpenAI Responses API for agent loops on Ray Serve.

`cluster` is the application: config schema, app builder, CLI and the I/O-free
core (`cluster.core`). `actors` holds the thin Ray Serve deployments.
"""

__version__ = "0.1.0"

# Before anything imports transformers or vLLM: see `cluster/torch_extras.py`.
from cluster.torch_extras import hide_mismatched_extensions as _hide  # noqa: E402

_hide()
