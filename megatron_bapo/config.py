"""The run's configuration: one YAML file, one nested dataclass per component, validated at start.

    python -m megatron_bapo.train --config examples/configs/tiny_bapo.yaml trainer.total_steps=50

Sections: `trainer` (loop, checkpoints, logging), `model` (the initial HF policy), `data` (prompts,
`megatron_bapo.data.DatasetConfig`),
`rollout` (servers, group sampling, partial rollout), `reward`, `advantage`, `actor` (the Megatron
actor, `megatron_bapo.actor.ActorConfig`), `sync` (weight sync to the servers), `eval` (periodic
validation, `megatron_bapo.eval.EvalConfig`). `bapo_preset` picks a named BAPO configuration
(`bapo`, `bapo-paper`, `bapo-verl`, `grpo`, `clip-higher`); explicit `actor.bapo.*` keys override it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.algorithms.checks import check_advantages
from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.algorithms.distill import DistillConfig, check_distill
from megatron_bapo.config_io import ConfigError, apply_overrides, from_dict, to_dict
from megatron_bapo.data.config import DatasetConfig
from megatron_bapo.eval.config import EvalConfig
from megatron_bapo.rewards.judge_config import JudgeConfig, check_judge_use
from megatron_bapo.rollout.agent import AgentConfig
from megatron_bapo.rollout.config import ENGINES, PartialRolloutConfig, RolloutClientConfig
from megatron_bapo.rollout.roles import ROLES, ServerRoleConfig, check_role_gpus
from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig, check_cpu_support, required_server_flags
from megatron_bapo.sync.config import SyncConfig


DYNAMIC_SAMPLING = ("off", "filter", "refill")
"""`rollout.dynamic_sampling` (rollout.dynamic_sampling.DynamicSampler)."""

PENALTY_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}
"""SGLang sampling keys that change the logits before the returned log-prob, with their neutral values."""


@dataclass
class TrainerConfig:
    """The loop itself: how long, where outputs go, how often to checkpoint."""

    output_dir: str = "runs/bapo"
    """Checkpoints (`checkpoints/`), TensorBoard (`tb/`), weight-sync HF dirs (`hf_sync/`), eval records."""
    total_steps: int = 100
    """RL steps (one rollout batch -> `ppo_epochs x n_minibatches` optimizer steps -> one weight sync)."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted); 0 keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in `output_dir` if there is one."""
    seed: int = 1
    """Seeds the prompt order and the rollout sampling seeds (the actor has `actor.seed`)."""
    eval_at_start: bool = True
    """Run the `eval` datasets once before the first step (the baseline at step 0), when eval is on."""
    async_steps: int = 0
    """How many RL steps rollout may run ahead of training. 0: the synchronous loop (generate,
    train, sync). k >= 1: rank 0 keeps generating the groups of steps n+1..n+k while the actor
    trains step n; every token keeps its behavior log-prob and the version that produced it, and
    `rollout.max_staleness` still bounds what is trained (per token)."""
    driver_process: bool = False
    """Run the rollout driver (server pool, client, rewards, evaluation, metrics) in a process of its
    own on rank 0's node instead of inside rank 0's training process (`megatron_bapo.driver_process`):
    its HTTP and reply parsing then never compete with rank 0's share of training, and it also cuts
    every rank's slice of the batch. The recipes at scale turn it on; off, a one-process run starts a
    few seconds faster."""
    progress: bool = True
    """tqdm progress bar on rank 0's console."""
    console_every: int = 10
    """Every this many steps (and at the last step) rank 0 prints one compact line on the console,
    e.g. `step 50/150  reward 0.410  acc 0.400  c_low 0.60 c_high 1.55  rho 0.28->0.40  entropy 0.31
    1.1 s/step` (means over the steps since the previous line; rho: the positive-contribution
    balance before -> after the bound search); 0 = never. Eval results get their own line."""
    log_level: str = "INFO"
    """Level of `<output_dir>/logs/train.log` (rank 0's full log: DEBUG, INFO, WARNING or ERROR);
    the console shows warnings and errors, the progress bar and the `console_every` lines."""
    cpu_group_timeout_minutes: int = 360
    """Timeout of the gloo group every rank uses for objects: the scatter of each step's batch and the
    decisions rank 0 broadcasts. The other ranks wait in it while rank 0 alone generates a rollout
    round, evaluates or writes its part of a checkpoint: minutes at 32B and 64k tokens, so the
    default is 6 hours (torch's default, 30 minutes, would end a slow step in a timeout)."""
    max_steps_without_update: Optional[int] = None
    """The run stops (`progress error:`, exit 2, naming the last steps' reasons: stale groups
    regenerated, no group finished, groups filtered or failed) after this many consecutive steps
    without an optimizer update, instead of exiting 0 having trained nothing. null: derived from
    the config, `2 x (rollout segments per response + async_steps) + 2` (`RunConfig.
    steps_without_update_limit`, which argues why a healthy run never reaches it); 0: never stop."""

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.save_every < 0:
            raise ConfigError(f"trainer.save_every must be >= 0, got {self.save_every}")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"trainer.keep_checkpoints must be >= 0, got {self.keep_checkpoints}")
        if self.console_every < 0:
            raise ConfigError(f"trainer.console_every must be >= 0, got {self.console_every}")
        if self.cpu_group_timeout_minutes < 1:
            raise ConfigError(f"trainer.cpu_group_timeout_minutes must be >= 1, got {self.cpu_group_timeout_minutes}")
        if self.async_steps < 0:
            raise ConfigError(f"trainer.async_steps must be >= 0, got {self.async_steps}")
        if self.max_steps_without_update is not None and self.max_steps_without_update < 0:
            raise ConfigError(f"trainer.max_steps_without_update must be >= 0 or null, got {self.max_steps_without_update}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"trainer.log_level must be DEBUG/INFO/WARNING/ERROR, got {self.log_level!r}")


@dataclass
class ModelConfig:
    hf_path: str = ""
    """HF directory of the initial policy (weights, config, tokenizer); also what servers start from."""

    def __post_init__(self) -> None:
        if not self.hf_path:
            raise ConfigError("model.hf_path must be set to an HF checkpoint directory (tools/make_tiny.py makes one)")


@dataclass
class RolloutConfig(PartialRolloutConfig):
    """Where rollouts come from and how they are sampled (design section 3 steps 2-3).

    The section IS the partial-rollout manager's config (`group_size`, `max_response_tokens`,
    `segment_tokens`, `max_staleness`, `max_context_tokens`, and `sampling`: SGLang sampling
    parameters) plus what the driver needs around it; `client` is the rollout client's config. The
    components receive these objects as they are: no field is copied or defaulted twice.
    """

    prompts_per_step: int = 8
    """Groups per RL step (the batch is `prompts_per_step x group_size` responses)."""
    engine: str = "builtin"
    """The servers the run starts itself (when `client.urls` and `client.router_url` are empty):
    "builtin" (the built-in CPU server, `megatron_bapo/server/`) or "sglang" (real SGLang servers,
    `sglang.launch_server`, as `sglang` says: on CPU from the venv `tools/install.sh --with-sglang`
    builds, on GPUs on the GPUs it names). Either way they start with the flags the run relies on,
    are waited for, and a crashed one is restarted and given the current weights."""
    num_builtin_servers: int = 1
    """How many servers the run starts (of `engine`) when `client.urls` and `client.router_url` are
    empty."""
    builtin_server_dtype: str = "float32"
    """The built-in servers' `--dtype`: "float32" (log-probs match the fp32 trainer's to ~1e-6) or
    "bfloat16" (as SGLang serves on GPUs: a real training-inference mismatch, see docs/bapo.md).
    SGLang servers take `sglang.dtype`."""
    builtin_server_decode_delay_ms: float = 0.0
    """The built-in servers' `--decode-delay-ms`: milliseconds added to every generation step, so a CPU
    run rehearses a slow (large-model) server: syncs meeting segments in flight, long responses
    spanning syncs (tests, `benchmarks/bench_control_plane.py`). 0: as fast as the CPU goes."""
    sglang: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)
    """How `engine: sglang` launches its servers: the Python with SGLang, CPU or GPUs (which ones),
    TP size, dtype, KV memory, more flags (`megatron_bapo/rollout/sglang_launch.py`)."""
    client: RolloutClientConfig = field(default_factory=RolloutClientConfig)
    """Servers, router, concurrency, timeouts, retries, API key (`client.health_timeout_s` also bounds
    the built-in servers' start)."""
    max_failed_group_rate: float = 0.5
    """A step in which the servers rejected (4xx) the requests of more than this fraction of the
    groups that ended in it (failed, or finished: trained, dropped by dynamic sampling or carried
    over) stops the run with their message (a setting, not the data, is wrong); 1 disables."""
    max_server_restarts: int = 3
    """Times the trainer restarts a built-in server that died (each restart counted and logged)."""
    dynamic_sampling: str = "off"
    """What a step trains of the groups that finished (`rollout.dynamic_sampling`): "off" (all of
    them, as before), "filter" (drop groups whose rewards are all equal: they carry no GRPO signal),
    "refill" (DAPO: drop them and draw more prompts, in further rollout rounds of the same step,
    until `prompts_per_step` groups with non-zero reward variance are ready or
    `max_refill_rounds` is reached; surplus finished groups wait in the buffer for the next step).
    Metrics: `rollout/zero_variance_frac`, `rollout/refill_rounds`, `rollout/refill_cap_hit`."""
    max_refill_rounds: int = 8
    """With `dynamic_sampling: refill`, extra rollout rounds per step at most; a step that reaches it
    trains what it has and logs `rollout/refill_cap_hit` = 1."""
    refill_headroom: float = 0.1
    """With `dynamic_sampling: refill`, the reserve of groups with signal each round's draw aims to
    have finished ahead, as a fraction of what the pipeline needs (`rollout/refill_forecast.py`):
    0.1 keeps refill at ~1 rollout round per step at the 32B recipe's proportions (docs/rollout.md);
    0 draws just the expected need (more steps then need a refill round); larger values carry more
    finished groups between steps (older when trained)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with tools (`rollout.agent.tools`, docs/rollout.md#multi-turn-rollouts-with-tools);
    no tools: single-turn. Evaluation runs the same agent loop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prompts_per_step", "num_builtin_servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in ENGINES:
            raise ConfigError(f"rollout.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "sglang" and not self.client.urls and not self.client.router_url:
            self.sglang.resolved_python()  # SGLang is installed (before any model is built)
            if self.sglang.resolved_device() == "cpu":
                check_cpu_support(required_server_flags(deterministic_inference=self.deterministic_inference,
                                                        pause_mode=None, routed_experts=self.return_routed_experts))
        if self.dynamic_sampling not in DYNAMIC_SAMPLING:
            raise ConfigError(f"rollout.dynamic_sampling must be one of {DYNAMIC_SAMPLING}, got {self.dynamic_sampling!r}")
        if self.max_refill_rounds < 1:
            raise ConfigError(f"rollout.max_refill_rounds must be >= 1, got {self.max_refill_rounds}")
        if not 0 <= self.refill_headroom <= 4:
            raise ConfigError(f"rollout.refill_headroom must be in [0, 4], got {self.refill_headroom}")
        if self.builtin_server_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"rollout.builtin_server_dtype must be 'float32' or 'bfloat16', got "
                              f"{self.builtin_server_dtype!r}")
        if not self.builtin_server_decode_delay_ms >= 0:
            raise ConfigError(f"rollout.builtin_server_decode_delay_ms must be >= 0, got "
                              f"{self.builtin_server_decode_delay_ms}")
        if not 0 < self.max_failed_group_rate <= 1:
            raise ConfigError(f"rollout.max_failed_group_rate must be in (0, 1], got {self.max_failed_group_rate}")
        if self.max_server_restarts < 0:
            raise ConfigError(f"rollout.max_server_restarts must be >= 0, got {self.max_server_restarts}")
        sp = self.sampling
        if sp.temperature <= 0:
            raise ConfigError(f"rollout.sampling.temperature must be > 0 for RL sampling, got {sp.temperature}")
        # The trainer recomputes the behavior distribution as softmax(logits / temperature); truncated
        # sampling (top-p / top-k) changes the distribution in a way it cannot reproduce, so the
        # importance ratios (and BAPO's bounds) would be wrong. Evaluation may truncate (eval.top_p).
        if sp.top_p != 1.0:
            raise ConfigError(f"rollout.sampling.top_p={sp.top_p}: training rollouts must sample the full "
                              f"distribution (top_p: 1.0), which the trainer's log-probs reproduce; eval.top_p may be below 1")
        if sp.top_k != -1:
            raise ConfigError(f"rollout.sampling.top_k={sp.top_k}: training rollouts must sample the full "
                              f"distribution (top_k: -1), which the trainer's log-probs reproduce")
        bad = sorted({"top_p", "top_k", "min_p", "temperature"} & set(sp.extra))
        if bad:
            raise ConfigError(f"rollout.sampling.extra sets {bad}; use rollout.sampling.temperature (the others "
                              f"truncate the distribution, which training cannot reproduce)")
        # Penalties change the logits before the log-prob SGLang returns (also with
        # SGLANG_RETURN_ORIGINAL_LOGPROB); the trainer cannot reproduce them, so every importance
        # ratio would be biased without a warning.
        penalties = {k: v for k, v in sp.extra.items() if k in PENALTY_NEUTRAL and v != PENALTY_NEUTRAL[k]}
        if penalties:
            raise ConfigError(f"rollout.sampling.extra sets {penalties}: penalties change the logits before the "
                              f"log-prob the server returns, which the trainer cannot reproduce (biased importance "
                              f"ratios); remove them (eval.* may use them)")
        if "sampling_seed" in sp.extra:
            raise ConfigError("rollout.sampling.extra.sampling_seed: per-request seeds come from trainer.seed when "
                              "rollout.deterministic_inference is true; remove it")


@dataclass
class RewardConfig:
    fn: str = "math"
    """Built-in name ("math", "math_last_number", "arithmetic"), "package.module:function", or "judge"
    (a judge model's verdict, `judge`)."""
    num_workers: int = 4
    """Threads scoring in parallel (the math reward checks in worker processes with timeouts)."""
    timeout_s: float = 60.0
    """A plugin reward runs in worker processes; a call still running after this scores 0 ("timeout")."""
    max_failure_rate: float = 0.5
    """A step where the reward FUNCTION failed (raised, timed out, returned a non-number) on more
    than this fraction of the responses stops the run, naming the reward and sample errors; 1
    disables. (Responses without a valid answer are not failures of the function.)"""
    overlong_buffer_tokens: int = 0
    """DAPO's soft overlong punishment: L_cache, the last tokens before `rollout.max_response_tokens`
    over which a linear length penalty grows from 0 to -`overlong_penalty` (`rewards.overlong`);
    0 = off. Logged as `reward/overlong_penalty_mean` and `reward/num_overlong_penalized`."""
    overlong_penalty: float = 1.0
    """The penalty at the limit (DAPO: 1, the scale of a correct answer)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The judge of `fn: judge` and `eval.reward: judge`: its servers, prompt template, parse rule,
    sampling, timeout and what a missing verdict does (`megatron_bapo/rewards/judge_config.py`)."""

    def __post_init__(self) -> None:
        if self.overlong_buffer_tokens < 0:
            raise ConfigError(f"reward.overlong_buffer_tokens must be >= 0 (0 = off), got {self.overlong_buffer_tokens}")
        if not self.overlong_penalty >= 0:
            raise ConfigError(f"reward.overlong_penalty must be >= 0, got {self.overlong_penalty}")
        if not self.timeout_s > 0:
            raise ConfigError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if not 0 < self.max_failure_rate <= 1:
            raise ConfigError(f"reward.max_failure_rate must be in (0, 1], got {self.max_failure_rate}")
        if self.num_workers < 0:
            raise ConfigError(f"reward.num_workers must be >= 0, got {self.num_workers}")


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    """"grpo": (r - mean) / (std + eps) per group; "dr_grpo": r - mean (no std division)."""
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.estimator not in ("grpo", "dr_grpo"):
            raise ConfigError(f"advantage.estimator must be 'grpo' or 'dr_grpo', got {self.estimator!r}")
        if self.eps < 0:
            raise ConfigError(f"advantage.eps must be >= 0, got {self.eps}")


@dataclass
class RunConfig:
    model: ModelConfig
    data: DatasetConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    teacher: ServerRoleConfig = field(default_factory=ServerRoleConfig)
    """The teacher's servers (on-policy distillation), beside the policy's; never weight-synced."""
    judge: ServerRoleConfig = field(default_factory=ServerRoleConfig)
    """A judge model's servers (model-graded rewards), beside the policy's; never weight-synced."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from `teacher` (`algorithms.distill`): acts only when the run has a teacher."""
    bapo_preset: Optional[str] = None
    """Named BAPO configuration; `actor.bapo.*` keys given explicitly override its fields."""

    def __post_init__(self) -> None:
        ro = self.rollout
        check_role_gpus(ro.sglang.gpu_ids if ro.engine == "sglang" else None, {r: getattr(self, r) for r in ROLES})
        # Distributed sync, rollout ahead and no pause: each bucket's update waits for every in-flight
        # /generate (SGLang's writer lock; a 16k-token segment can outlast the group timeout) while the
        # trainer already broadcasts, and between buckets queued requests run on half-updated weights.
        if self.sync.method == "distributed" and self.trainer.async_steps > 0 and self.sync.pause_mode is None:
            raise ConfigError(
                f"sync.method=distributed with trainer.async_steps={self.trainer.async_steps} needs sync.pause_mode "
                f"(abort, retract or in_place): without a pause each bucket waits for the generation in flight and "
                f"requests between buckets run on half-updated weights; set sync.pause_mode=abort or "
                f"trainer.async_steps=0")
        if self.reward.overlong_buffer_tokens > ro.max_response_tokens:
            raise ConfigError(
                f"reward.overlong_buffer_tokens={self.reward.overlong_buffer_tokens} is longer than "
                f"rollout.max_response_tokens={ro.max_response_tokens}: the penalty's ramp must end at the limit; "
                f"use at most {ro.max_response_tokens} (DAPO: a quarter of it)")
        check_judge_use(self.reward.fn, self.reward.judge, self.eval.reward,
                        eval_on=self.eval.every_n_steps > 0 and bool(self.eval.datasets))
        if self.actor.routing_replay and not ro.return_routed_experts:
            raise ConfigError("actor.routing_replay=true replays the experts the rollout servers chose, which they "
                              "return only when asked: set rollout.return_routed_experts=true")
        try:  # the advantage settings against the groups they are computed on (algorithms.checks, .distill)
            check_distill(self.distill, has_teacher=self.teacher.enabled, temperature=ro.sampling.temperature,
                          dynamic_sampling=ro.dynamic_sampling)
            check_advantages(self.advantage.estimator, self.advantage.eps, ro.group_size, ro.dynamic_sampling,
                             teacher_signal=self.teacher.enabled)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        batch = ro.prompts_per_step * ro.group_size
        if batch % self.actor.n_minibatches:
            raise ConfigError(
                f"actor.n_minibatches={self.actor.n_minibatches} must divide the batch "
                f"rollout.prompts_per_step x rollout.group_size = {batch}"
            )
        # A response spans num_segments steps, and async rollout adds async_steps versions of lag on top:
        # a hard cap below that would reset every long response again and again. (The per-token cap,
        # rollout.max_staleness, may be lower: the oldest tokens of long responses then leave the loss.)
        lag = ro.num_segments - 1 + self.trainer.async_steps
        cap = ro.group_staleness_cap
        if cap is not None and cap < lag:
            raise ConfigError(
                f"rollout.max_group_staleness={cap} < {lag}: a {ro.max_response_tokens}-token response takes "
                f"{ro.num_segments} segment(s) of {ro.segment_budget} tokens (one per step) and rollout runs "
                f"trainer.async_steps={self.trainer.async_steps} step(s) ahead, so its first tokens are {lag} versions "
                f"old when it finishes and every long response would be regenerated forever; raise "
                f"rollout.max_group_staleness (or leave it null: derived), rollout.segment_tokens or lower "
                f"trainer.async_steps")
        # A fresh run makes no update before its first responses are complete (num_segments - 1 steps).
        limit = self.trainer.max_steps_without_update
        if limit and limit < ro.num_segments:
            raise ConfigError(
                f"trainer.max_steps_without_update={limit} would stop a healthy run: a {ro.max_response_tokens}-token "
                f"response takes {ro.num_segments} steps (segments of {ro.segment_budget} tokens), so the first "
                f"{ro.num_segments - 1} steps of a run make no update; use >= {ro.num_segments}, null (derived) "
                f"or 0 (never)")


    def steps_without_update_limit(self) -> int:
        """Consecutive steps without an optimizer update after which the run stops (0: never).

        The default never fires on a healthy run: during steps without an update there is no weight
        sync, so no pause cuts a segment short and no version changes. Every buffered sample then
        advances one full segment per round and finishes within `num_segments` rounds; a group is
        regenerated (past `rollout.max_group_staleness`) at most once, when the stretch begins (its
        tokens cannot age while the version stands still), and the `async_steps` rounds produced
        ahead were made before it.
        So a healthy run has at most `num_segments + async_steps + 1` such steps in a row (a fresh run
        `num_segments - 1` at its start, before any response is complete); the default is twice that.
        """
        explicit = self.trainer.max_steps_without_update
        if explicit is not None:
            return explicit
        return 2 * (self.rollout.num_segments + self.trainer.async_steps) + 2


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML + dotted overrides -> validated RunConfig; `bapo_preset` fills `actor.bapo` defaults."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides)
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and rollout.get("dynamic_sampling") is False:
        rollout["dynamic_sampling"] = "off"  # YAML 1.1 reads an unquoted `off` as false
    if "filter_uniform_groups" in (data.get("advantage") or {}):
        raise ConfigError("advantage.filter_uniform_groups was replaced by rollout.dynamic_sampling: filter (the same "
                          "drop of groups with equal rewards; refill draws more prompts instead); remove the key")
    preset = data.get("bapo_preset")
    if preset is not None:
        try:
            base = dataclasses.asdict(BapoConfig.preset(str(preset)))
        except ValueError as exc:
            raise ConfigError(f"bapo_preset: {exc}") from None
        actor = dict(data.get("actor") or {})
        actor["bapo"] = {**base, **(actor.get("bapo") or {})}
        data["actor"] = actor
    for section, key in (("model", "hf_path"), ("data", "path")):
        if not isinstance(data.get(section), dict) or not data[section].get(key):
            raise ConfigError(f"{section}.{key} must be set (in the YAML or as {section}.{key}=... on the command line)")
    return from_dict(RunConfig, data)


def dump_run_config(config: RunConfig) -> str:
    """The resolved config as YAML (written next to every run so it can be reproduced); a secret
    (`rollout.client.api_key`, a role's `client.api_key`, `reward.judge.api_key`) is masked, never written to the run directory."""
    data = to_dict(config)
    for section in ("rollout", *ROLES):
        if data[section]["client"].get("api_key"):
            data[section]["client"]["api_key"] = "***"
    if data["reward"]["judge"].get("api_key"):
        data["reward"]["judge"]["api_key"] = "***"
    return yaml.safe_dump(data, sort_keys=False)
