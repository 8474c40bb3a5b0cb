"""Speed defaults for CPU runs: every core by default, bf16 autocast where the CPU has bf16 instructions.

An explicit choice of the user always wins. ``accelerate launch`` (1.15) and ``torchrun`` export
``OMP_NUM_THREADS=1`` on a CPU machine; :func:`thread_setting` tells that default from a user's own by reading the
launcher's start-up environment and flags in ``/proc``. :func:`keep_freed_memory` keeps a step's freed memory for
the next (glibc). :func:`apply_speed_defaults` is the recipes' one call.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trl_ext.errors import read_text

THREAD_FLAG = "--num_cpu_threads_per_process"


@dataclasses.dataclass
class ThreadSetting:
    """Where a process's thread count comes from.

    Attributes:
        explicit: True when the user chose it (see :func:`thread_setting`).
        source: ``"OMP_NUM_THREADS"``, ``"--num_cpu_threads_per_process"``, ``"launcher default"`` or ``"unset"``.
        value: the ``OMP_NUM_THREADS`` this process sees, or None.
    """

    explicit: bool
    source: str
    value: int | None


def _read_proc(pid: int, name: str) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None


def _is_launcher(cmdline: Sequence[str]) -> bool:
    """``accelerate launch``, ``python -m accelerate.commands.launch``, ``torchrun`` or ``torch.distributed.run``."""
    names = [os.path.basename(a) for a in cmdline]
    if "launch" in cmdline and any(n == "accelerate" or n.startswith("accelerate.commands") for n in names):
        return True
    return any(
        n in ("torchrun", "accelerate.commands.launch", "torch.distributed.run", "accelerate-launch") for n in names
    )


def find_launcher(pid: int | None = None, max_depth: int = 4) -> int | None:
    """The pid of the nearest ancestor of ``pid`` (default: this process) that is a launcher, or None.

    Looks at most ``max_depth`` parents up; None where ``/proc`` cannot be read (non-Linux).
    """
    pid = os.getpid() if pid is None else pid
    for _ in range(max_depth):
        status = _read_proc(pid, "status")
        if status is None:
            return None
        ppid = next((int(line.split()[1]) for line in "".join(status).splitlines() if line.startswith("PPid:")), 0)
        if ppid <= 1:
            return None
        cmdline = _read_proc(ppid, "cmdline")
        if cmdline and _is_launcher(cmdline):
            return ppid
        pid = ppid
    return None


def thread_setting(
    env: dict[str, str] | None = None,
    launcher_env: dict[str, str] | None = None,
    launcher_cmdline: Sequence[str] | None = None,
) -> ThreadSetting:
    """Decide whether this process's ``OMP_NUM_THREADS`` is the user's choice or a launcher's default.

    Args:
        env: this process's environment (default ``os.environ``).
        launcher_env, launcher_cmdline: the launcher's start-up environment and command line; by default read from
            ``/proc`` for the nearest launcher ancestor (:func:`find_launcher`). Pass both as None with no launcher.

    Rules: ``OMP_NUM_THREADS`` unset -> not explicit (``"unset"``). Set and a launcher found -> explicit when the
    launcher was started with ``OMP_NUM_THREADS`` in its environment or with ``--num_cpu_threads_per_process``,
    else the launcher's default. Set and no launcher found (a plain ``python script.py``, or ``/proc`` unreadable)
    -> explicit: we cannot prove it is not the user's, so it is respected.
    """
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS")
    value = int(raw) if raw and raw.strip().isdigit() else None
    if raw is None:
        return ThreadSetting(False, "unset", None)
    if launcher_env is None and launcher_cmdline is None:
        pid = find_launcher()
        if pid is not None:
            launcher_cmdline = _read_proc(pid, "cmdline") or []
            launcher_env = dict(e.split("=", 1) for e in (_read_proc(pid, "environ") or []) if "=" in e)
    if launcher_env is None and launcher_cmdline is None:
        return ThreadSetting(True, "OMP_NUM_THREADS", value)
    if any(a == THREAD_FLAG or a.startswith(THREAD_FLAG + "=") for a in (launcher_cmdline or [])):
        return ThreadSetting(True, THREAD_FLAG, value)
    if "OMP_NUM_THREADS" in (launcher_env or {}):
        return ThreadSetting(True, "OMP_NUM_THREADS", value)
    return ThreadSetting(False, "launcher default", value)


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_num_threads(local_processes: int | None = None, cores: int | None = None) -> int:
    """``cores // local_processes`` (at least 1): every core, shared evenly by the processes on this machine.

    ``local_processes`` defaults to ``$LOCAL_WORLD_SIZE`` (set by torchrun/accelerate) or 1.
    """
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, local_processes))


def configure_cpu_threads(setting: ThreadSetting | None = None, on_gpu: bool | None = None) -> dict[str, Any]:
    """Use every core (shared by the local processes) unless the user set the thread count; return what was done.

    Nothing changes on a GPU machine; otherwise, unless ``setting`` (default :func:`thread_setting`) is explicit,
    ``torch.set_num_threads(default_num_threads())`` and ``OMP_NUM_THREADS`` updated for child processes.

    Returns:
        ``{"threads": int, "source": str, "changed": bool}``; ``source`` is ``"default (cores / local
        processes)"``, the explicit setting's source, or ``"gpu"``.
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if on_gpu:
        return {"threads": torch.get_num_threads(), "source": "gpu", "changed": False}
    setting = thread_setting() if setting is None else setting
    if setting.explicit:
        return {"threads": torch.get_num_threads(), "source": setting.source, "changed": False}
    threads = default_num_threads()
    changed = threads != torch.get_num_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return {"threads": threads, "source": "default (cores / local processes)", "changed": changed}


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU has bf16 instructions (``avx512_bf16``, ``amx_bf16``, Arm ``bf16``; without them bf16 is
    emulated, slower than fp32), read from ``/proc/cpuinfo`` or ``cpuinfo``; False where unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, rest = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(rest.split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def precision_set_by_user(argv: Sequence[str] | None = None, config_path: str | os.PathLike | None = None) -> bool:
    """True when ``--bf16``/``--fp16`` is on the command line, or ``bf16``/``fp16`` is a key of any config layer
    (``config_path``, each ``--config FILE`` of ``argv``), as ``trl_ext.cli.parse`` layers them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag in ("--bf16", "--fp16"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            return True
    paths = [config_path] if config_path is not None else []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    import yaml

    for path in paths:
        config = yaml.safe_load(read_text(path))  # as trl_ext.cli reads it or {}
        if isinstance(config, dict) and ("bf16" in config or "fp16" in config):
            return True
    return False


_WEIGHT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def precision_label(training_args: Any, dtype: Any = "float32") -> str:
    """What a run computes in, from its autocast (``training_args.bf16``/``fp16``) and its weights' ``dtype``
    (``trl.ModelConfig.dtype``; "auto"/None = the checkpoint's own): ``"fp32"``, ``"bf16 autocast, fp32 weights"``,
    ``"bf16 weights, no autocast"``, ..."""
    name = str(dtype).replace("torch.", "") if dtype is not None else "auto"
    weights = _WEIGHT_NAMES.get(name, "checkpoint-dtype" if name == "auto" else name)
    autocast = (
        "bf16" if getattr(training_args, "bf16", False) else "fp16" if getattr(training_args, "fp16", False) else None
    )
    if autocast is None:
        return "fp32" if weights == "fp32" else f"{weights} weights, no autocast"
    return f"{autocast} autocast, {weights} weights"


def name_loaded_weights(precision: str, training_args: Any, requested_dtype: Any, model: Any) -> str:
    """``precision`` (made before the model loaded) with the weights' dtype the model really has:
    ``"checkpoint-dtype weights, no autocast (GPU)"`` becomes ``"bf16 weights, ..."``; other labels unchanged.

    Args:
        precision: the label (``speed["precision"]``).
        training_args: the run's ``TrainingArguments`` (its ``bf16``/``fp16``).
        requested_dtype: ``trl.ModelConfig.dtype``, as passed to :func:`apply_speed_defaults`.
        model: the loaded model (its ``dtype``).
    """
    before = precision_label(training_args, requested_dtype)
    if not precision.startswith(before):
        return precision
    return precision_label(training_args, getattr(model, "dtype", requested_dtype)) + precision[len(before) :]


def note_loaded_weights(speed: dict[str, Any] | None, training_args: Any, requested_dtype: Any, model: Any) -> None:
    """Once the model is loaded, name the weights it really has in ``speed["precision"]``
    (:func:`name_loaded_weights`); nothing when ``speed`` is None (no speed defaults were applied)."""
    if speed:
        speed["precision"] = name_loaded_weights(speed["precision"], training_args, requested_dtype, model)


def enable_cpu_bf16(training_args: Any, *, user_set: bool, has_bf16: bool | None = None, dtype: Any = "float32") -> str:
    """On a CPU run whose precision the user did not set: bf16 autocast where the CPU has bf16 instructions, else fp32.

    (TRL's ``GRPOConfig`` defaults to ``bf16=True`` whatever the CPU.) Weights and optimizer state stay fp32; the LM
    head runs in fp32 (``cast_lm_head_to_fp32``, TRL 1.16), so log-probs, ratio, KL and advantages are fp32. Sets
    ``bf16`` and ``mixed_precision`` together, as ``TrainingArguments.__post_init__`` does (transformers 5.x).

    Args:
        training_args: a ``TrainingArguments`` (e.g. ``trl.GRPOConfig``), changed in place.
        user_set: the user gave ``--bf16``/``--fp16`` or a config with them (:func:`precision_set_by_user`).
        has_bf16: override :func:`cpu_has_bf16` (tests).
        dtype: the model's weights (``trl.ModelConfig.dtype``), for the label.

    Returns:
        :func:`precision_label`, followed by ``" (default: ...)"`` when chosen here or ``" (GPU)"`` on a GPU.
    """
    if not getattr(training_args, "use_cpu", False) and torch.cuda.is_available():
        return f"{precision_label(training_args, dtype)} (GPU)"
    if user_set:
        return precision_label(training_args, dtype)
    bf16 = cpu_has_bf16() if has_bf16 is None else has_bf16
    training_args.bf16, training_args.fp16 = bf16, False
    training_args.mixed_precision = "bf16" if bf16 else "no"
    if bf16 and hasattr(training_args, "cast_lm_head_to_fp32"):
        training_args.cast_lm_head_to_fp32 = True
    why = "CPU has bf16 instructions" if bf16 else "no bf16 instructions"
    return f"{precision_label(training_args, dtype)} (default: {why})"


KEEP_FREED_MEMORY_VARIABLE = "TRL_EXT_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
_HEAP_BLOCKS_UNDER = 32 * 2**20  # glibc's largest M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
_USER_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory(on_gpu: bool | None = None, environ: Any = None, libc: Any = None) -> str:
    """On a CPU run, let glibc's allocator keep the memory a training step frees for the next step; return what was
    done, in words (for ``metrics.json``).

    By default glibc hands the top of its heap back to the system once more than twice its mmap threshold (at most
    64 MiB) is free there, and serves blocks over that threshold (128 KiB, raised up to 32 MiB as large blocks are
    freed) by ``mmap``: a step's activations, gradients and packed weights, freed at its end, come back as fresh
    pages the next step faults in and zeroes again (the main job: 2.8-3.3 M page faults in 6 steps, 7 s of system
    time). Here ``mallopt(M_TRIM_THRESHOLD, -1)`` (never trim) and ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` (blocks
    under 32 MiB from the heap): the process keeps its heap's high-water mark, as PyTorch's CUDA caching allocator
    keeps GPU memory. Values computed are unchanged (only where memory comes from); peak resident memory can rise
    by the heap's fragmentation (main job: about 4.0 -> 5.1 GiB).

    Unchanged on a GPU run, off glibc (no ``gnu_get_libc_version``), where the user set glibc's malloc variables
    (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``, or ``malloc``
    tunables in ``GLIBC_TUNABLES``: theirs win) or ``TRL_EXT_KEEP_FREED_MEMORY=0``.

    Args:
        on_gpu: default ``torch.cuda.is_available()``.
        environ: default ``os.environ``.
        libc: default the C library this process runs on (``ctypes.CDLL(None)``).
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    environ = os.environ if environ is None else environ
    if on_gpu:
        return "glibc default (GPU run)"
    if environ.get(KEEP_FREED_MEMORY_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"glibc default ({KEEP_FREED_MEMORY_VARIABLE}={environ[KEEP_FREED_MEMORY_VARIABLE]})"
    user = [name for name in _USER_MALLOC_VARIABLES if name in environ]
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"as the user set it ({', '.join(user)})"
    if libc is None:
        import ctypes

        try:
            libc = ctypes.CDLL(None)
        except OSError:
            return "system default (no C library found)"
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "system default (not glibc)"
    if not libc.mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCKS_UNDER):
        return "glibc default (mallopt refused)"
    if not libc.mallopt(_M_TRIM_THRESHOLD, -1):
        return "blocks under 32 MiB from the heap; glibc's trimming (mallopt refused M_TRIM_THRESHOLD)"
    return "freed memory kept (glibc: no trim, blocks under 32 MiB from the heap)"


def apply_speed_defaults(
    training_args: Any,
    argv: Sequence[str] | None = None,
    default_config: str | os.PathLike | None = None,
    dtype: Any = "float32",
) -> dict[str, Any]:
    """The recipes' one call: :func:`configure_cpu_threads`, :func:`enable_cpu_bf16` and :func:`keep_freed_memory`;
    returns what was chosen.

    Args:
        training_args: the parsed ``TrainingArguments``, changed in place.
        argv: the recipe's command line (default ``sys.argv[1:]``).
        default_config: the recipe's default config, under every ``--config`` of ``argv``.
        dtype: the model's weights (``trl.ModelConfig.dtype``), named in ``precision``.

    Returns:
        ``{"threads", "threads_source", "precision", "cores", "allocator"}``, for ``metrics.json``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    on_gpu = torch.cuda.is_available()
    threads = configure_cpu_threads(on_gpu=on_gpu)
    precision = enable_cpu_bf16(training_args, user_set=precision_set_by_user(argv, default_config), dtype=dtype)
    return {
        "threads": threads["threads"],
        "threads_source": threads["source"],
        "precision": precision,
        "cores": available_cores(),
        "allocator": keep_freed_memory(on_gpu=on_gpu),
    }
