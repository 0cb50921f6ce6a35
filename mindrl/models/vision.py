"""Qwen2.5-VL's vision tower and multimodal positions, in plain torch.

The tower is small beside the language model (0.67 B parameters at 3B and 7B), so the first pipeline stage
holds all of it on every tensor-parallel rank, as it holds norms: the ranks compute the same features from the
same pixels, and the language model's embedding stage scatters them over the image placeholders. Its
parameter names are HF's, under `vision_model.` where HF has `visual.`, so the converter renames and copies.

Images arrive as the processor makes them: each image a grid of t × h × w patches (`image_grid_thw`), the
patches flattened to channels × frames × rows × columns and ordered so that every spatial_merge_size²
patches the merger folds into one token are adjacent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mindrl.config import ConfigError
from mindrl.config.vision import VisionArch

_EPS = 1e-6  # Qwen2.5-VL's vision norms


def vision_param_shapes(vision: VisionArch, out_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every parameter of the tower (HF's names inside `visual.`) with its shape, in HF's order."""
    h, ffn, p = vision.hidden_size, vision.intermediate_size, vision.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (h, vision.in_channels, vision.temporal_patch_size, p, p)}
    block = {"norm1.weight": (h,), "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,),
             "attn.proj.weight": (h, h), "attn.proj.bias": (h,), "norm2.weight": (h,),
             "mlp.gate_proj.weight": (ffn, h), "mlp.gate_proj.bias": (ffn,), "mlp.up_proj.weight": (ffn, h),
             "mlp.up_proj.bias": (ffn,), "mlp.down_proj.weight": (h, ffn), "mlp.down_proj.bias": (h,)}
    for i in range(vision.depth):
        shapes.update({f"blocks.{i}.{name}": shape for name, shape in block.items()})
    merged = h * vision.merge_unit
    shapes.update({"merger.ln_q.weight": (h,), "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
                   "merger.mlp.2.weight": (out_hidden, merged), "merger.mlp.2.bias": (out_hidden,)})
    return shapes


class VisionRMSNorm(nn.Module):
    """HF's Qwen2.5-VL norm: normalised in fp32, cast back, then scaled."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=_EPS).to(x.dtype)


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride over inputs of exactly one kernel: one matmul per patch. The weight
    keeps the convolution's shape, so it is HF's tensor as stored."""

    def __init__(self, vision: VisionArch) -> None:
        super().__init__()
        p = vision.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(vision.hidden_size, vision.in_channels,
                                                    vision.temporal_patch_size, p, p))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionArch) -> None:
        super().__init__()
        self.heads = vision.num_heads
        self.qkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size)
        self.proj = nn.Linear(vision.hidden_size, vision.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Bidirectional attention inside each run of `lengths` consecutive patches (a window or an image)."""
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, self.heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in run))
               for run in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(x.shape[0], -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in fp32 over the whole head (rotate-half layout), cast back."""
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, vision: VisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vision.hidden_size, vision.intermediate_size)
        self.up_proj = nn.Linear(vision.hidden_size, vision.intermediate_size)
        self.down_proj = nn.Linear(vision.intermediate_size, vision.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionArch) -> None:
        super().__init__()
        self.norm1, self.norm2 = VisionRMSNorm(vision.hidden_size), VisionRMSNorm(vision.hidden_size)
        self.attn, self.mlp = VisionAttention(vision), VisionMLP(vision)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vision: VisionArch, out_hidden: int) -> None:
        super().__init__()
        merged = vision.hidden_size * vision.merge_unit
        self.ln_q = VisionRMSNorm(vision.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, out_hidden))

    def forward(self, x: torch.Tensor, merge_unit: int) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, x.shape[-1] * merge_unit))


class VisionEncoder(nn.Module):
    """Patches of every image of a batch → one feature per language-model image token, in the images' order."""

    def __init__(self, vision: VisionArch, out_hidden: int) -> None:
        super().__init__()
        self.arch = vision
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision, out_hidden)
        quarter = vision.head_dim // 2
        self.register_buffer("inv_freq", 1.0 / vision.rotary_base ** (
            torch.arange(0, quarter, 2, dtype=torch.float) / quarter), persistent=False)

    @torch.no_grad()
    def initialize(self, seed: int) -> None:
        """Fresh weights for training from scratch: N(0, 1 / fan-in) matrices, zero biases, unit norms, drawn from
        a generator of its own, so every rank holding the tower (each TP and DP rank of the first stage) starts from
        the same weights whatever its global random state.

        Not the language model's N(0, 0.02): with it the tiny tower's merged tokens were nearly one vector (mean
        cosine 0.82 between tokens of different images), and neither this model nor HF's learned even the colour
        of the shapes (loss stuck at ln 3 for 180 full-batch steps); at 1 / fan-in HF's fits it in 90."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param[0].numel() ** -0.5)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(n) for n in g) for g in grid_thw.tolist()]
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape != (expected, self.arch.patch_values):
            raise ConfigError(f"the images' patches have shape {list(patches.shape)} but their grids "
                              f"{grids} need [{expected}, {self.arch.patch_values}]; preprocess the images with this "
                              f"model's patch_size and temporal_patch_size.")
        order, window_lengths = window_order(grids, self.arch)
        image_lengths = [h * w for t, h, w in grids for _ in range(t)]
        unit = self.arch.merge_unit
        angles = _by_merge_unit(patch_positions(grids, self.arch).to(self.inv_freq.device).float(), order, unit)
        freqs = (angles[..., None] * self.inv_freq).flatten(1)  # [patches, head_dim / 2]: rows' angles, then columns'
        cos, sin = (torch.cat((f, f), dim=-1).unsqueeze(1) for f in (freqs.cos(), freqs.sin()))
        x = _by_merge_unit(self.patch_embed(patches), order, unit)
        full = set(self.arch.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_lengths if i in full else window_lengths)
        return self.merger(x, unit)[torch.argsort(order)]


def _by_merge_unit(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Reorder patches in whole merge units (`order` numbers the units)."""
    return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)


