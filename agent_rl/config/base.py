"""The base of every config section."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from agent_rl.config.secrets import redact


class Section(BaseModel):
    """Base for config sections: unknown keys are errors; the string under each field documents
    it for readers. Dumped in JSON mode (to be stored, shown or printed), a section has its
    secrets masked (`agent_rl.config.secrets`); Python mode keeps them for the process.

    pydantic could copy those strings into the fields' descriptions (`use_attribute_docstrings`),
    but it finds them by reading and parsing each class's source: half of the time importing the
    config took, in every command, for descriptions nothing reads."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap", when_used="json")
    def _redacted(self, handler: SerializerFunctionWrapHandler) -> Any:
        return redact(handler(self))
