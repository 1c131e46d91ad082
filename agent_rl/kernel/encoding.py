"""How per-token facts are spelled wherever they cross a layer or a process: defined once here.

- A policy version is an `int` in our code, the store and the trainer (0 is the initial
  weights, each trainer step publishes the next), and a string label on SGLang's wire
  (`weight_version`, and `meta_info.weight_versions` spans). `version_label` writes it for
  SGLang, `policy_version` reads SGLang's label back; SGLang's own initial label is "default",
  which is version 0.
- `NO_VERSION` (-1) is the version of a token no policy sampled (prompt and tool observations),
  in the store's `versions` arrays and everything read from them.
- `NO_EXPERT` (-1) is the expert id of a token whose MoE routing the engine did not report (a
  turn's last token, never fed back, and padding): the store writes it, the batch pads with it,
  and routing replay (`trainer.routing_replay`) leaves such rows to free routing.

The router may import only the kernel and the config, so this lives here rather than in the
store; it imports nothing.
"""

from __future__ import annotations

NO_VERSION = -1
"""The policy version of a token no policy sampled (prompt and observation tokens)."""

NO_EXPERT = -1
"""The expert id of a token whose routing the engine did not report."""


def version_label(version: int | str) -> str:
    """The label SGLang carries for policy `version` (its `weight_version`); a label that is
    already a string (SGLang's own "default", one a client sent through the router) stays."""
    return version if isinstance(version, str) else str(version)


def policy_version(label: str | int | None) -> int:
    """The policy version SGLang's `weight_version` label names: its integer, or 0 for no label
    or one that is not ours (SGLang's initial "default")."""
    if label is None:
        return 0
    try:
        return int(label)
    except ValueError:
        return 0
