"""`trainer.weight_sync.mode = "disk"` (the default): every engine loads each HF export.

The loop writes an export every `export_every` steps; this sync asks the router to have every
engine in rotation load it (`/update_weights_from_disk`, which the router sends to the engines
one after another, pausing each by its `update_pause_mode`). Nothing is pushed from memory, so
no connection between trainer and engines is needed beyond the router's HTTP.
"""

from __future__ import annotations

from pathlib import Path

from trainer.weight_sync.base import WeightSync


class DiskSync(WeightSync):
    """The engines load the exports; see the module docstring."""

    in_memory = False

    async def exported(self, export: Path, version: int) -> bool:
        await self.load(export, version)
        return True
