"""Wire protocol of the Responses API: request validation, errors, framing.

The Response object and stream events themselves are `openai.types.responses`
models (see `cluster.core.events`); this package holds what the server adds.
"""
