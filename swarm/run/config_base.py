"""What every section of the run config is made of: strict models, and the error of a rule between fields.

runconfig.py (the root, ``RunConfig``) and averaging_config.py (the ``averaging`` section) build on it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CrossFieldError(ValueError):
    """A rule between fields; ``fields`` are their paths from the model that checks it, so that a
    loader can name them (pydantic places a model-level error at the model, not at its fields)."""

    def __init__(self, fields: tuple[str, ...], message: str):
        super().__init__(message)
        self.fields = fields


class Strict(BaseModel):
    """Unknown keys are errors: a typo in a config must not silently use a default."""

    model_config = ConfigDict(extra="forbid", frozen=True)
