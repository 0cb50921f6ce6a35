"""One traced call on this process's device kind: torch.profiler on CPU and CUDA, torch_npu's profiler on Ascend.

The two profilers take different switches and write different things: torch.profiler records host operators
(and CUDA kernels) and exports one Chrome trace; torch_npu's collects raw Ascend data into a folder, which its
own analysis turns into a timeline (text) or a database (db) at the level asked. Kept here because it names
device kinds: a CPU or GPU process never imports torch_npu.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TraceOptions:
    """What a trace records (MindSpeed-RL's profile_with_* keys), and how torch_npu's profiler collects and exports
    it (`level`, `export_type`, `mstx`, `analyse`: Ascend's own, read on NPU only)."""

    host: bool = True
    #: the accelerator's kernels: CUDA's on a GPU, the NPU's on Ascend (a CPU run has none)
    device: bool = True
    record_shapes: bool = False
    memory: bool = False
    #: Python call stacks of the operators
    stack: bool = False
    level: str = "level0"
    export_type: str = "text"
    mstx: bool = False
    analyse: bool = False


@contextlib.contextmanager
def trace(platform: str, options: TraceOptions, stem: Path) -> Iterator[Path]:
    """Trace the body on `platform` (cpu, cuda or npu); yields where the trace lands once the body is done:
    `<stem>.json`, a Chrome trace (chrome://tracing, Perfetto), or on NPU the folder `<stem>/` that torch_npu's
    handler fills (its analysis, or torch_npu.profiler.profiler.analyse later, adds the timeline)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    if platform == "npu":
        with _npu_profiler(options, stem):
            yield stem
        return
    activities = [torch.profiler.ProfilerActivity.CPU] if options.host else []
    if options.device and platform == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    path = stem.with_suffix(".json")
    profiler = torch.profiler.profile(activities=activities, record_shapes=options.record_shapes,
                                      profile_memory=options.memory, with_stack=options.stack)
    with profiler:
        yield path
    profiler.export_chrome_trace(str(path))


def _npu_profiler(options: TraceOptions, folder: Path) -> contextlib.AbstractContextManager:
    """torch_npu's profiler as MindSpeed-RL configures it (get_grpo_profiler): its level, export type and mstx
    markers in the experimental config, and its trace handler writing `folder` on exit."""
    import torch_npu

    npu = torch_npu.profiler
    levels = {"level_none": npu.ProfilerLevel.Level_none, "level0": npu.ProfilerLevel.Level0,
              "level1": npu.ProfilerLevel.Level1, "level2": npu.ProfilerLevel.Level2}
    exports = {"text": npu.ExportType.Text, "db": npu.ExportType.Db}
    experimental = npu._ExperimentalConfig(profiler_level=levels[options.level],
                                           export_type=exports[options.export_type], msprof_tx=options.mstx,
                                           aic_metrics=npu.AiCMetrics.PipeUtilization, data_simplification=True)
    activities = ([npu.ProfilerActivity.CPU] if options.host else []) + \
        ([npu.ProfilerActivity.NPU] if options.device else [])
    return npu.profile(activities=activities, record_shapes=options.record_shapes, profile_memory=options.memory,
                       with_modules=options.stack, experimental_config=experimental,
                       on_trace_ready=npu.tensorboard_trace_handler(str(folder), analyse_flag=options.analyse))
