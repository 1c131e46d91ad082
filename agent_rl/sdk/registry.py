"""Environment registry: `register` an id, `make` an instance, discover third-party packages.

Gymnasium's shape:

    register("my-env", entry_point="my_pkg.env:MyEnv", max_turns=4)   # lazy: nothing imported
    @register("my-env")                                                # or on the class itself
    class MyEnv(Env): ...
    env = make("my-env", max_turns=8)                                  # kwargs override defaults
    register("fam", entry_point="pkg:Fam", id_argument="name")         # a family of ids:
    env = make("fam:x")                                                # Fam(name="x")

Where registrations come from, shown by `agent-rl envs list`:
- `builtin`: the environments in this project's `envs/` package (imported on first use);
- `entry point: <distribution> <version>`: installed packages that declare the entry-point
  group `agent_rl.envs`. `name = "pkg.mod:Class"` registers id `name` lazily (the package is
  imported only when the env is made); a value without `:` names a module that is imported
  and calls `register` itself;
- `module <name>`: anything else that called `register` (a script, a test).
A broken third-party package never breaks the registry: its error is kept and listed.
"""

from __future__ import annotations

import contextvars
import importlib
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any, TypeVar

from agent_rl.sdk.env import Env, EnvCodeError
from agent_rl.kernel.errors import EnvError

ENTRY_POINT_GROUP = "agent_rl.envs"
BUILTIN_PACKAGE = "envs"
BUILTIN = "builtin"

E = TypeVar("E", bound=type[Env])


@dataclass(frozen=True)
class EnvSpec:
    """One registered environment."""

    id: str
    entry_point: str
    """`module:Class` of the Env subclass."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Defaults passed to the constructor (overridden by `make`'s kwargs)."""
    source: str = ""
    """Where the registration came from: builtin, an entry point's distribution, or a module."""
    env_class: type[Env] | None = field(default=None, compare=False, repr=False)
    """The class itself when registered with one (it may not be importable by name)."""
    id_argument: str | None = None
    """A family of ids: `{id}:{value}` makes this env with `{id_argument}=value` (e.g.
    `verifiers:my-taskset` passes `env="my-taskset"`)."""


@dataclass(frozen=True)
class LoadError:
    """A plugin that could not be loaded, kept for `envs list`."""

    source: str
    message: str


_specs: dict[str, EnvSpec] = {}
_errors: list[LoadError] = []
_discovered = False
_current_source: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "agent_rl_env_source", default=None
)


def register(
    id: str, entry_point: str | type[Env] | None = None, *, id_argument: str | None = None,
    **kwargs: Any,
) -> Any:
    """Register `id`; without `entry_point`, return a class decorator that registers the class.
    With `id_argument`, `id` also names a family: `{id}:{value}` is made with that keyword
    argument set to `value`."""
    if entry_point is None:

        def decorate(cls: E) -> E:
            register(id, cls, id_argument=id_argument, **kwargs)
            return cls

        return decorate
    env_class = None
    if isinstance(entry_point, type):
        if not issubclass(entry_point, Env):
            raise EnvError(
                f"register({id!r}): {entry_point.__name__} is not a subclass of agent_rl.Env"
            )
        env_class, entry_point = entry_point, f"{entry_point.__module__}:{entry_point.__qualname__}"
    if ":" not in entry_point:
        raise EnvError(
            f"register({id!r}): entry_point {entry_point!r} must look like 'package.module:Class'"
        )
    source = _source_for(entry_point)
    _add(
        EnvSpec(
            id=id, entry_point=entry_point, kwargs=dict(kwargs), source=source,
            env_class=env_class, id_argument=id_argument,
        )
    )
    return None


def make(id: str, /, **kwargs: Any) -> Env:
    """A new instance of environment `id`; `kwargs` override the registered defaults."""
    s = spec(id)
    cls = load_class(s)
    try:
        env = cls(**{**s.kwargs, **kwargs})
    except EnvError:
        raise
    except Exception as e:
        raise EnvCodeError(id, "__init__", e, traceback.format_exc()) from e
    env.env_id = id
    return env


