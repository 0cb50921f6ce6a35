"""Typed configuration sections and their validation."""

from mindrl.config.errors import ConfigError
from mindrl.config.model import ModelArch, load_model_arch
from mindrl.config.parallel import ParallelConfig, validate_parallel

__all__ = ["ConfigError", "ModelArch", "ParallelConfig", "load_model_arch", "validate_parallel"]
