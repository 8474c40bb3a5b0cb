"""What this machine can run: the one check of each option that needs a package or a GPU (a leaf module).

Every option that only runs with the gpu extra or a CUDA GPU is an entry of :data:`NEEDS` -- vLLM, Liger kernels,
4/8-bit loading (bitsandbytes), flash-attention -- or bf16, which needs a GPU that has it. :func:`problem` is the one
decision and the one wording; its callers differ only in how their user named the option and turns it off::

    trl_ext.cli.parse (every problem at once, before any model loads):
        --use_vllm true: vLLM is not installed here; pass `--use_vllm false`, or install the gpu extra on a CUDA
        machine
    trl_ext.models.load_model, trl_ext.GRPOTrainer, trl_ext.eval.resolve_backend (raised by :func:`require`):
        load_in_4bit=True: 4-bit loading (bitsandbytes) needs a CUDA GPU (torch.cuda.is_available() is False);
        pass `load_in_4bit=False`

A missing package is checked first (``importlib.util.find_spec``: nothing is imported), then the GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

GPU_EXTRA = "install the gpu extra on a CUDA machine"
"""How to get every package of :data:`NEEDS`: pyproject.toml's ``gpu`` extra (``uv sync --extra gpu`` in a checkout,
``pip install 'trl_ext[gpu]'`` elsewhere; Linux with CUDA)."""


@dataclass(frozen=True)
class Need:
    """What an option needs of the machine.

    Attributes:
        what: the option's engine as a message names it (``"vLLM"``).
        package: the module it imports (``"vllm"``), or None (bf16: only the GPU).
    """

    what: str
    package: str | None


NEEDS = {
    "vllm": Need("vLLM", "vllm"),
    "liger_kernel": Need("liger-kernel", "liger_kernel"),
    "load_in_4bit": Need("4-bit loading (bitsandbytes)", "bitsandbytes"),
    "load_in_8bit": Need("8-bit loading (bitsandbytes)", "bitsandbytes"),
    "flash_attention_2": Need("flash-attention", "flash_attn"),
    "bf16": Need("bf16 training", None),
}
"""The options this module decides on, by name."""


def package_available(name: str) -> bool:
    """Whether module ``name`` is installed (found without importing it)."""
    return importlib.util.find_spec(name) is not None


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def bf16_gpu_available() -> bool:
    """Whether a GPU with bf16 (Ampere or newer) is here (transformers' own test)."""
    from transformers.utils import is_torch_bf16_gpu_available

    return is_torch_bf16_gpu_available()


def _cannot(need: str) -> tuple[type[Exception], str] | None:
    """Why this machine cannot run ``need`` (the exception a library caller gets, and the reason), or None."""
    wanted = NEEDS[need]
    if wanted.package is not None and not package_available(wanted.package):
        return ImportError, f"{wanted.what} is not installed here"
    if need == "bf16":
        if bf16_gpu_available():
            return None
        why = "this GPU has no bf16 (Ampere or newer)" if cuda_available() else "no CUDA GPU here"
        return RuntimeError, f"{wanted.what} needs a GPU that supports it ({why})"
    if not cuda_available():
        return RuntimeError, f"{wanted.what} needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def can_run(need: str) -> bool:
    """Whether this machine can run option ``need`` (a key of :data:`NEEDS`)."""
    return _cannot(need) is None


def _refusal(need: str, option: str, off: str) -> Exception | None:
    cannot = _cannot(need)
    if cannot is None:
        return None
    kind, reason = cannot
    return kind(f"{option}: {reason}; {off}" + (f", or {GPU_EXTRA}" if kind is ImportError else ""))


def problem(need: str, option: str, off: str) -> str | None:
    """What stops this machine from running option ``need`` (a key of :data:`NEEDS`), as the user named it, or None.

    Args:
        need: ``"vllm"``, ``"liger_kernel"``, ``"load_in_4bit"``, ``"load_in_8bit"``, ``"flash_attention_2"`` or
            ``"bf16"``.
        option: the option as the user set it (``"--use_vllm true"``, ``"use_vllm=True"``).
        off: how to run without it (``"pass `--use_vllm false`"``); a missing package adds how to install it.
    """
    refusal = _refusal(need, option, off)
    return None if refusal is None else str(refusal)


def require(need: str, option: str, off: str) -> None:
    """Raise :func:`problem`, if any, for a library caller.

    Raises:
        ImportError: the option's package is not installed.
        RuntimeError: no CUDA GPU (for bf16: none that supports it).
    """
    refusal = _refusal(need, option, off)
    if refusal is not None:
        raise refusal