def spec(id: str) -> EnvSpec:
    discover()
    try:
        return _specs[id]
    except KeyError:
        family, colon, value = id.partition(":")
        base = _specs.get(family) if colon else None
        if base is not None and base.id_argument is not None:
            if not value:
                raise EnvError(f"environment id {id!r} names no {base.id_argument}: "
                               f"write {family}:<{base.id_argument}>") from None
            return replace(base, id=id, kwargs={**base.kwargs, base.id_argument: value})
        known = ", ".join(sorted(_specs)) or "none"
        raise EnvError(
            f"unknown environment {id!r}; registered: {known} (see `agent-rl envs list`)"
        ) from None


def specs() -> list[EnvSpec]:
    """Every registered environment, sorted by id."""
    discover()
    return [_specs[k] for k in sorted(_specs)]


def load_errors() -> list[LoadError]:
    discover()
    return list(_errors)


def load_class(s: EnvSpec) -> type[Env]:
    """Import the spec's entry point; EnvError (with the traceback) if that fails."""
    if s.env_class is not None:
        return s.env_class
    module_name, _, qualname = s.entry_point.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise EnvCodeError(s.id, "import", e, traceback.format_exc()) from e
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise EnvError(f"{s.id}: entry point {s.entry_point} is not a subclass of agent_rl.Env")
    return obj


def discover(*, force: bool = False) -> None:
    """Load the built-in environments and every `agent_rl.envs` entry point (once)."""
    global _discovered
    if _discovered and not force:
        return
    _discovered = True
    if force:
        _errors.clear()
    with _from_source(BUILTIN):
        try:
            importlib.import_module(BUILTIN_PACKAGE)
        except Exception as e:
            _errors.append(
                LoadError(BUILTIN, f"importing {BUILTIN_PACKAGE}: {type(e).__name__}: {e}")
            )
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        source = _entry_point_source(ep)
        try:
            if ep.attr:
                if ep.name in _specs and _specs[ep.name].entry_point != ep.value:
                    raise EnvError(
                        f"id {ep.name!r} is already registered ({_specs[ep.name].source})"
                    )
                _add(EnvSpec(id=ep.name, entry_point=ep.value, source=source))
            else:
                with _from_source(source):
                    importlib.import_module(ep.module)
        except Exception as e:
            _errors.append(LoadError(source, f"{ep.name} = {ep.value}: {type(e).__name__}: {e}"))


def unregister(id: str) -> None:
    """Remove a registration (tests, and scripts that re-register while developing)."""
    _specs.pop(id, None)


def _add(s: EnvSpec) -> None:
    old = _specs.get(s.id)
    if old is not None and old.entry_point != s.entry_point:
        raise EnvError(
            f"environment id {s.id!r} is already registered to {old.entry_point} ({old.source}): "
            "pick another id or unregister the old one"
        )
    _specs[s.id] = s


def _source_for(entry_point: str) -> str:
    current = _current_source.get()
    if current is not None:
        return current
    module = entry_point.partition(":")[0]
    if module == BUILTIN_PACKAGE or module.startswith(BUILTIN_PACKAGE + "."):
        return BUILTIN
    return f"module {module}"


def _entry_point_source(ep: metadata.EntryPoint) -> str:
    dist = ep.dist
    if dist is None:
        return "entry point"
    return f"entry point: {dist.metadata['Name']} {dist.version}"


@contextmanager
def _from_source(source: str) -> Iterator[None]:
    token = _current_source.set(source)
    try:
        yield
    finally:
        _current_source.reset(token)


def describe(s: EnvSpec) -> dict[str, Any]:
    """A JSON-able summary of one spec plus what an instance says about itself (or why it
    cannot be made): what `agent-rl envs list` shows."""
    row: dict[str, Any] = {
        "id": s.id,
        "source": s.source,
        "entry_point": s.entry_point,
        "kwargs": s.kwargs,
        "description": "",
        "tools": [],
        "sandbox": None,
        "demonstration": None,
        "error": None,
    }
    if s.id_argument is not None:  # a family: nothing to make without its argument
        row["description"] = f"a family of environments: {s.id}:<{s.id_argument}>"
        return row
    try:
        env = make(s.id)
        row["tools"] = sorted(env.toolset)
        row["sandbox"] = env.needs_sandbox
        row["demonstration"] = env.has_demonstration()
        doc = (type(env).__doc__ or "").strip()
        row["description"] = doc.splitlines()[0] if doc else ""
    except EnvError as e:
        row["error"] = str(e)
    return row
