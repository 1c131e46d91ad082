"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, docstrings document fields."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
