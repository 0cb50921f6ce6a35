"""Where the shipped configuration files live.

A non-editable install carries them inside the package (`mindrl/_configs`, see setup.py);
a checkout or an editable install reads the repository's configs/ directly.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
_INSTALLED = _PACKAGE / "_configs"
CONFIGS_DIR = _INSTALLED if _INSTALLED.is_dir() else _PACKAGE.parent / "configs"
MODEL_CONFIGS_DIR = CONFIGS_DIR / "model"
