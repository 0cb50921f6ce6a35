"""What the single-role stages (SFT, DPO) share: one Megatron actor group on Ray trained on batches of
examples in a resumable order, checkpointed in the trainer's layout and exported to HF at the end.

A stage's config is `megatron_training` (with its `stage`) and the stage's own section (`sft_config`,
`dpo_config`), composed with Hydra from its config folder and judged whole before Ray starts. Its
checkpoints resume the same stage exactly (weights, optimizer, RNG, data position) and are where the
next stage starts: `actor_config.load` of GRPO, `megatron_training.load` of DPO after SFT.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mindrl.config import ConfigError, resources
from mindrl.config.batching import Batching
from mindrl.config.keys import KeyNote, Keys, normalise
from mindrl.config.parallel import validate_parallel, validate_sequence_parallel
from mindrl.config.resources import Cluster, RoleResource
from mindrl.config.values import check_types, positive
from mindrl.console import say
from mindrl.trainer.config import compose
from mindrl.trainer.export import export_hf
from mindrl.trainer.megatron import MegatronConfig
from mindrl.trainer.metrics import METRICS_FILE, MetricsSink
from mindrl.trainer.prompts import PromptLoader, split_path
from mindrl.trainer.start import StartPoint, start_point
from mindrl.trainer.tracking import TrackingKeys, open_trackers


@dataclass(frozen=True)
class StageSection(TrackingKeys):
    """Where a stage's ranks run and where its TensorBoard events and tracker runs go."""

    #: the trainer's devices (num_npus | num_gpus | num_cpus): one rank per device, TP×PP×DP of them
    resource: RoleResource = dataclasses.field(default_factory=lambda: RoleResource("CPU", 1))
    use_tensorboard: bool = False
    tensorboard_dir: str | None = None
    #: seconds to wait for a running cluster (RAY_ADDRESS) to offer `resource` before giving up
    resource_wait_timeout: float = 600.0
    #: a private cluster (no RAY_ADDRESS) serves Ray's dashboard (needs `pip install "ray[default]"`)
    include_dashboard: bool = False
    #: each micro-batch's rows as one sequence without padding (docs/long_responses.md)
    use_remove_padding: bool = False
    #: with use_remove_padding: micro-batches cut by max_packing_token_size tokens instead of micro_batch_size rows
    use_dynamic_bsz: bool = False
    max_packing_token_size: int = 4096

    @classmethod
    def from_dict(cls, name: str, values: Mapping[str, Any], keys: Keys) -> StageSection:
        known = {f.name for f in dataclasses.fields(cls)}
        values = keys.split(name, values, known)
        if "resource" in values:
            values["resource"] = RoleResource.from_dict(f"{name}.resource", values["resource"])
        section = cls(**values)
        check_types(name, section)
        positive(name, section, "resource_wait_timeout", allow_zero=True)
        positive(name, section, "max_packing_token_size")
        try:
            _ = section.batching  # Batching refuses what the packing keys cannot mean together
        except ConfigError as err:
            raise ConfigError(f"{name}.{err}") from None
        if section.use_tensorboard and not section.tensorboard_dir:
            raise ConfigError(f"{name}.use_tensorboard needs tensorboard_dir, where the event files go.")
        section.check_tracking(name)
        section.check(name)
        return section

    def check(self, name: str) -> None:
        """The stage's own rules for its section."""

    @property
    def batching(self) -> Batching:
        return Batching(self.use_remove_padding, self.max_packing_token_size if self.use_dynamic_bsz else None)


