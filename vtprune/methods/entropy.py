"""Grey-level patch entropy (VFlowOpt, arXiv:2508.05211, Sec. 3.2): pure tensor functions.

``H_i = -sum_g p_g log2 p_g`` over the 256-bin histogram of the grey value (mean of R, G, B, rounded) of the
pixels of patch ``i``. VFlowOpt's code histograms the *normalised* pixel values times 255 cast to uint8
(negative values wrap); we follow the paper and histogram de-normalised 0-255 RGB.
"""

from __future__ import annotations

import torch

LEVELS = 256


def denormalize(pixel_values: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """``[..., 3, H, W]`` processor output back to 0-255 RGB (``x * std + mean``, times 255), fp32."""
    shape = (3, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=pixel_values.device).view(shape)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=pixel_values.device).view(shape)
    return ((pixel_values.float() * std_t + mean_t) * 255.0).clamp(0.0, 255.0)


def grey_levels(rgb: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` 0-255 RGB to ``[B, H, W]`` long grey levels (channel mean, rounded)."""
    return rgb.float().mean(dim=1).round().clamp(0, LEVELS - 1).long()


def patch_entropy(rgb: torch.Tensor, patch: int) -> torch.Tensor:
    """Entropy in bits ``[B, (H/p) * (W/p)]`` (row-major patches) of the grey histogram of each ``p x p`` patch.

    rgb: ``[B, 3, H, W]`` in 0-255; ``H`` and ``W`` must be multiples of ``patch``.
    """
    batch, _, height, width = rgb.shape
    if height % patch or width % patch:
        raise ValueError(f"image size {height}x{width} is not a multiple of the patch size {patch}.")
    grey = grey_levels(rgb)
    rows, cols = height // patch, width // patch
    blocks = grey.view(batch, rows, patch, cols, patch).permute(0, 1, 3, 2, 4).reshape(batch, rows * cols, -1)
    counts = torch.zeros(batch, rows * cols, LEVELS, dtype=torch.float32, device=rgb.device)
    counts.scatter_add_(2, blocks, torch.ones_like(blocks, dtype=torch.float32))
    probs = counts / float(patch * patch)
    logs = torch.where(probs > 0, torch.log2(probs.clamp_min(1e-30)), torch.zeros_like(probs))
    return -(probs * logs).sum(dim=-1)


def entropy_weights(entropy: torch.Tensor) -> torch.Tensor:
    """``softmax(H)`` over the patches of each crop (last dimension)."""
    return torch.softmax(entropy.float(), dim=-1)
