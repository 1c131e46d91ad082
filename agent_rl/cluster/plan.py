"""What a launch places: the run's roles as groups of `agent-rl` commands, made from the config.

A `Group` is what is placed and restarted as one: the router, each engine, each serve, and the
trainer's ranks together (a rank cannot rejoin a running torch.distributed job, so when one dies
the whole gang starts again from the latest checkpoint, as under torchrun). Every process is
the CLI command a user would run by hand on that node; placeholders in `args` are filled in
when it is placed: `{host}` and `{port}` with its node's address and a port free there,
`{router_url}` with where the router is.

Built in the `agent-rl launch` process and shipped to the supervisor actor, so it holds plain
data only (no Ray, no config objects).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agent_rl.config import Config, RoleResources
from agent_rl.kernel.errors import ConfigError


@dataclass
class Resources:
    """Ray's per-process reservation (see RoleResources)."""

    cpus: float
    custom: dict[str, float]

    @classmethod
    def of(cls, role: RoleResources, accelerator: str) -> Resources:
        custom = {k: v for k, v in role.resources.items() if v}
        if role.accelerators:
            custom[accelerator] = custom.get(accelerator, 0.0) + role.accelerators
        return cls(role.cpus, custom)

    def ray_options(self) -> dict[str, object]:
        """`num_cpus`/`num_gpus`/`resources` as an actor's or a bundle's options take them."""
        custom = dict(self.custom)
        gpus = custom.pop("GPU", 0.0)
        return {"num_cpus": self.cpus, "num_gpus": gpus, "resources": custom}

    def bundle(self) -> dict[str, float]:
        """As one bundle of a placement group (Ray refuses an empty one)."""
        return {k: v for k, v in {"CPU": self.cpus, **self.custom}.items() if v} or {"CPU": 0.01}


@dataclass
class Group:
    """Processes placed, watched and restarted together."""

    name: str
    kind: str
    """router | engine | serve | train."""
    args: list[str]
    """`agent-rl` arguments of each process (the same for every rank)."""
    resources: Resources
    ranks: int = 1
    """> 1: a torch.distributed gang (RANK, WORLD_SIZE, MASTER_ADDR... per process)."""
    strategy: str = "PACK"
    done_on_success: bool = False
    """A clean exit ends the role (the trainer reaching --until-version); others restart."""
    stop_signal: int = 15
    stop_grace_s: float = 30.0

    def process_names(self) -> list[str]:
        return [self.name] if self.ranks == 1 else [f"{self.name}-{r}" for r in range(self.ranks)]


@dataclass
class Plan:
    run: str
    cwd: str
    log_dir: str
    env: dict[str, str]
    """AGENT_RL_* settings of the launching shell, for every process."""
    groups: list[Group]
    router_port: int
    router_host: str | None
    admin_token: str | None = field(repr=False)
    max_restarts: int
    restart_delay_s: float
    ready_timeout_s: float

    def group(self, kind: str) -> list[Group]:
        return [g for g in self.groups if g.kind == kind]


STOP_ORDER = ["serve", "train", "engine", "router"]
"""Consumers before what they consume from: serves drain, the trainer checkpoints, then the
engines and the router go."""


def make_plan(cfg: Config, config_path: Path | None, *, until_version: int | None = None) -> Plan:
    """The groups of `cfg.cluster`, each running with the config at `config_path`."""
    c = cfg.cluster
    token = cfg.router.admin_token.get_secret_value() if cfg.router.admin_token else None
    if not (token or "").strip():
        raise ConfigError("agent-rl launch adds each engine to the router with its admin token: "
                          "set [router] admin_token (or AGENT_RL_ROUTER__ADMIN_TOKEN)")
    head = ["--config", str(config_path.resolve())] if config_path is not None else []
    env = {k: v for k, v in os.environ.items()
           if k.startswith("AGENT_RL_") and k != "AGENT_RL_CONFIG"}  # fmt: skip

    def res(role: RoleResources) -> Resources:
        return Resources.of(role, c.accelerator)

    groups = [Group("router", "router", [*head, "router", "--host", "{host}", "--port", "{port}"],
                    res(c.router_resources), stop_grace_s=10.0)]
    engine = [*head, "engine", "start", "--host", "{host}", "--port", "{port}"]
    groups += [Group(f"engine-{i}", "engine", engine, res(c.engine_resources), stop_grace_s=30.0)
               for i in range(c.engines)]  # fmt: skip
    serve = [*head, "serve", "--router-url", "{router_url}", "--no-api"]
    groups += [Group(f"serve-{i}", "serve", serve, res(c.serve_resources),
                     stop_grace_s=c.serve_drain_s) for i in range(c.serves)]  # fmt: skip
    if c.trainer_ranks:
        train = [*head, "train", "--router-url", "{router_url}"]
        if until_version is not None:
            train += ["--until-version", str(until_version)]
        groups.append(Group("train", "train", train, res(c.trainer_resources),
                            ranks=c.trainer_ranks, strategy=c.trainer_strategy,
                            done_on_success=True, stop_grace_s=c.trainer_stop_s))  # fmt: skip
    return Plan(run=cfg.run.name, cwd=os.getcwd(), log_dir=str(c.log_dir), env=env, groups=groups,
                router_port=cfg.router.port, router_host=c.router_host, admin_token=token,
                max_restarts=c.max_restarts, restart_delay_s=c.restart_delay_s,
                ready_timeout_s=c.ready_timeout_s)  # fmt: skip


def fill(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with each `{name}` placeholder replaced."""
    out = []
    for a in args:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out
