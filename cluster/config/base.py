"""What every config section shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

TINY_MODEL_NAME = "loopserve-tiny"


class StrictModel(BaseModel):
    # Config typos must fail loudly at start-up, not be silently ignored. A field's docstring is
    # its description (docs/configuration.md is generated from them: `python -m cluster.config.docs`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