@dataclass(frozen=True)
class StageConfig:
    training: MegatronConfig
    section: StageSection
    #: what loading it decided for a key the file left out, said once at start
    defaults_taken: tuple[str, ...] = ()

    #: the stage's `megatron_training.stage`, its section's name and type, and its config folder
    STAGE: ClassVar[str]
    SECTION: ClassVar[str]
    SECTION_TYPE: ClassVar[type[StageSection]]
    CONFIGS_DIR: ClassVar[Path]

    @property
    def save_dir(self) -> str | None:
        """Where the run writes its checkpoints, metrics and log."""
        return self.training.save

    @property
    def notices(self) -> tuple[str, ...]:
        """Keys that do nothing here, for the trainer to warn about once."""
        return (*self.defaults_taken, *self.training.inert_keys())

    @property
    def stage(self) -> str:
        return self.STAGE

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], notes: list[KeyNote] | None = None) -> StageConfig:
        """`notes` collects unsupported keys instead of raising (a MindSpeed-RL file being imported)."""
        keys = Keys(notes)
        data = dict(normalise(data))
        sections = ("model", "megatron_training", cls.SECTION)
        for key in data:
            if key not in sections:
                keys.unknown("", key, sections)
        given, section = _section_keys_from_megatron(cls, data)
        training = MegatronConfig.from_dict("megatron_training", given, data.get("model") or {}, keys,
                                            stage=cls.STAGE)
        notices = ()
        if cls.SECTION not in data and section:  # MindSpeed-RL's layout: the section's keys in megatron_training
            count = training.parallel.model_ranks
            section["resource"] = {"num_npus": count}
            notices = (f"{cls.SECTION}.resource is not set (a MindSpeed-RL {cls.STAGE} recipe takes its devices from "
                       f"its torchrun launch): mindrl trains on the layout's {count} NPUs, one data-parallel rank; "
                       f"set {cls.SECTION}.resource to train on more.",)
        cfg = cls(training, cls.SECTION_TYPE.from_dict(cls.SECTION, section, keys), notices)
        cfg.check()
        return cfg

    def check(self) -> None:
        t, devices = self.training, self.section.resource.count
        if t.data_path is None or t.tokenizer_name_or_path is None:
            raise ConfigError("megatron_training.data_path and tokenizer_name_or_path are required to train; point "
                              "them at cli/preprocess_data.py's output and the tokenizer it used.")
        try:
            validate_parallel(t.arch, t.parallel, world_size=devices)
            validate_sequence_parallel(t.arch, t.parallel)
        except ConfigError as err:
            raise ConfigError(f"megatron_training: {err}") from None
        if t.context_parallel_size > 1 and not self.section.use_remove_padding:
            raise ConfigError(f"megatron_training.context_parallel_size={t.context_parallel_size} cuts padding-free "
                              f"packed sequences over its ranks; set {self.SECTION}.use_remove_padding: true.")
        least = 2 * t.context_parallel_size
        if t.context_parallel_size > 1 and self.section.batching.max_tokens is not None and \
                self.section.batching.max_tokens < least:
            raise ConfigError(f"{self.SECTION}.max_packing_token_size={self.section.batching.max_tokens} is below 2 × "
                              f"context_parallel_size = {least} tokens, so its micro-batches would leave CP ranks "
                              f"without a token of their samples (each sample is cut in 2 × CP chunks); raise it to at "
                              f"least {least}.")
        dp = devices // t.parallel.model_ranks
        if t.global_batch_size % (dp * t.micro_batch_size):
            raise ConfigError(f"global_batch_size={t.global_batch_size} does not give each of the {dp} data-parallel "
                              f"ranks whole micro-batches of micro_batch_size={t.micro_batch_size}; make it a "
                              f"multiple of {dp * t.micro_batch_size}.")
        t.check_full_checkpoints("megatron_training")

    @classmethod
    def load(cls, config_name: str, overrides: Sequence[str] = (),
             config_dir: str | Path | None = None) -> StageConfig:
        """<CONFIGS_DIR>/<config_name>.yaml (or `config_dir`) with Hydra overrides, checked; raises ConfigError."""
        return cls.from_dict(compose(config_name, overrides, config_dir or cls.CONFIGS_DIR))


def _section_keys_from_megatron(cls: type[StageConfig], data: Mapping[str, Any]) -> tuple[dict, dict]:
    """megatron_training's keys and the stage section's: MindSpeed-LLM's stages read one namespace, so a MindSpeed-RL
    DPO file writes `dpo_loss_type` and `ref_model` in megatron_training; there they mean the section's keys."""
    training = dict(normalise(data.get("megatron_training") or {}))
    section = dict(normalise(data.get(cls.SECTION) or {}))
    fields = {f.name for f in dataclasses.fields(cls.SECTION_TYPE)}
    for key in [key for key in training if key in fields]:
        if key in section:
            raise ConfigError(f"{key} is given in megatron_training and in {cls.SECTION}; keep it in {cls.SECTION}.")
        section[key] = training.pop(key)
    return training, section


def check_resources(cfg: StageConfig, cluster: Cluster | None = None) -> None:
    """Raise ConfigError if `cluster` (default: this machine) cannot give the stage's devices."""
    resources.check_resources([(cfg.STAGE, cfg.section.resource)], cluster)


