"""Methods mindrl adds to vLLM's worker (`worker_extension_cls`) to load weights in place.

One weight update is a session: `begin_weight_update` puts every layer in vLLM's layerwise
reload mode, `load_weight_bucket` hands it tensors (any grouping: a layer is processed once
all of its tensors, e.g. q, k and v of a fused qkv_proj, have arrived), and
`end_weight_update` finishes the layers and re-processes a tied lm_head, which shares the
embedding's weight but keeps a kernel copy of its own (prepacked on CPU) that would
otherwise stay stale, and re-runs the experts' kernel set-up of each mixture-of-experts layer:
vLLM runs it only at the first load (on CPU it prepacks the experts into its grouped-GEMM
layout), so after a reload the kernel read unpacked weights as packed ones (probe log-probs
off by 2 on the tiny Qwen3-MoE). `abort_weight_update` ends a session that failed part way, so that the
next one starts from clean layer state; its layers hold a mix of old and new weights until a
complete update replaces every tensor. The engine runs in the caller's process, so tensors
arrive by reference, not copied.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

# vLLM warns for layers no checkpoint tensor fills: the rotary embedding (computed; a vision-language model's is
# multimodal) and a tied lm_head (filled through the embedding, re-processed below). Only those notices.
_EXPECTED = ("RotaryEmbedding: Failed to load weights", "MRotaryEmbedding: Failed to load weights",
             "ParallelLMHead: Failed to load weights")


class _ExpectedNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in _EXPECTED


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNotices())


class WeightLoader:
    """Mixed into vLLM's worker; `self.model_runner` is the worker's."""

    def begin_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def load_weight_bucket(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-named full tensors (vLLM cuts its own TP shards from them)."""
        self.model_runner.get_model().load_weights(iter(weights))

    def abort_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)

    def end_weight_update(self, tied_embeddings: bool) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.model_runner.model_config)
        if tied_embeddings:  # a vision-language model keeps its head in its language model
            head = (model.get_language_model() if hasattr(model, "get_language_model") else model).lm_head
            head.quant_method.process_weights_after_loading(head)
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)
