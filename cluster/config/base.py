"""What every config section shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

TINY_MODEL_NAME = "loopserve-tiny"


class StrictModel(BaseModel):
    # Config typos must fail loudly at start-up, not be silently ignored.
    model_config = ConfigDict(extra="forbid")
