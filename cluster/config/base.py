"""What every config section shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from cluster.models.names import TINY as TINY_MODEL_NAME


class StrictModel(BaseModel):
    # Config typos must fail loudly at start-up, not be silently ignored. A field's docstring is
    # its description (docs/configuration.md is generated from them: `python -m cluster.config.docs`).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
