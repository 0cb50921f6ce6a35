"""What the device check runs at: real shapes on an accelerator, tiny ones for the CPU dry run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sizes:
    #: HF config overrides of the dense (Qwen2) and MoE (Qwen3-MoE) parity models; the vision-language model is
    #: tests/hf_models' tiny one on every device (its path is what is checked, not its size)
    dense: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)
    parity_rows: int = 2
    parity_seq: int = 32
    #: the actor whose update, forward, offload and decode are timed (an architecture of configs/model)
    actor_model: str = "tiny_qwen"
    #: each packed row: a prompt and `samples` responses to it (GRPO's n), packed behind one copy of the prompt
    prompt_tokens: int = 32
    response_tokens: int = 24
    samples: int = 4
    #: packed rows per update (one per micro-batch)
    rows: int = 2
    decode_batch: int = 8
    decode_prompt: int = 16
    decode_tokens: int = 8
    #: the MoE layer stack: an architecture of configs/model cut to `moe_layers` layers, on `moe_tokens` tokens
    moe_model: str = "tiny_qwen3_moe"
    moe_layers: int = 2
    moe_tokens: int = 256
    #: the side of the square matmul the achieved FLOP/s are compared with
    matmul: int = 512
    #: timed repeats after one warm-up (the best is reported)
    repeats: int = 2

    @property
    def packed_row_tokens(self) -> int:
        return self.prompt_tokens + self.samples * self.response_tokens


#: the CPU dry run: every check, at the tiny models' sizes
CPU = Sizes()

#: one H100 / H200: parity at mid sizes, throughput at Qwen2.5-1.5B and four Qwen3-30B-A3B layers, 4096-token rows
GPU = Sizes(
    dense=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096),
    moe=dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=32000,
             max_position_embeddings=4096),
    parity_rows=4, parity_seq=512,
    actor_model="qwen25_1p5b", prompt_tokens=512, response_tokens=448, samples=8, rows=4,
    decode_batch=64, decode_prompt=128, decode_tokens=128,
    moe_model="qwen3_30b_a3b", moe_layers=4, moe_tokens=4096,
    matmul=8192, repeats=3)


def sizes_for(device: str) -> Sizes:
    return CPU if device == "cpu" else GPU
