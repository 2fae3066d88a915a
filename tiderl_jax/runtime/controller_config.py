"""The controller's configuration (`ControllerConfig`): modes, batch and group sizes, device groups,
ERS, Belayer and BiDiRL options, each checked when built. JAX-free; `controller.py` re-exports it."""

from __future__ import annotations

import dataclasses

from tiderl_jax.agents import tasks as task_lib
from tiderl_jax.model.config import ConfigError
from tiderl_jax.policies import routing, staleness

MODES = ("sync", "async", "tiderl")


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    mode: str = "tiderl"
    steps: int = 10  # optimizer updates
    groups_per_step: int = 4  # GRPO groups (prompts) per update
    group_size: int = 4  # samples per group
    eta: int | None = None  # staleness bound; None: the mode's default (sync 0, else 1)
    max_concurrent: int = 32  # tasks in flight
    task_kinds: tuple[str, ...] = ("calculator",)
    data_seed: int = 0  # train-split generator seed
    # device groups (async / tiderl); sync uses every device for both roles
    device_group_size: int = 2
    rollout_groups: int = 2
    ref_groups: int = 1  # 0: the ref always runs on the train devices (colocated)
    train_groups: int = 1
    tensor: int = 2
    # the rollout service (serving/): "mesh", one engine over every rollout device; "group", one engine replica
    # per rollout device group (sync: per `device_group_size` devices) behind the router, the unit ERS moves
    rollout_replicas: str = "mesh"
    router: str = "least_loaded"  # the service's routing policy: policies.routing.POLICIES
    # the workload mixture the trainer asks for ("agentic=48.6,rlvr=33.1,rlhf=18.2"; the main job's mixture.target):
    # MISA-T's target; "": its default (the paper's)
    mixture_target: str = ""
    ers_patience: int = 2
    ers_cooldown: int = 3
    # speed one more device group adds to a role, as a fraction of linear, assumed until a move
    # measures it (ERS weighs a move's predicted gain against its measured cost)
    ers_scaling: float = 1.0
    ers_economics: bool = True  # False: a persistent deficit moves a group whatever it costs
    # TideRL's mechanisms one by one (mode tiderl; ablations such as launch/simulate.py's ladder): `ctb`
    # False rolls out request-level (KV evictable between turns, as async) instead of Continuous Task
    # Batching; `ers` False never moves a device group. RA2P is on whenever the layout has ref groups.
    ctb: bool = True
    ers: bool = True
    checkpoint_every: int = 0  # steps; 0: only at the end and on interrupt
    # dynamic sampling (DAPO, Yu et al. 2025; veRL's algorithm.filter_groups): a complete group whose rewards are
    # all equal is dropped (ledger `dropped:zero_variance`) and another sampled in its place, so every update has
    # `groups_per_step` informative groups; after `filter_groups_limit` such groups in a row the run stops, named
    filter_groups: bool = False
    filter_groups_limit: int = 64
    # Belayer (faults/env_recovery.py): each environment in a subprocess, checkpointed at turn
    # boundaries by the cost rule; a crash restores and rewinds (or redoes from turn 0) within
    # `env_max_retries`, then the sample is dropped with its reason
    env_workers: bool = False
    # Belayer (faults/engine_worker.py): the rollout engine in a worker process with a warm standby,
    # health checks and token checkpoints (request-level rollout: sync / async modes)
    engine_workers: bool = False
    engine_worker_warmup: bool = True  # workers compile every program before serving (tests skip it)
    # consecutive unanswered health checks (0.2 s apart) that fail a worker; a worker answers between
    # engine steps, so this must cover the longest step (compiles included when warmup is off)
    engine_worker_health_checks: int = 3
    env_checkpoint: str = "belayer"  # "belayer" | "always" | "never"
    env_p_fail: float = 0.05  # probability an environment fails before the next turn boundary
    env_max_retries: int = 3
    env_step_timeout_s: float = 20.0  # below the rollout's env_timeout_s, which would cancel the recovery
    # BiDiRL borrowing within a step (module docstring; async / tiderl, a backend with `lend`)
    bidirl: bool = False
    bidirl_scaling: float = 1.0  # speed a borrowed device adds (fraction of an own one), until measured

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError(f"controller.mode={self.mode!r} is not one of {MODES}")
        for name in ("steps", "groups_per_step", "group_size", "max_concurrent", "device_group_size",
                     "filter_groups_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"controller.{name}={getattr(self, name)} must be >= 1")
        if self.max_concurrent < self.group_size:
            raise ConfigError(f"controller.max_concurrent={self.max_concurrent} must hold one group "
                              f"(group_size={self.group_size})")
        if self.rollout_replicas not in ("mesh", "group"):
            raise ConfigError(f"controller.rollout_replicas={self.rollout_replicas!r} is not 'mesh' (one engine "
                              f"over the rollout devices) or 'group' (one replica per device group)")
        if self.router not in routing.POLICIES:
            raise ConfigError(f"controller.router={self.router!r} is not one of {sorted(routing.POLICIES)}")
        self.router_config()  # a mixture target that cannot be parsed is named here
        if self.engine_workers and self.kv_mode == "ctb":
            raise ConfigError("controller.engine_workers serve request-level rollouts (modes sync, async); "
                              "tiderl's CTB keeps KV across tool calls in its own engine")
        if self.bidirl and self.mode == "sync":
            raise ConfigError("controller.bidirl borrows between separate rollout and train pools: "
                              "modes async and tiderl (sync shares one mesh)")
        if not 0 < self.bidirl_scaling <= 1:
            raise ConfigError(f"controller.bidirl_scaling={self.bidirl_scaling} must be in (0, 1]")
        try:  # the mode's staleness rule, named before anything runs (not when the controller starts)
            self.staleness
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not self.task_kinds or any(k not in task_lib.GENERATORS for k in self.task_kinds):
            raise ConfigError(f"controller.task_kinds={self.task_kinds} must be non-empty, from "
                              f"{sorted(task_lib.GENERATORS)}")

    @property
    def staleness(self) -> staleness.StalenessConfig:
        return staleness.staleness_config(self.mode, self.eta)

    @property
    def kv_mode(self) -> str:
        """The rollout's KV handling: "ctb" (tiderl with CTB on) or "request"."""
        return "ctb" if self.mode == "tiderl" and self.ctb else "request"

    @property
    def batch_samples(self) -> int:
        return self.groups_per_step * self.group_size

    def router_config(self) -> routing.RouterConfig:
        """The rollout service's router settings: MISA-T's target mixture from `mixture_target`."""
        if not self.mixture_target:
            return routing.RouterConfig()
        from tiderl_jax.data.mixture import parse_mixture
        from tiderl_jax.policies.misa_t import MISATConfig
        try:
            target = parse_mixture(self.mixture_target)
        except ValueError as e:
            raise ConfigError(f"controller.mixture_target: {e}") from None
        return routing.RouterConfig(misa_t=MISATConfig(target=target))
