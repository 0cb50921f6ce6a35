"""The Megatron-native rollout backend: the actor generates with its own GPTModel stage.

For machines where vLLM cannot be installed (and as a fallback anywhere), the actor's
parameters, TP/PP layout and process groups do the generation themselves, so a weight
sync has nothing to move. Every rank of one model-parallel replica calls `generate` with
the same prompts; prompts × n samples decode as one batch with a KV cache (prefill once
per prompt, then one token per step), the last stage's sampler draws, and every rank of
the replica returns the same result. Design notes: docs/rollout.md, "Megatron-native backend".
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig

from mindrl.config import ConfigError, ModelArch, ParallelConfig
from mindrl.data.images import PromptImages
from mindrl.models.moe import record_routes, recorded_routes
from mindrl.models.vision import mrope_positions
from mindrl.platform import get_platform
from mindrl.rollout.base import RolloutEngine, RolloutResult
from mindrl.rollout.config import SamplingConfig, check_megatron_rollout
from mindrl.rollout.megatron_batch import DecodeRows, Responses
from mindrl.rollout.megatron_kv_cache import DecodeWriter, KVCache, PrefillWriter
from mindrl.rollout.megatron_links import ExpertLockstep, ReplicaLinks
from mindrl.rollout.megatron_sampling import sample
from mindrl.rollout.megatron_stage import KVWriter, StageForward

#: dead rows are dropped from the batch once they are at least this share of it
_COMPACT_SHARE = 1 / 8


@contextmanager
def routes_recorded(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """The routers record their picks for the duration (nothing when `on` is false)."""
    if not on:
        yield
        return
    record_routes(model, True)
    try:
        yield
    finally:
        record_routes(model, False)


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode and no autograd for the duration, then every module's own training flag back."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in flags:
            module.training = training


@contextmanager
def plain_tensor_parallel(model: torch.nn.Module) -> Iterator[None]:
    """A sequence-parallel model's modules in plain tensor parallelism for the duration, then back.

    A decode step feeds one token per row, which no sequence cut over the TP ranks can split. The weights and the
    arithmetic are the same either way: only which collective joins the tensor-parallel partial sums (all-reduce,
    not reduce-scatter) and where the norms run (on every rank, not on a shard) differ. megatron-core's
    set_model_to_sequence_parallel misses the copies of the config that the experts and attention keep, and does
    not restore what it found; here every module that reads the flag is switched, and switched back."""
    if not model.config.sequence_parallel:
        yield
        return
    switched = [(m, "sequence_parallel") for m in model.modules()
                if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    switched += [(m, "reduce_scatter_embeddings") for m in model.modules()
                 if isinstance(m, LanguageModelEmbedding | VocabParallelEmbedding)]
    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), TransformerConfig)}
    switched += [(c, "sequence_parallel") for c in configs.values()]
    before = [getattr(obj, name) for obj, name in switched]
    for obj, name in switched:
        setattr(obj, name, False)
    try:
        yield
    finally:
        for (obj, name), value in zip(switched, before, strict=True):
            setattr(obj, name, value)


class MegatronEngine(RolloutEngine):
    """Generation with this rank's stage of the actor's (unwrapped) GPTModel.

    Construction is collective over the model-parallel group (the ranks agree on which one
    samples). `max_num_seqs` caps the rows (prompts × n) decoded together — the KV cache
    holds that many rows of prompt + response slots; `max_num_batched_tokens` caps the
    padded prompt tokens of one prefill forward.
    """

    name = "megatron"
    shares_actor_weights = True

    def __init__(self, model: GPTModel, arch: ModelArch, par: ParallelConfig, eos_token_ids: Sequence[int],
                 max_model_len: int, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 record_routes: bool = False) -> None:
        layout = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if layout != (par.tp, par.pp):
            raise ValueError(f"the engine was given TP={par.tp} PP={par.pp} but the model runs in Megatron's "
                             f"TP={layout[0]} PP={layout[1]} groups; pass the actor's parallel config.")
        check_megatron_rollout(arch, par, record_routes)
        self.recording = record_routes
        self._routes: torch.Tensor | None = None  # the last forward's, while recording
        for key, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                           ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}.")
        self.vision = arch.vision
        self.vocab_size = arch.padded_vocab_size  # the model's own vocabulary; TP padding rows are never drawn
        eos = list(eos_token_ids)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in eos):
            raise ValueError(f"eos_token_ids {eos} must be token ids below the vocabulary size {self.vocab_size}.")
        self.model = model
        self.max_model_len, self.max_num_seqs, self.max_num_batched_tokens = (
            max_model_len, max_num_seqs, max_num_batched_tokens)
        self.device = next(model.parameters()).device
        self.dtype = model.config.params_dtype
        self.hidden_size = model.config.hidden_size
        self.eos = torch.tensor(eos, dtype=torch.long, device=self.device)
        self.stage = StageForward(model)
        self.links = ReplicaLinks(self.device)
        self.lockstep = ExpertLockstep(self.device)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, n: int = 1,
                 images: list[PromptImages | None] | None = None,
                 max_tokens: Sequence[int] | None = None) -> RolloutResult:
        """Collective over the model-parallel group; the same result on every rank of it."""
        self._check_request(prompts, n, images)
        images = images or [None] * len(prompts)
        caps = list(max_tokens) if max_tokens is not None else [sampling.max_tokens] * len(prompts)
        if len(caps) != len(prompts) or min(caps, default=1) < 1:
            raise ValueError(f"max_tokens needs a positive budget for each of the {len(prompts)} prompts, got {caps}.")
        result = RolloutResult([], [], [])
        # Sample i * n + j draws with its own generator seeded seed + i * n + j (the vLLM backend's
        # per-request seeds), so it does not depend on how the rows are batched.
        seed = secrets.randbits(62) if sampling.seed is None else sampling.seed
        per_wave = max(1, self.max_num_seqs // n)
        if self.recording:
            result.routes = []
        with generation_mode(self.model), plain_tensor_parallel(self.model), get_platform().rollout_calls(), \
                routes_recorded(self.model, self.recording):
            for start in range(0, len(prompts), per_wave):
                wave = self._wave(prompts[start:start + per_wave], sampling, n, seed + start * n,
                                  images[start:start + per_wave], caps[start:start + per_wave])
                result.responses += wave.responses
                result.log_probs += wave.log_probs
                result.finish_reasons += wave.finish_reasons
                if self.recording:
                    result.routes += wave.routes
            self.lockstep.until_all_done(self._idle_forward)
        return result

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: generation reads the actor's parameters themselves, so whatever the
        optimizer last wrote is what the next `generate` uses; a sync never needs to call this."""

    def release_memory(self) -> None:
        """The KV cache lives only inside `generate`; hand the allocator's cached blocks back."""
        get_platform().empty_cache()

    def close(self) -> None:
        self.model = self.stage = None

    def _check_request(self, prompts: list[list[int]], n: int, images: list[PromptImages | None] | None) -> None:
        if self.model is None:
            raise RuntimeError("this Megatron rollout engine was closed; build a new one.")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} image entries for {len(prompts)} prompts; give one (None: no image) "
                             f"per prompt.")
        if images and self.vision is None and any(i is not None for i in images):
            raise ConfigError("the prompts come with images but the actor has no vision tower to see them; use a "
                              "vision-language model or text-only prompts.")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}.")
        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty; every prompt needs at least one token id.")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {index} has {len(prompt)} tokens, which leaves no room for a response "
                                 f"within max_model_len={self.max_model_len}; shorten it or raise max_model_len.")
            if min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise ValueError(f"prompt {index} holds a token id outside the model's vocabulary "
                                 f"[0, {self.vocab_size}).")

    def _wave(self, prompts: list[list[int]], sampling: SamplingConfig, n: int, seed: int,
              images: list[PromptImages | None], caps: list[int]) -> RolloutResult:
        """`prompts` × n rows as one batch, left-padded to the longest prompt; row r draws with a
        generator seeded `seed + r`."""
        device, count = self.device, len(prompts) * n
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        budgets = torch.minimum(self.max_model_len - lengths, torch.tensor(caps, device=device)).repeat_interleave(n)
        longest = int(budgets.max())
        tokens = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
        pads = (width - lengths).unsqueeze(1)
        slots = torch.arange(width, device=device)
        valid = slots >= pads
        cache = KVCache(len(self.stage.layers), valid, n, self.stage.kv_heads, max(longest - 1, 1), self.stage.head_dim,
                        self.dtype, self.stage.value_dim)
        positions, following, pixels = (slots - pads).clamp(min=0), lengths, [None] * len(prompts)
        if self.vision is not None:
            positions, following, pixels = self._image_positions(tokens, pads, images)
        rows = DecodeRows(following.repeat_interleave(n), budgets,
                          [torch.Generator(device=device).manual_seed(seed + row) for row in range(count)])
        responses = Responses(count, longest, self.eos)
        first, prompt_routes = self._prefill(tokens, positions, valid, cache, pixels)
        drawn, log_probs = self._draw(None if first is None else first.repeat_interleave(n, dim=0), sampling, rows)
        ids = torch.arange(count, device=device)  # the wave's row of each row still decoding
        response_routes = None
        for step in range(longest):
            if step:  # feed token step - 1 of every row at its response slot, draw token step
                logits = self._run(drawn.unsqueeze(1), rows.position.unsqueeze(1), DecodeWriter(cache, step - 1))
                rows.position = rows.position + 1
                drawn, log_probs = self._draw(logits, sampling, rows)
                if self.recording:
                    if response_routes is None:
                        response_routes = self._routes.new_zeros((count, longest, *self._routes.shape[2:]))
                    response_routes[ids, step - 1] = self._routes[:, 0]
            alive = responses.record(step, rows, drawn, log_probs)
            if alive == 0:
                break
            if cache.rows - alive >= _COMPACT_SHARE * cache.rows:
                keep = rows.live.nonzero().squeeze(1)
                cache.keep(keep, step)
                rows.keep(keep)
                drawn, ids = drawn[keep], ids[keep]
        result = responses.result()
        if self.recording:
            if response_routes is None:  # every response is one token long: none was fed back
                response_routes = prompt_routes.new_zeros((count, 0, *prompt_routes.shape[2:]))
            result.routes = [torch.cat([prompt_routes[row // n, int(pads[row // n, 0]):],
                                        response_routes[row, :len(response) - 1]]).cpu()
                             for row, response in enumerate(result.responses)]
        return result

    def _image_positions(self, tokens: torch.Tensor, pads: torch.Tensor, images: list[PromptImages | None]
                         ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor] | None]]:
        """A vision-language wave's multimodal positions [3, prompts, width] (padding at 0), each prompt's
        position of the token after it (past its images' grids, so its response continues where HF's rope
        delta puts it), and each prompt's (pixel_values, image_grid_thw) or None; only the first stage, which
        embeds the images, has their pixels made (every stage needs the grids)."""
        positions = torch.zeros(3, *tokens.shape, dtype=torch.long, device=self.device)
        following = torch.empty(len(tokens), dtype=torch.long, device=self.device)
        pixels = [entry.pixels() if entry is not None and self.stage.first else None for entry in images]
        for row, (ids, pad, entry, made) in enumerate(zip(tokens, pads[:, 0].tolist(), images, pixels, strict=True)):
            if made is not None:
                grid = made[1]
            else:
                grid = None if entry is None else entry.grids()
            mine = mrope_positions(ids[pad:].unsqueeze(0), grid, self.vision)[:, 0]
            positions[:, row, pad:] = mine
            following[row] = mine.max() + 1
        return positions, following, pixels

    def _prefill(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache,
                 pixels: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor | None,
                                                                                 torch.Tensor | None]:
        """Each prompt once, in chunks of at most max_num_batched_tokens padded tokens, into the prompt
        cache its samples share. The sampler gets the last position's logits; while recording, the prompts'
        routes [prompts, width, MoE layers, top-k] come back too."""
        count, width = tokens.shape
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        itself = torch.eye(width, dtype=torch.bool, device=self.device)  # a padding query attends only to itself
        per_chunk = max(1, self.max_num_batched_tokens // width)
        firsts, routes = [], []
        for start in range(0, count, per_chunk):
            chunk = slice(start, start + per_chunk)
            mask = (causal & (valid[chunk].unsqueeze(1) | itself)).unsqueeze(1)
            shown = [entry for entry in pixels[chunk] if entry is not None]
            images = tuple(torch.cat(part).to(self.device) for part in zip(*shown, strict=True)) if shown else None
            logits = self._run(tokens[chunk], positions[..., chunk, :], PrefillWriter(cache, start, mask), images)
            if logits is not None:
                firsts.append(logits)
            if self.recording:
                routes.append(self._routes)
        return torch.cat(firsts) if firsts else None, torch.cat(routes) if routes else None

    def _idle_forward(self) -> None:
        """A one-token forward whose result nobody reads: its only use is the all-to-alls it takes part in."""
        token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        cache = KVCache(len(self.stage.layers), torch.ones(1, 1, dtype=torch.bool, device=self.device), 1,
                        self.stage.kv_heads, 1, self.stage.head_dim, self.dtype, self.stage.value_dim)
        self._forward(token, token,
                      PrefillWriter(cache, 0, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)))

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, writer: KVWriter,
             images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """This stage's share of one forward: full-vocabulary logits [rows, vocab] on the sampler, None elsewhere."""
        self.lockstep.before_forward()
        return self._forward(tokens, positions, writer, images)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, writer: KVWriter,
                 images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        inputs = tokens
        if not self.stage.first:
            inputs = self.links.receive_hidden((tokens.shape[1], tokens.shape[0], self.hidden_size), self.dtype,
                                               self.device)
        out = self.stage(inputs, positions, writer, images if self.stage.first else None)
        if self.recording:
            self._routes = recorded_routes(self.model, tokens.shape[0]).to(torch.int16)
        if not self.stage.last:
            self.links.send_hidden(out)
            return None
        full = self.links.gather_vocab(out)
        return None if full is None else full[:, :self.vocab_size]

    def _draw(self, logits: torch.Tensor | None, sampling: SamplingConfig,
              rows: DecodeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler draws, each row with its own generator; every rank of the replica gets the result."""
        tokens = log_probs = None
        if self.links.is_sampler:
            tokens, log_probs = sample(logits, sampling, rows.generators)
        return self.links.share_samples(tokens, log_probs, len(rows.generators), self.device)
