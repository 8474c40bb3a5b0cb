"""bitsandbytes' 4-bit layers (QLoRA) kept trainable on the CPU (a leaf module; it imports bitsandbytes only when a
model holds its layers).

bitsandbytes >= 0.49 repacks a ``bnb.nn.Linear4bit`` for a faster CPU inference kernel the first time the layer runs
in evaluation mode without gradients on a CPU with AVX512-BF16 (``Linear4bit.forward`` ->
``bitsandbytes.functional._convert_weight_packed_for_cpu``; bitsandbytes 0.50.2 does it on this project's Intel
Xeon). The repacking is permanent and lossy, and the kernel it selects (``bitsandbytes::gemv_4bit``) computes in bf16
and has no backward:

- training after one such forward (a recipe's before-training evaluation, trl_ext's savings probe,
  ``Trainer.evaluate``) gets no gradient through the 4-bit layers' inputs: the LoRA adapters below the last layer
  learn from a wrong gradient while torch only warns "an autograd kernel was not registered";
- a 4-bit layer with a bias (Qwen2's q/k/v projections) stops training with ``RuntimeError: a view of a leaf
  Variable that requires grad is being used in an in-place operation``;
- the weights change: the block scales (absmax) are rounded to bf16, and saving or moving the model afterwards
  "inverts" the packing without undoing that (for unnested NF4 the scales even stay transposed), so the saved 4-bit
  model is not the one loaded.

:func:`keep_trainable` turns that path off on every 4-bit layer of a model before its first forward: evaluation
then runs the same dequantize + matmul as training (in the layer's compute dtype, fp32 by default), so before- and
after-training scores, TRL's log-probs and the training forward agree. ``trl_ext.models.load_model`` calls it on
what it loads and every trl_ext trainer on the model it is given. A model that was already repacked cannot be
restored exactly (its scales were rounded); :func:`keep_trainable` refuses it with a ValueError that says how to
avoid it.

On the CPUs where that kernel applies, bitsandbytes also tries, when it is imported, to download a faster version of
it from the Hugging Face Hub (``kernels-community/quantization-bitsandbytes``, through the ``kernels`` package) and
otherwise logs "Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels". Since
trl_ext turns that kernel off, the message is dropped (:data:`HUB_KERNEL_MESSAGE`) instead of inviting an install
that would download code at run time.
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
    """Turn bitsandbytes' CPU inference repacking off on every 4-bit layer of ``model``; return how many layers it
    turned off (0 for a model without 4-bit layers, or one already kept trainable).

    Sets ``support_avx512bf16_for_cpu = False`` on each ``Linear4bit`` (the flag its ``forward`` reads before
    repacking); the layer then computes ``F.linear(x, dequantize_4bit(W))`` in training and in evaluation alike.
    Logs one line when it turned something off. Safe to call repeatedly and on any model (also on a GPU, where the
    flag is never read).

    Raises:
        ValueError: a layer was repacked already (an evaluation-mode forward without gradients ran on a CPU with
            AVX512-BF16 before trl_ext saw the model): its block scales are rounded to bf16 and its input gradient
            is gone, which no inverse restores. The message names the layer and how to avoid it.
    """
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
