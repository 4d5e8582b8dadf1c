"""`limits`: bounds on what one request may ask for."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from cluster.config.base import StrictModel


class LimitsConfig(StrictModel):
    """Bounds on what one request may ask for (each answered with a 4xx in the API's shape)."""

    max_input_items: int = Field(10_000, ge=1)
    """Items in one request's `input`."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Bytes of an HTTP request body."""
    max_context_tokens: Optional[int] = Field(None, ge=1)
    """Prompt tokens of a turn's whole context (history + new input); default: the model's max_model_len."""
    max_context_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Payload bytes one conversation's state may keep in memory (all items, rendered or not): what a single chain
    can pin in a replica's caches."""
    max_background: int = Field(256, ge=1)
    """`background: true` responses running at once on one replica (429 beyond)."""
    max_background_per_tenant: int = Field(64, ge=1)
    """Of those, what one tenant may have running (429 beyond): one key cannot take every slot."""
    shared_across_replicas: Optional[bool] = None
    """Keys' limits (`requests_per_minute`, `reads_per_minute`, `max_connections`) hold for the whole app, not
    per connection replica: each replica reports what it admitted to one `LimitsAndVerdicts` replica about once a
    second and counts what the others hold (a key may overshoot by what the others admitted in that second).
    None: on when the connection deployment can run more than one replica (`num_replicas` > 1, `auto`, or
    autoscaling); false: each replica enforces them alone (they multiply with the replicas)."""

