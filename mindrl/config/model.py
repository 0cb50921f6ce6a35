"""Model architecture section, in the key names of MindSpeed-RL's model yamls.

A model yaml (configs/model/<name>.yaml) holds one top-level key equal to its file
stem, so a MindSpeed-RL user's file loads unchanged. Keys that would silently do
nothing here are rejected rather than ignored: a user who sets `num_experts` must
learn that MoE is not built, not discover it in the loss curve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mindrl.config.errors import ConfigError
from mindrl.config.paths import MODEL_CONFIGS_DIR
from mindrl.config.values import check_types

# Keys MindSpeed-RL model yamls carry that only choose kernels or legacy code paths. They
# change no numbers, so they are accepted and have no effect.
_NO_EFFECT_KEYS = frozenset({
    "use_mcore_models",
    "group_query_attention",
    "no_gradient_accumulation_fusion",
    "use_rotary_position_embeddings",
})

_UNSUPPORTED_PREFIXES = {
    "moe_": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
    "multi_latent_attention": "multi-latent attention",
    "q_lora_rank": "multi-latent attention",
    "kv_lora_rank": "multi-latent attention",
    "rope_scaling": "RoPE scaling",
    "spec": "custom layer specs",
}


@dataclass(frozen=True)
class ModelArch:
    """A dense decoder-only transformer (Qwen2/2.5, Qwen3 dense, Llama-2/3 shapes)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    max_position_embeddings: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    make_vocab_size_divisible_by: int = 1
    untie_embeddings_and_output_weights: bool = False
    add_qkv_bias: bool = False
    disable_bias_linear: bool = True
    attention_bias: bool = False
    qk_layernorm: bool = False
    normalization: str = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: str = "rope"
    rotary_base: float = 10000.0
    attention_softmax_in_fp32: bool = True
    #: outputs of a sequence-classification head in place of the LM head (a reward model has 1); null: a causal LM
    num_labels: int | None = None

    def __post_init__(self) -> None:
        check_types(f"model {self.name}", self)
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "padded_vocab_size", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model {self.name}: {key} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.query_groups:
            raise ConfigError(
                f"model {self.name}: num_query_groups={self.query_groups} must divide "
                f"num_attention_heads={self.num_attention_heads}.")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model {self.name}: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; set kv_channels to the head size.")
        if self.num_labels is not None and (not isinstance(self.num_labels, int) or self.num_labels < 1):
            raise ConfigError(f"model {self.name}: num_labels must be a positive integer (1 for a reward model) or "
                              f"null for a causal LM, got {self.num_labels!r}.")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ConfigError(f"model {self.name}: normalization must be RMSNorm or LayerNorm, "
                              f"got {self.normalization!r}.")
        if self.position_embedding_type != "rope":
            raise ConfigError(f"model {self.name}: only position_embedding_type: rope is supported, "
                              f"got {self.position_embedding_type!r}.")

    @property
    def query_groups(self) -> int:
        """Key-value heads; without GQA every query head has its own."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def has_score_head(self) -> bool:
        """A sequence classifier (reward model): `rm_head` scores hidden states; there is no LM head."""
        return self.num_labels is not None

    @property
    def tied_embeddings(self) -> bool:
        """The LM head is the embedding (no output layer of its own)."""
        return not self.untie_embeddings_and_output_weights and not self.has_score_head

    @property
    def has_output_layer(self) -> bool:
        """An LM head with weights of its own."""
        return self.untie_embeddings_and_output_weights and not self.has_score_head

    def vocab_size_for(self, tensor_parallel_size: int) -> int:
        """Rows of the embedding table: padded so every TP rank holds an equal slice."""
        return self.padded_rows(self.padded_vocab_size, self.make_vocab_size_divisible_by, tensor_parallel_size)

    @staticmethod
    def padded_rows(vocab: int, divisible_by: int, tensor_parallel_size: int) -> int:
        """Megatron's padding: up to a multiple of make_vocab_size_divisible_by × TP."""
        multiple = divisible_by * tensor_parallel_size
        return -(-vocab // multiple) * multiple

    @classmethod
    def from_dict(cls, name: str, values: Mapping[str, Any]) -> ModelArch:
        """Build from a model-yaml mapping; unknown or unsupported keys are errors."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key in fields:
                kwargs[key] = value
            elif key in _NO_EFFECT_KEYS:
                continue
            else:
                feature = next((what for prefix, what in _UNSUPPORTED_PREFIXES.items()
                                if key.startswith(prefix)), None)
                if feature:
                    raise ConfigError(f"model {name}: key {key!r} asks for {feature}, which mindrl "
                                      f"does not build yet; remove it or pick a dense architecture.")
                raise ConfigError(f"model {name}: unknown key {key!r}; known keys are "
                                  f"{', '.join(sorted(fields | _NO_EFFECT_KEYS))}.")
        if values.get("use_mcore_models") is False:
            raise ConfigError(f"model {name}: use_mcore_models: false is not supported; mindrl always "
                              f"builds megatron-core models, so set it to true or remove it.")
        if values.get("group_query_attention") is False and "num_query_groups" in values:
            kwargs.pop("num_query_groups")
        if kwargs.get("attention_bias") and kwargs.get("disable_bias_linear", True):
            raise ConfigError(f"model {name}: attention_bias: true contradicts disable_bias_linear: "
                              f"true; use add_qkv_bias for a QKV-only bias.")
        if isinstance(kwargs.get("norm_epsilon"), str):  # YAML 1.1 reads `1e-6` as a string
            try:
                kwargs["norm_epsilon"] = float(kwargs["norm_epsilon"])
            except ValueError:
                raise ConfigError(f"model {name}: norm_epsilon must be a number, got "
                                  f"{kwargs['norm_epsilon']!r}.") from None
        try:
            return cls(name=name, **kwargs)
        except TypeError as err:
            raise ConfigError(f"model {name}: {err}; add the missing keys to its model yaml.") from None


def load_model_arch(name: str, config_dir: str | Path | None = None) -> ModelArch:
    """Read configs/model/<name>.yaml (OmegaConf, so `1e-6` is a float as in Hydra)."""
    path = Path(config_dir or MODEL_CONFIGS_DIR) / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"no model architecture named {name!r} in {path.parent}; "
                          f"known: {', '.join(known)}.")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(data, dict) or name not in data:
        raise ConfigError(f"{path} must hold one top-level key {name!r} with the architecture under it.")
    return ModelArch.from_dict(name, data[name])