class StageTrainer(ABC):
    """The driver of a stage: subclasses read their examples, make their batches and name their rank class."""

    #: the `job` its checkpoints record (only the same job resumes them)
    JOB: ClassVar[str]
    #: the noun for one example in progress lines ("example", "pair")
    EXAMPLE: ClassVar[str]

    def __init__(self, cfg: StageConfig) -> None:
        from mindrl.data.tokenizer import load_tokenizer

        self.cfg, t = cfg, cfg.training
        self.start: StartPoint = start_point(t, self.JOB, section="megatron_training")
        self.tokenizer = load_tokenizer(t.tokenizer_name_or_path, t.arch)
        path = split_path(t.data_path, "train")
        examples, too_long = self.read_examples(path)
        say(f"{len(examples)} {self.JOB.upper()} {self.EXAMPLE}s from {path}"
            f"{f', {too_long} longer than seq_length={t.seq_length} left out' if too_long else ''}")
        self.loader = PromptLoader(examples, t.global_batch_size, t.seed, shuffle=not t.no_shuffle)
        pad = self.tokenizer.pad_token_id
        self.pad_id = self.tokenizer.eos_token_id if pad is None else pad
        self.group = self.sink = None
        self.dp_size = 0

    @abstractmethod
    def read_examples(self, path: Path) -> tuple[list, int]:
        """The training examples that fit seq_length, and how many did not."""

    @abstractmethod
    def rank_spec(self) -> tuple[type, Any]:
        """The Ray rank class and the spec its `setup` takes."""

    def stage_spec(self, spec_class: type, rows_per_example: int = 1, **extra: Any) -> Any:
        """`spec_class` (SFTSpec or a subclass) with what every stage's ranks are given: the layout, the actor's
        settings (`rows_per_example` rows per example of the batch), the precision and where to start or resume."""
        t = self.cfg.training
        actor = t.actor_config(t.global_batch_size, rows_per_example=rows_per_example,
                               batching=self.cfg.section.batching)
        return spec_class(t.arch, t.parallel, actor,
                          t.bf16, self.start.initial_weights, self.start.resume,
                          self.start.iteration if self.start.resume else None, self.start.bf16, not t.no_load_optim,
                          not t.no_load_rng, **extra)

    @abstractmethod
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next batch; its metrics."""

    def validate(self, step: int) -> dict[str, float]:
        """Held-out metrics after `step`, where the stage has them (logged with the step's)."""
        return {}

    def setup(self) -> None:
        from mindrl.trainer.cluster import connect_when_ready
        from mindrl.workers.group import COLLECTIVE_TIMEOUT_S, WorkerGroup

        t, section = self.cfg.training, self.cfg.section
        connect_when_ready(lambda cluster: check_resources(self.cfg, cluster), section.resource_wait_timeout,
                           section.include_dashboard)
        weights = self.start.initial_weights or f"random (seed {t.seed})"
        say(f"starting {section.resource.count} {self.JOB.upper()} ranks ({section.resource}), "
            f"{'resuming ' + self.start.resume if self.start.resume else 'weights ' + weights}")
        rank_class, spec = self.rank_spec()
        self.group = WorkerGroup(self.JOB, rank_class, section.resource)
        host, port = self.group.rendezvous(COLLECTIVE_TIMEOUT_S)
        ranks = self.group.call("setup", host, port, spec, COLLECTIVE_TIMEOUT_S)
        self.dp_size = ranks[0]["dp_size"]
        say(ranks[0]["precision"].line)
        if self.start.resume:
            self.loader.load_state_dict(ranks[0]["extra"]["data"])
            say(f"resumed from {self.start.resume} at iteration {self.start.iteration} "
                f"(epoch {self.loader.epoch}, {self.EXAMPLE} {self.loader.position})")
            if ranks[0]["schedule_note"]:
                say(f"warning: {ranks[0]['schedule_note']}")
        self.sink = MetricsSink(t.train_iters, Path(t.save) / METRICS_FILE if t.save else None,
                                section.tensorboard_dir if section.use_tensorboard else None, self.start.iteration,
                                trackers=open_trackers(section, t.save, self.JOB, self.cfg))

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if self.group is not None:
            self.group.kill()

    def fit(self) -> Path | None:
        """Train to train_iters; returns the final weights exported to HF (None without `save`)."""
        t = self.cfg.training
        try:
            self.setup()
            for step in range(self.start.iteration + 1, t.train_iters + 1):
                self.sink.log(step, {**self.train_step(), **self.validate(step)})
                if t.saves_at(step):
                    extra = {"job": self.JOB, "data": self.loader.state_dict(),
                             "initial_weights": self.start.initial_weights, "step": step}
                    self.group.call("save", t.save, step, extra)
            if not t.save:
                return None
            self.group.call("finish_saves")  # an asynchronous save's writes waited for before the export reads them
            return export_hf(t.save, t.tokenizer_name_or_path)
        finally:
            self.close()
