"""The error hierarchy of agent-rl, one class per boundary a failure crossed.

A failure inside one episode (a tool, a sandbox, the environment's code, the engine) is
recorded on that episode with its cause and never takes down the others; a failure of the
process's own setup (config, store) stops the command with a one-line message that says how
to fix it. Messages are written for the person who has to act on them.
"""

from __future__ import annotations


class AgentRLError(Exception):
    """Base of every error agent-rl raises on purpose."""


class ConfigError(AgentRLError):
    """The configuration (file, environment variables, flags) is invalid."""


class StoreError(AgentRLError):
    """The trajectory store cannot be reached, is behind its migrations, or refused a write."""


class SchemaBehindError(StoreError):
    """The database schema is older than this version of agent-rl expects."""


class NotFoundError(StoreError):
    """A row asked for by id does not exist."""


class LeaseLostError(StoreError):
    """A trainer tried to commit groups whose claim it no longer holds."""


class EnvError(AgentRLError):
    """User environment code raised; recorded on the episode with its traceback."""


class ToolError(AgentRLError):
    """A tool call was malformed or its implementation failed."""


class ToolArgumentsError(ToolError):
    """The model's arguments for a tool do not fit the tool's schema (the model's mistake, told
    to it in one line; the tool never ran)."""


class SandboxError(AgentRLError):
    """A sandbox could not be created, crashed, or broke its protocol."""


class EngineError(AgentRLError):
    """The inference engine (or the router in front of it) failed or is unreachable."""


class EngineUnavailableError(EngineError):
    """No engine received the request: the router answered 503 (no worker registered, all
    quarantined or breaker-open, none could be connected to), or no connection to the router
    or engine could be opened (it is down or restarting). Nothing was generated, so the request
    may be sent again."""


class ClusterError(AgentRLError):
    """The cluster a launch runs on (Ray, a Slurm allocation) refused or lost what was asked of
    it: a job that could not be submitted, an address with no cluster behind it."""
