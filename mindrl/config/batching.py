"""How a pass cuts its rows into micro-batches (mindrl/models/micro_batches.py does the cutting): a plain value,
importable before any worker or device exists, so the trainers' configs can check and carry it."""

from __future__ import annotations

from dataclasses import dataclass

from mindrl.config.errors import ConfigError


@dataclass(frozen=True)
class Batching:
    """How one pass cuts its rows: padding-free packing, and a token budget per micro-batch."""

    #: each micro-batch's rows as one padding-free sequence (use_remove_padding)
    remove_padding: bool = False
    #: at most this many packed tokens per micro-batch (use_dynamic_bsz); None: micro_batch_size rows each
    max_tokens: int | None = None
    #: at most this many rows in a budgeted micro-batch (MindSpeed-RL's *_dynamic_max_batch_size); None: no cap
    max_rows: int | None = None
    #: each data-parallel rank gets rows of about the same cost instead of a contiguous share (use_dp_batch_balance)
    balance: bool = False

    def __post_init__(self) -> None:
        for key in ("max_tokens", "max_rows"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{key} must be a positive integer, got {value!r}.")
        # the sentences start with the key, so a config section can put its name in front
        if self.max_tokens is not None and not self.remove_padding:
            raise ConfigError("use_dynamic_bsz cuts padding-free micro-batches by a token budget, but "
                              "use_remove_padding is false; set use_remove_padding: true as well.")
        if self.balance and not self.remove_padding:
            raise ConfigError("use_dp_batch_balance gives the data-parallel ranks shares of equal cost, but padded "
                              "rows all cost the batch's width; set use_remove_padding: true as well.")
        if self.max_rows is not None and self.max_tokens is None:
            raise ConfigError("dynamic_max_batch_size caps the rows of token-budget micro-batches; set "
                              "use_dynamic_bsz: true or remove it.")
