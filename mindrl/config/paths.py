"""Where the shipped configuration files live."""

from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
MODEL_CONFIGS_DIR = CONFIGS_DIR / "model"
