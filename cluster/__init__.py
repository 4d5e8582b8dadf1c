"""loopserve: the OpenAI Responses API for agent loops on Ray Serve.

`cluster` is the application: config schema, app builder, CLI and the I/O-free
core (`cluster.core`). `actors` holds the thin Ray Serve deployments.
"""

__version__ = "0.1.0"
