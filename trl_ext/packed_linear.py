"""Packed ``nn.Linear`` weights for the CPU inference forwards of generation and evaluation (issue 31).

Why. On a CPU, ``torch.nn.functional.linear`` in fp32 goes to MKL's sgemm. A decode step multiplies only a few rows
(one per sequence) by every weight of the model, and MKL runs that small GEMM far below the machine's peak when the
weight is in its plain layout. On an AMD EPYC (AVX-512) the 211 projections of SmolLM2-135M plus its head take
78-100 ms for 16 rows, where oneDNN's inner-product with the weights reordered once into its blocked layout takes
44-47 ms (285 -> 165 ms for 100 rows); on an Intel Xeon (Sapphire Rapids) 83 ms plain, 66 ms oneDNN packed and 50 ms
with MKL's own packed sgemm (237 -> 181 ms for 100 rows; docs/performance.md). Packing costs about one weight copy
(0.15-0.3 s for the whole model), so it pays when the same weights serve many forwards: the decode steps of a
``generate`` call, the rounds of one training step, an evaluation.

What. :class:`PackedLinearWeights` keeps, per ``nn.Linear``, its weight packed and, inside
:meth:`PackedLinearWeights.applied`, makes the module's forward run on that packed weight, with one of two backends
(:func:`choose_backend`), both PyTorch's own ops (the ones inductor uses for CPU linears):

- ``"mkl"`` (Intel CPUs, when the row count is known): ``torch.ops.mkl._mkl_reorder_linear_weight``
  (``cblas_sgemm_pack`` for that row count) and ``torch.ops.mkl._mkl_linear`` (``cblas_sgemm_compute``); a forward
  of another row count runs the module's own forward. MKL's kernel stays MKL's: on the embedded model a rollout's
  logits were bit-equal to the plain forward's (not guaranteed for every shape: for 1-7 rows MKL's plain path is a
  different kernel, and there outputs differ at float rounding).
- ``"onednn"`` (otherwise): ``torch.ops.mkldnn._reorder_linear_weight`` and ``torch.ops.mkldnn._linear_pointwise``,
  any row count. The sums run in oneDNN's order instead of MKL's, so outputs differ at float rounding (~1e-7
  relative), as any change of GEMM kernel does.

Exact or off, per call: a packed forward runs only for an fp32 CPU input without autograd (no grad mode, or
neither weight nor input requiring grad), outside CPU autocast, while the weight is the very tensor that was packed
at the same version (an optimizer step, ``copy_`` or ``.data =`` invalidates it); anything else runs the module's
own forward. Modules are packed only when their class is exactly ``nn.Linear`` (quantized, LoRA and other
subclasses keep their own forward), with a plain 2-D fp32 CPU weight of the declared shape and no forward already
replaced on the instance (accelerate's offloading hooks). The whole saving is off, in one log line per model and
reason (:func:`packing_blocker`), where PyTorch has no oneDNN prepacking ops (both backends hold the packed
buffer in a oneDNN tensor), where no such module exists, or where the packed copies would take more than a quarter
of the memory available now.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("trl_ext")

MEMORY_FRACTION = 0.25
"""Packed copies of the weights may take at most this fraction of the memory available when packing starts."""

_announced: set[tuple[int, str]] = set()


def _ops_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def _mkl_ops_available() -> bool:
    ops = getattr(torch.ops, "mkl", None)
    try:
        return (
            torch.backends.mkl.is_available()
            and torch.backends.mkldnn.is_available()  # the packed buffer is held in an mkldnn tensor
            and hasattr(ops, "_mkl_reorder_linear_weight")
            and hasattr(ops, "_mkl_linear")
        )
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=8)
def cpu_vendor(cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...): the first ``vendor_id`` line of
    ``cpuinfo_path``; None where there is none or it cannot be read (not Linux, not x86). Read once per path."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def choose_backend(rows_hint: int | None) -> str:
    """``"mkl"`` or ``"onednn"``: which packed GEMM :class:`PackedLinearWeights` uses.

    MKL's own packed sgemm (``cblas_sgemm_pack``/``cblas_sgemm_compute`` through ``torch.ops.mkl``) on an Intel CPU
    when the row count is known (it packs for one row count: forwards of other row counts run the plain forward);
    oneDNN's blocked layout otherwise. Measured on the embedded model's 211 projections (docs/performance.md):
    on an Intel Xeon (Sapphire Rapids) 16 rows 83 ms plain, 66 ms oneDNN packed, 50 ms MKL packed; on an AMD EPYC
    78-100 ms plain, 44-47 ms oneDNN packed (MKL's packed path not measured there, so not chosen there).
    """
    if rows_hint and _mkl_ops_available() and cpu_vendor() == "GenuineIntel":
        return "mkl"
    return "onednn"


def packable(module: torch.nn.Module) -> bool:
    """True for a module whose forward :class:`PackedLinearWeights` may run packed: class exactly ``nn.Linear``, a
    plain non-empty 2-D fp32 CPU weight of shape ``(out_features, in_features)``, no instance-level forward
    (accelerate hooks, another patch) and no accelerate ``_hf_hook``."""
    if type(module) is not torch.nn.Linear or "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return False
    weight = module.weight
    return (
        type(weight.data) is torch.Tensor
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and tuple(weight.shape) == (module.out_features, module.in_features)
        and weight.numel() > 0
        and (module.bias is None or (module.bias.dtype == torch.float32 and module.bias.device.type == "cpu"))
    )


def _available_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None


def packing_blocker(model: torch.nn.Module) -> str | None:
    """Why :class:`PackedLinearWeights` cannot run any forward of ``model`` packed, or None.

    Reasons: this PyTorch has no oneDNN prepacking ops (``torch.ops.mkldnn._reorder_linear_weight`` and
    ``_linear_pointwise``); no module is :func:`packable` (weights not fp32, not on the CPU, empty, quantized,
    offloaded, sharded, ...); the packed copies (one per weight, fp32) would exceed :data:`MEMORY_FRACTION` of the
    memory available now (``psutil``).
    """
    if not _ops_available():
        return "this PyTorch has no oneDNN prepacking ops (torch.ops.mkldnn._reorder_linear_weight)"
    modules = [m for m in model.modules() if packable(m)]
    if not modules:
        return "no nn.Linear with an fp32 CPU weight"
    needed = sum(m.weight.numel() * 4 for m in modules)
    available = _available_bytes()
    if available is not None and needed > MEMORY_FRACTION * available:
        return (
            f"packed weights would take {needed / 2**30:.2f} GiB, more than {MEMORY_FRACTION:.0%} of the "
            f"{available / 2**30:.2f} GiB available"
        )
    return None


@dataclass
class _Packed:
    weight: torch.Tensor  # the module's weight tensor that was packed (identity, data pointer and version checked)
    data_ptr: int
    version: int
    packed: torch.Tensor


def _is_current(entry: _Packed, weight: torch.Tensor) -> bool:
    return entry.weight is weight and entry.data_ptr == weight.data_ptr() and entry.version == weight._version


class PackedLinearWeights:
    """Packed copies of a model's ``nn.Linear`` weights, kept while the weights do not change.

    Args:
        rows_hint: rows a forward is expected to multiply (the batch of a decode step). For oneDNN a hint to its
            reordering (None lets oneDNN choose; any row count runs packed); for MKL the row count packed for
            (forwards of other row counts run the module's plain forward).
        backend: ``"mkl"`` or ``"onednn"``; None (default): :func:`choose_backend`.

    Raises:
        ValueError: an unknown ``backend``, or ``"mkl"`` without a ``rows_hint`` or on a PyTorch without its ops.

    Use ``with packed.applied(model): model.generate(...)``; entries whose weight changed since they were packed are
    repacked at the next :meth:`applied`; :meth:`clear` drops every packed copy (memory back).
    """

    def __init__(self, rows_hint: int | None = None, backend: str | None = None):
        if backend not in (None, "mkl", "onednn"):
            raise ValueError(f"backend={backend!r}; expected 'mkl', 'onednn' or None (choose by CPU)")
        if backend == "mkl" and not rows_hint:
            raise ValueError("backend='mkl' packs for one row count: give rows_hint (>= 1)")
        if backend == "mkl" and not _mkl_ops_available():
            raise ValueError("backend='mkl': this PyTorch has no MKL packing ops (torch.ops.mkl._mkl_linear)")
        self.rows_hint = rows_hint
        self.backend = backend or choose_backend(rows_hint)
        self._entries: dict[int, _Packed] = {}

    def clear(self) -> None:
        """Drop every packed copy."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, module: torch.nn.Linear) -> _Packed | None:
        """The module's packed weight, packed now if it is missing or stale; None where oneDNN refuses the weight
        (the module then keeps its own forward)."""
        entry = self._entries.get(id(module))
        weight = module.weight
        if entry is None or not _is_current(entry, weight):
            try:
                with torch.no_grad():
                    detached = weight.detach()
                    if self.backend == "mkl":
                        packed = torch.ops.mkl._mkl_reorder_linear_weight(detached, self.rows_hint)
                    elif self.rows_hint:
                        packed = torch.ops.mkldnn._reorder_linear_weight(detached, self.rows_hint)
                    else:
                        packed = torch.ops.mkldnn._reorder_linear_weight(detached)
            except RuntimeError:
                return None
            entry = _Packed(weight, weight.data_ptr(), weight._version, packed)
            self._entries[id(module)] = entry
        return entry

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module) -> Iterator[None]:
        """Run ``model``'s packable ``nn.Linear`` forwards packed for the duration of the block (see the module
        docstring for when a call still runs the plain forward). Off, with one log line per model and reason, where
        :func:`packing_blocker` says so; silently for a model whose parameters are not on the CPU. The modules'
        forwards are restored on exit, also on error."""
        first = next(model.parameters(), None)
        if first is None or first.device.type != "cpu":  # a CPU saving: nothing to say for a model on a GPU
            yield
            return
        reason = packing_blocker(model)
        if reason is not None:
            announce(model, reason)
            yield
            return
        patched: list[torch.nn.Module] = []
        try:
            for module in model.modules():
                entry = self._entry(module) if packable(module) else None
                if entry is not None:
                    module.forward = _packed_forward(module, entry, self.backend, self.rows_hint)
                    patched.append(module)
            yield
        finally:
            for module in patched:
                module.__dict__.pop("forward", None)


def _packed_forward(module: torch.nn.Linear, entry: _Packed, backend: str = "onednn", rows: int | None = None):
    plain = type(module).forward.__get__(module)

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (
            input.dtype != torch.float32
            or input.device.type != "cpu"
            or input.dim() < 2
            or input.shape[-1] != module.in_features
            or (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
            or torch.is_autocast_enabled("cpu")
            or not _is_current(entry, weight)
        ):
            return plain(input)
        bias = module.bias
        if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"):
            return plain(input)
        if backend == "mkl":
            if input.numel() != rows * module.in_features:  # packed for `rows` rows only
                return plain(input)
            return _mkl_linear(input, entry.packed, weight, bias, rows)
        return _pointwise(input, entry.packed, bias)

    return forward


def _pointwise(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``input @ W^T + bias`` by oneDNN, ``W`` given packed (no activation fused)."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


def _mkl_linear(
    input: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``input @ W^T + bias`` by MKL's ``cblas_sgemm_compute``, ``W`` packed by ``cblas_sgemm_pack`` for ``rows``."""
    return torch.ops.mkl._mkl_linear(input, packed, weight, bias, rows)


def announce(model: Any, reason: str) -> None:
    """Log once per model and reason that ``prepack_linear_weights`` is off and why."""
    key = (id(model), reason)
    if key not in _announced:
        _announced.add(key)
        logger.warning(
            "trl_ext prepack_linear_weights off for %s: %s (MKL's plain linear used)", type(model).__name__, reason
        )