def patch_positions(grids: list[tuple[int, int, int]], vision: VisionArch) -> torch.Tensor:
    """[patches, 2]: each patch's row and column in its image, in the processor's patch order (merge units
    row-major, the patches inside a unit row-major), repeated for every frame."""
    m = vision.spatial_merge_size
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        unit_major = [a.transpose(1, 2).reshape(-1) for a in (rows, cols)]
        out.append(torch.stack(unit_major, dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[tuple[int, int, int]], vision: VisionArch) -> tuple[torch.Tensor, list[int]]:
    """The merge units reordered window by window (each frame cut into square windows of window_size pixels,
    the last ones in a row or column cut short), and the number of patches in each window."""
    side = vision.window_size // vision.spatial_merge_size // vision.patch_size  # merge units across a window
    order, lengths, offset = [], [], 0
    for t, h, w in grids:
        uh, uw = h // vision.spatial_merge_size, w // vision.spatial_merge_size
        units = torch.arange(t * uh * uw).view(t, uh, uw) + offset
        for frame in units:
            for top in range(0, uh, side):
                for left in range(0, uw, side):
                    window = frame[top:top + side, left:left + side].reshape(-1)
                    order.append(window)
                    lengths.append(window.numel() * vision.merge_unit)
        offset += t * uh * uw
    return torch.cat(order), lengths


def mrope_positions(tokens: torch.Tensor, grid_thw: torch.Tensor | None, vision: VisionArch,
                    image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[3, b, s] temporal / height / width positions of a token batch for multimodal RoPE.

    Text tokens count up by one on all three axes. Each run of image placeholders (`image_mask`; default: every
    image-pad token) is the next image of `grid_thw` (the batch's images in row order): its tokens sit on the merged
    grid, every axis starting where the text stopped, and the text after it resumes past the grid's larger side."""
    grids = [] if grid_thw is None else [tuple(int(n) for n in g) for g in grid_thw.tolist()]
    out = torch.empty(3, *tokens.shape, dtype=torch.long)
    m = vision.spatial_merge_size
    mask = (tokens == vision.image_token_id) if image_mask is None else image_mask
    next_image = 0
    for row, ids in enumerate(mask.tolist()):
        pos, i, pieces = 0, 0, []
        while i < len(ids):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            if not ids[i]:
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
            else:
                if next_image >= len(grids):
                    raise ConfigError(f"row {row} has more image placeholder runs than the batch has images "
                                      f"({len(grids)}); give one image per run of placeholders.")
                t, h, w = grids[next_image]
                th, tw = h // m, w // m
                if j - i != t * th * tw:
                    raise ConfigError(f"row {row}: image {next_image} has {j - i} placeholder tokens but its grid "
                                      f"{[t, h, w]} makes {t * th * tw}; expand each image's placeholder to its grid.")
                grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(th), torch.arange(tw), indexing="ij"))
                pieces.append(grid.reshape(3, -1) + pos)
                pos += max(th, tw)
                next_image += 1
            i = j
        out[:, row] = torch.cat(pieces, dim=1)
    if next_image != len(grids):
        raise ConfigError(f"the batch has {len(grids)} images but {next_image} runs of image placeholders; "
                          f"every image needs its placeholders in the prompt.")
    return out.to(tokens.device)


def rows_of_images(rows: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (patches [P_r, D], grids [I_r, 3]) as `pixel_values` [B, max P_r, D] and `image_grid_thw`
    [B, max I_r, 3], zero-padded: a batch split by rows (micro-batches, data-parallel shares) then carries its
    rows' images with it. A row without images (None) has no patches and no grids."""
    present = [r for r in rows if r is not None]
    width = max((p.shape[-1] for p, _ in present), default=0)
    patches = torch.zeros(len(rows), max((p.shape[0] for p, _ in present), default=0), width)
    grids = torch.zeros(len(rows), max((g.shape[0] for _, g in present), default=0), 3, dtype=torch.long)
    for row, images in enumerate(rows):
        if images is not None:
            patches[row, :images[0].shape[0]] = images[0]
            grids[row, :images[1].shape[0]] = images[1]
    return patches, grids


def flat_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of rows_of_images for the rows given: every image's patches in row order and their grids, as
    the vision tower takes them (padding patches and the zero grids of absent images dropped)."""
    patches, grids = [], []
    for row_patches, row_grids in zip(pixel_values, image_grid_thw, strict=True):
        real = row_grids[row_grids.prod(-1) > 0]
        patches.append(row_patches[:int(real.prod(-1).sum())])
        grids.append(real)
    return torch.cat(patches), torch.cat(grids)
