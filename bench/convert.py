"""Benchmark the converter on a random Qwen2.5-0.5B-shaped checkpoint (or another architecture's) against a
plain copy.

    python bench/convert.py [--tp 1] [--pp 1] [--reshard-tp 2] [--reshard-pp 2] [--input-shard-size 500MB]
                            [--model qwen25_0p5b] [--layers N] [--ep 1] [--reshard-ep 1] [--workdir DIR]

`--model qwen3_30b_a3b --layers 2 --ep 2 --reshard-ep 1` times a mixture of experts in expert-parallel folders
(two layers of 128 experts: 2.4 GB in bf16, beside the vocabulary's 1.2 GB).

Builds the checkpoint locally (bf16 safetensors, sharded), then runs, each in a fresh
process so that its peak RSS (VmHWM) is its own: (1) a plain copy — safetensors load of every
shard + one torch.save of the same tensors; (2) the conversion hf -> mg (--tp, --pp); (3) mg -> hf;
(4) mg -> mg to --reshard-tp / --reshard-pp; (5) hf -> mg from (3)'s output to that layout, so
that (3) + (5) is the re-shard through HF that (4) replaces.
Prints one JSON line: throughput, seconds, peak RSS, the ratio to the plain copy, the memory
budget the converter aims for: 1.5 × (largest output shard + largest input shard) in every
direction, the re-shard against the trip through HF, and whether the two re-sharded checkpoints
are bit-identical.
Each step runs --repeats times, interleaved; the fastest run counts, and the highest peak.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = (("copy", "hf", "copy"), ("hf2mcore", "hf", "mg"), ("mcore2hf", "mg", "back"),
         ("mcore2mcore", "mg", "resharded"), ("hf2mcore_target", "back", "resharded_via_hf"))
sys.path.insert(0, str(ROOT))


def architecture(model: str, layers: int | None):
    import dataclasses

    from mindrl.config import load_model_arch

    arch = load_model_arch(model)
    return dataclasses.replace(arch, num_layers=layers) if layers else arch


def build_checkpoint(folder: Path, shard_size: str, model: str, layers: int | None) -> dict:
    import torch

    from mindrl.ckpt_convert.safetensors_io import ShardedSafetensorsWriter, parse_size
    from mindrl.models.hf_mapping import hf_config_from_arch, hf_param_shapes, model_type_hf_of

    arch = architecture(model, layers)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    writer = ShardedSafetensorsWriter(folder, parse_size(shard_size))
    for name, shape in hf_param_shapes(arch).items():
        writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    shards = writer.close()
    config = hf_config_from_arch(arch, model_type_hf_of(arch), torch.bfloat16)
    (folder / "config.json").write_text(json.dumps(config))
    return {"bytes": writer.total_bytes, "largest_input_shard": max(p.stat().st_size for p in shards),
            "input_shards": len(shards)}


def step(kind: str, src: str, dst: str, tp: int, pp: int, ep: int, family: str) -> None:
    """Runs inside a child process; prints its seconds (imports excluded) and peak RSS."""
    import torch
    from safetensors.torch import load_file

    from mindrl.ckpt_convert import hf_to_mcore, mcore_to_hf, mcore_to_mcore

    start = time.perf_counter()
    if kind == "copy":
        tensors = {}
        for shard in sorted(Path(src).glob("*.safetensors")):
            tensors.update(load_file(shard))
        torch.save(tensors, Path(dst) / "copy.pt")
    elif kind in ("hf2mcore", "hf2mcore_target"):
        hf_to_mcore(src, dst, family, tp, pp, params_dtype=torch.bfloat16, progress=False, ep=ep)
    elif kind == "mcore2mcore":
        mcore_to_mcore(src, dst, tp, pp, progress=False, ep=ep)
    else:
        mcore_to_hf(src, dst, progress=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss()}))


def same_rank_files(a: Path, b: Path) -> bool:
    """Whether two Megatron checkpoints hold the same tensors under the same names, bit for bit."""
    import torch

    from mindrl.checkpoint.megatron import read_rank

    files = sorted(p.relative_to(a) for p in a.rglob("model_optim_rng.pt"))
    if files != sorted(p.relative_to(b) for p in b.rglob("model_optim_rng.pt")):
        return False
    for rel in files:
        x, y = read_rank(a / rel)["model"], read_rank(b / rel)["model"]
        if x.keys() != y.keys() or not all(torch.equal(x[n], y[n]) for n in x):
            return False
    return True


def peak_rss() -> int:
    """This process's resident-set high-water mark in bytes.

    VmHWM, not getrusage: Linux carries ru_maxrss over from the forking parent across exec.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_step(kind: str, src: Path, dst: Path, tp: int, pp: int, ep: int, family: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--step", kind, "--src", str(src), "--dst", str(dst),
                          "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--family", family],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(folder: Path) -> None:
    """Read every file once so each measured step starts with the same (warm) page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--reshard-tp", type=int, default=2, help="TP of the mg -> mg target")
    parser.add_argument("--reshard-pp", type=int, default=2, help="PP of the mg -> mg target")
    parser.add_argument("--ep", type=int, default=1, help="EP of the hf -> mg output (a mixture of experts)")
    parser.add_argument("--reshard-ep", type=int, default=1, help="EP of the mg -> mg target")
    parser.add_argument("--model", default="qwen25_0p5b", help="the architecture (configs/model/) to shape it as")
    parser.add_argument("--layers", type=int, default=None, help="keep this many of its layers")
    parser.add_argument("--input-shard-size", default="500MB")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each step; the fastest counts")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--step", choices=["build", *(kind for kind, _, _ in STEPS)], help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--dst", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step == "build":
        print(json.dumps(build_checkpoint(Path(args.dst), args.input_shard_size, args.model, args.layers)))
        return
    if args.step:
        step(args.step, args.src, args.dst, args.tp, args.pp, args.ep, args.family)
        return
    from mindrl.models.hf_mapping import model_type_hf_of

    family = model_type_hf_of(architecture(args.model, args.layers))

    work = Path(tempfile.mkdtemp(prefix="mindrl-bench-convert-", dir=args.workdir))
    try:
        built = subprocess.run([sys.executable, __file__, "--step", "build", "--dst", str(work / "hf"),
                                "--input-shard-size", args.input_shard_size, "--model", args.model,
                                *(["--layers", str(args.layers)] if args.layers else [])],
                               capture_output=True, text=True, check=True)
        info = json.loads(built.stdout.strip().splitlines()[-1])
        runs: dict[str, list[dict]] = {kind: [] for kind, _, _ in STEPS}
        for _ in range(args.repeats):  # interleaved, so machine noise hits every step alike
            for kind, src, dst in STEPS:
                shutil.rmtree(work / dst, ignore_errors=True)
                if kind == "copy":
                    (work / dst).mkdir()
                warm(work / src)
                tp, pp, ep = ((args.tp, args.pp, args.ep) if kind == "hf2mcore"
                              else (args.reshard_tp, args.reshard_pp, args.reshard_ep))
                runs[kind].append(run_step(kind, work / src, work / dst, tp, pp, ep, family))
        largest_output = max(p.stat().st_size for p in (work / "mg").rglob("model_optim_rng.pt"))
        largest_hf_output = max(p.stat().st_size for p in (work / "back").glob("*.safetensors"))
        largest_resharded = max(p.stat().st_size for p in (work / "resharded").rglob("model_optim_rng.pt"))
        bit_exact = same_rank_files(work / "resharded", work / "resharded_via_hf")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    copy, to_mg, to_hf, reshard, to_mg_target = (
        best(runs[k]) for k in ("copy", "hf2mcore", "mcore2hf", "mcore2mcore", "hf2mcore_target"))
    gb = info["bytes"] / 1e9
    budget = 1.5 * (largest_output + info["largest_input_shard"])
    back_budget = 1.5 * (largest_hf_output + largest_output)
    reshard_budget = 1.5 * (largest_resharded + largest_output)
    print(json.dumps({
        "bench": "convert", "model": f"{args.model}-shaped{f' ({args.layers} layers)' if args.layers else ''} "
                                     f"(random, bf16)", "tp": args.tp, "pp": args.pp, "ep": args.ep,
        "gigabytes": round(gb, 3), "input_shards": info["input_shards"],
        "hf2mcore_s": round(to_mg["seconds"], 2), "hf2mcore_gb_per_s": round(gb / to_mg["seconds"], 3),
        "mcore2hf_s": round(to_hf["seconds"], 2), "plain_copy_s": round(copy["seconds"], 2),
        "hf2mcore_vs_copy": round(to_mg["seconds"] / copy["seconds"], 2),
        "hf2mcore_peak_rss_gb": round(to_mg["peak_rss"] / 1e9, 3),
        "mcore2hf_peak_rss_gb": round(to_hf["peak_rss"] / 1e9, 3),
        "plain_copy_peak_rss_gb": round(copy["peak_rss"] / 1e9, 3),
        "rss_budget_gb": round(budget / 1e9, 3),
        "hf2mcore_rss_vs_budget": round(to_mg["peak_rss"] / budget, 2),
        "mcore2hf_rss_vs_budget": round(to_hf["peak_rss"] / back_budget, 2),
        "reshard": f"tp{args.tp}pp{args.pp}ep{args.ep} -> tp{args.reshard_tp}pp{args.reshard_pp}ep{args.reshard_ep}",
        "mcore2mcore_s": round(reshard["seconds"], 2),
        "reshard_via_hf_s": round(to_hf["seconds"] + to_mg_target["seconds"], 2),
        "mcore2mcore_vs_via_hf": round(reshard["seconds"] / (to_hf["seconds"] + to_mg_target["seconds"]), 2),
        "mcore2mcore_peak_rss_gb": round(reshard["peak_rss"] / 1e9, 3),
        "mcore2mcore_rss_vs_budget": round(reshard["peak_rss"] / reshard_budget, 2),
        "reshard_via_hf_peak_rss_gb": round(max(to_hf["peak_rss"], to_mg_target["peak_rss"]) / 1e9, 3),
        "reshard_bit_exact": bit_exact,
        "repeats": args.repeats,
    }))


def best(runs: list[dict]) -> dict:
    """Fastest time and highest peak of repeated runs (noise only ever adds time)."""
    return {"seconds": min(r["seconds"] for r in runs), "peak_rss": max(r["peak_rss"] for r in runs)}


if __name__ == "__main__":
    main()
