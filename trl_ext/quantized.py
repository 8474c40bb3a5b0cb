"""bitsandbytes' 4-bit layers (QLoRA) kept trainable on the CPU (imports bitsandbytes only when a model holds them).

bitsandbytes >= 0.49 permanently repacks a ``Linear4bit`` for a bf16 CPU inference kernel (no backward) the first time
it runs in eval mode without gradients on an AVX512-BF16 CPU: later training gets wrong or no input gradients (or an
in-place ``RuntimeError`` with a bias), and the block scales are rounded to bf16, so a saved model is not the loaded
one. :func:`keep_trainable` turns that path off before the first forward (``trl_ext.models.load_model`` and every
trl_ext trainer call it) and refuses an already repacked model. bitsandbytes' import-time invitation to download that
kernel from the Hub is dropped (:data:`HUB_KERNEL_MESSAGE`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

HUB_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"
"""The start of the message bitsandbytes' CPU backend logs when it cannot fetch its Hub kernel (dropped here)."""


class _DropHubKernelMessage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(HUB_KERNEL_MESSAGE)


# bitsandbytes creates this logger when it is imported; a filter set on it beforehand stays on it.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropHubKernelMessage())


def bitsandbytes_modules(model: torch.nn.Module, class_name: str | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` whose class is bitsandbytes' (``class_name``, e.g. ``"Linear4bit"``: only that class;
    None: any), by name; PEFT's LoRA wrappers hold them as ``base_layer``. Empty for a model without them. Found by
    class, without importing bitsandbytes."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(
            c.__module__.startswith("bitsandbytes") and class_name in (None, c.__name__) for c in type(module).__mro__
        )
    ]


def linear4bit_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``bitsandbytes.nn.Linear4bit`` modules of ``model``, by name (:func:`bitsandbytes_modules`)."""
    return bitsandbytes_modules(model, "Linear4bit")


def is_repacked(module: torch.nn.Module) -> bool:
    """Whether bitsandbytes has repacked this 4-bit layer for its CPU inference kernel (see the module docstring)."""
    return bool(getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False))


def keep_trainable(model: Any) -> int:
    """Turn bitsandbytes' CPU inference repacking off on every 4-bit layer of ``model`` (``support_avx512bf16_for_cpu =
    False``: the layer then computes ``F.linear(x, dequantize_4bit(W))`` in training and evaluation alike); return how
    many layers it turned off. Logs one line when it did; safe to call repeatedly, on any model and device.

    Raises:
        ValueError: a layer was repacked already (its scales rounded, its input gradient gone); names the layer and
            how to avoid it."""
    if not isinstance(model, torch.nn.Module):
        return 0
    layers = linear4bit_modules(model)
    repacked = [name for name, module in layers if is_repacked(module)]
    if repacked:
        raise ValueError(
            f"the 4-bit layer {repacked[0]!r} ({len(repacked)} of {len(layers)}) was repacked by bitsandbytes for its "
            "CPU inference kernel (an evaluation-mode forward without gradients ran before trl_ext saw the model): "
            "that kernel computes in bf16 without a backward and the repacking rounded the layer's block scales, "
            "so the model can no longer be trained or saved as loaded. Load it again and call "
            "trl_ext.quantized.keep_trainable(model) before its first forward (trl_ext.models.load_model does)"
        )
    turned_off = 0
    for _, module in layers:
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            turned_off += 1
    if turned_off:
        logger.warning(
            "bitsandbytes' bf16 CPU inference kernel for 4-bit layers is off on %d layers (it has no backward and "
            "rounds the weights' scales): evaluation uses the same dequantize + matmul as training",
            turned_off,
        )
    return turned_off
