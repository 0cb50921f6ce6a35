"""Megatron's legacy per-rank checkpoint layout.

    SAVE/latest_checkpointed_iteration.txt         "release" or the iteration number
    SAVE/release/ | SAVE/iter_0000100/
        mp_rank_TT/model_optim_rng.pt              PP = 1
        mp_rank_TT_PPP/model_optim_rng.pt          PP > 1

Each rank file is a dict with `model` (that rank's stage state dict), `iteration`,
`checkpoint_version` and `args`: an argparse.Namespace with the Megatron argument names
of the architecture and layout (so Megatron-LM tools can read it) plus `mindrl_arch`,
the exact ModelArch, so a loader can tell a wrong TP/PP or architecture in one sentence.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from mindrl.checkpoint.atomic import atomic_file
from mindrl.config import ConfigError, ModelArch, ParallelConfig

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0

torch.serialization.add_safe_globals([argparse.Namespace])


def iteration_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def rank_file(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int, pp: int) -> Path:
    return Path(root) / iteration_dir_name(iteration) / rank_dir_name(tp_rank, pp_rank, pp) / RANK_FILE


def existing_rank_file(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int, pp: int) -> Path:
    """The path of one rank's file, or one sentence saying the checkpoint is incomplete."""
    path = rank_file(root, iteration, tp_rank, pp_rank, pp)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {root} lacks {path.relative_to(root)}; it is incomplete.")
    return path


def read_tracker(root: str | Path) -> int | str:
    """The iteration the tracker file names ("release" or an int)."""
    path = Path(root) / TRACKER
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no {TRACKER}; it is not a Megatron checkpoint directory "
                                f"(convert HF weights with cli/convert_ckpt.py first).")
    text = path.read_text().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path} holds {text!r}; expected 'release' or an iteration number.") from None


def write_tracker(root: str | Path, iteration: int | str) -> None:
    """Written last, so a reader never sees an iteration whose files are incomplete."""
    with atomic_file(Path(root) / TRACKER) as tmp:
        tmp.write_text(f"{iteration}\n")


def checkpoint_args(arch: ModelArch, par: ParallelConfig, params_dtype: torch.dtype,
                    **extra: Any) -> argparse.Namespace:
    """Megatron-named arguments describing the architecture and layout, plus mindrl's own."""
    return argparse.Namespace(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        group_query_attention=arch.query_groups != arch.num_attention_heads,
        num_query_groups=arch.query_groups,
        kv_channels=arch.head_dim,
        padded_vocab_size=arch.vocab_size_for(par.tp),
        max_position_embeddings=arch.max_position_embeddings,
        untie_embeddings_and_output_weights=arch.untie_embeddings_and_output_weights,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        normalization=arch.normalization,
        norm_epsilon=arch.norm_epsilon,
        swiglu=arch.swiglu,
        rotary_base=arch.rotary_base,
        position_embedding_type="rope",
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        num_layer_list=",".join(map(str, par.num_layer_list)) if par.num_layer_list else None,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        mindrl_arch=dataclasses.asdict(arch),
        **extra,
    )


def save_rank(root: str | Path, iteration: int | str, tp_rank: int, pp_rank: int,
              model: dict[str, torch.Tensor], args: argparse.Namespace, **extra: Any) -> Path:
    """One rank's file of one iteration (the caller writes the tracker when all ranks are done)."""
    path = rank_file(root, iteration, tp_rank, pp_rank, args.pipeline_model_parallel_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": {name: compact(t) for name, t in model.items()},
             "iteration": 0 if iteration == "release" else int(iteration),
             "checkpoint_version": CHECKPOINT_VERSION, "args": args, **extra}
    torch.save(state, path)
    return path


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with a storage of exactly its own bytes.

    torch.save writes a view's whole storage: a TP slice or a memory-mapped row range
    saved as is would carry the full tensor (or file) along with it.
    """
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def load_args(root: str | Path, iteration: int | str | None = None) -> argparse.Namespace:
    """The args stored with a checkpoint (read from its first rank file, tensors not loaded)."""
    iteration = read_tracker(root) if iteration is None else iteration
    folder = Path(root) / iteration_dir_name(iteration)
    first = sorted(folder.glob(f"mp_rank_00*/{RANK_FILE}"))
    if not first:
        raise FileNotFoundError(f"{folder} has no mp_rank_00*/{RANK_FILE}; the checkpoint is incomplete.")
    return torch.load(first[0], map_location="cpu", mmap=True, weights_only=True)["args"]


def arch_of(args: argparse.Namespace) -> ModelArch:
    return ModelArch(**args.mindrl_arch)


def parallel_of(args: argparse.Namespace) -> ParallelConfig:
    return ParallelConfig(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          num_layer_list=args.num_layer_list)


def load_rank(root: str | Path, tp_rank: int, pp_rank: int, expect_arch: ModelArch | None = None,
              expect_par: ParallelConfig | None = None, iteration: int | str | None = None,
              mmap: bool = True) -> dict[str, Any]:
    """One rank's state, after checking the checkpoint matches the model it is loaded into."""
    iteration = read_tracker(root) if iteration is None else iteration
    args = load_args(root, iteration)
    stored_arch, stored_par = arch_of(args), parallel_of(args)
    if expect_par is not None and (expect_par.tp, expect_par.pp, expect_par.num_layer_list) != (
            stored_par.tp, stored_par.pp, stored_par.num_layer_list):
        raise ConfigError(
            f"checkpoint {root} is sharded TP={stored_par.tp} PP={stored_par.pp}"
            f"{' layers ' + args.num_layer_list if args.num_layer_list else ''} but the model is "
            f"TP={expect_par.tp} PP={expect_par.pp}; re-shard it with cli/convert_ckpt.py "
            f"or match the layout.")
    if expect_arch is not None:
        diffs = [f.name for f in dataclasses.fields(ModelArch) if f.name != "name"
                 and getattr(expect_arch, f.name) != getattr(stored_arch, f.name)]
        if diffs:
            raise ConfigError(
                f"checkpoint {root} holds a different architecture than model {expect_arch.name}: "
                + ", ".join(f"{d}={getattr(stored_arch, d)!r} (model: {getattr(expect_arch, d)!r})"
                            for d in diffs[:4])
                + "; point load at the right checkpoint or fix the model yaml.")
    path = existing_rank_file(root, iteration, tp_rank, pp_rank, stored_par.pp)
    return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
