"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for config sections: unknown keys are errors; the string under each field documents
    it for readers.

    pydantic could copy those strings into the fields' descriptions (`use_attribute_docstrings`),
    but it finds them by reading and parsing each class's source: half of the time importing the
    config took, in every command, for descriptions nothing reads."""

    model_config = ConfigDict(extra="forbid")
