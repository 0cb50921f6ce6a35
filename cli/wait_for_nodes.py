"""Wait until a running Ray cluster has NNODES alive nodes (the multi-node scripts' master runs it).

    python cli/wait_for_nodes.py --address 10.0.0.1:6344 --nodes 2 --timeout 600

Prints the nodes' addresses and exits 0 once they are all in; after the time limit, one sentence
naming how many joined and exit status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mindrl.config.errors import ConfigError
from mindrl.trainer.cluster import wait_for_nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the head node's ADDRESS:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes must be alive, the head included")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    args = parser.parse_args(argv)
    try:
        alive = wait_for_nodes(args.address, args.nodes, args.timeout)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[mindrl] {len(alive)} nodes joined: {', '.join(alive)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
