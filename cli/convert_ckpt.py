"""Convert checkpoints between HF safetensors and TP/PP-sharded Megatron (see --help)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.ckpt_convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
