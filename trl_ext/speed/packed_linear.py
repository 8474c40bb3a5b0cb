"""Packed ``nn.Linear`` weights for the CPU inference forwards of generation and evaluation (issues 31, 37).

A decode step multiplies a few rows by every weight, and MKL's fp32 sgemm runs that far below peak on the plain
layout; a weight packed once serves every step faster (SmolLM2-135M, 16 rows: 78-100 -> 44-47 ms on an AMD EPYC with
oneDNN, 83 -> 50 ms on a Xeon with MKL's packed sgemm; docs/performance.md), for about one weight copy (0.15-0.3 s).

:class:`PackedLinearWeights` runs each :func:`packable` module on a packed copy inside its ``applied`` blocks, with
PyTorch's own ops (:func:`choose_backend`): ``"mkl"`` (Intel; packs for one row count, other counts run plain;
bit-equal logits on the embedded model, not guaranteed for 1-7 rows) or ``"onednn"`` (any row count; differs at float
rounding, ~1e-7 relative). A weight is packed lazily, at the first forward of the row count ``applied``
names, or else at the second forward of one row count (a decode step's; a prefill's is seen once).

Never stale: a copy lives only as long as its ``applied`` block, or the :meth:`~PackedLinearWeights.fixed_weights`
block around it, so no write between blocks (an optimizer step, ``load_state_dict``, a write through ``.data``) can
make a packed forward use old weights; inside a block a version bump or new storage sends the module to its plain
forward. Exact or off: a packed forward runs only for an fp32 CPU input without autograd or autocast; each backend
is checked once per process against ``F.linear`` (:func:`probe_backend`); the whole saving is off, in one log line,
where :func:`packing_blocker` says so.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trl_ext.logs import say_once

logger = logging.getLogger("trl_ext")

MEMORY_FRACTION = 0.25
"""Packed copies of the weights may take at most this fraction of the memory available when packing starts."""


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


def choose_backend() -> str:
    """``"mkl"`` (MKL's packed sgemm through ``torch.ops.mkl``) on an Intel CPU, where it measured fastest (Sapphire
    Rapids, 16 rows: 83 ms plain, 66 oneDNN, 50 MKL); ``"onednn"`` otherwise (MKL's path not measured elsewhere)."""
    if _mkl_ops_available() and cpu_vendor() == "GenuineIntel":
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

    Reasons: no oneDNN prepacking ops (both backends hold the copy in a oneDNN tensor); no :func:`packable` module;
    the copies would exceed :data:`MEMORY_FRACTION` of the memory available now.
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
class _Entry:
    """One module's packing state within a block (the weight's identity, pointer and version; the copy)."""

    weight: torch.Tensor
    data_ptr: int
    version: int
    seen: int | None = None
    packed: torch.Tensor | None = None
    rows: int | None = None
    backend: str | None = None
    refused: bool = False  # the backend refused this weight: plain forward for the rest of the block

    def current(self, weight: torch.Tensor) -> bool:
        return self.weight is weight and self.data_ptr == weight.data_ptr() and self.version == weight._version


class PackedLinearWeights:
    """Packed copies of a model's ``nn.Linear`` weights, made and used inside :meth:`applied` blocks.

    Args:
        backend: ``"mkl"`` or ``"onednn"``; None (default): :func:`choose_backend`. A backend whose probe fails
            (:func:`probe_backend`) is replaced by the other one, or by no packing, in one log line.

    Raises:
        ValueError: an unknown ``backend``, or ``"mkl"`` on a PyTorch without its ops.

    Use ``with packed.applied(model, rows=batch): model.generate(...)``, inside ``with packed.fixed_weights():`` to
    pack once for several blocks.
    """

    def __init__(self, backend: str | None = None):
        if backend not in (None, "mkl", "onednn"):
            raise ValueError(f"backend={backend!r}; expected 'mkl', 'onednn' or None (choose by CPU)")
        if backend == "mkl" and not _mkl_ops_available():
            raise ValueError("backend='mkl': this PyTorch has no MKL packing ops (torch.ops.mkl._mkl_linear)")
        self.backend: str | None = backend or choose_backend()
        self._entries: dict[int, _Entry] = {}
        self._fixed = 0  # depth of fixed_weights blocks
        self._rows: int | None = None  # the row count named by the open applied() block

    def clear(self) -> None:
        """Drop every packed copy (memory back)."""
        self._entries.clear()

    def __len__(self) -> int:
        """Modules holding a packed copy now."""
        return sum(1 for entry in self._entries.values() if entry.packed is not None)

    @contextlib.contextmanager
    def fixed_weights(self) -> Iterator[None]:
        """Keep the copies of the :meth:`applied` blocks inside until the outermost such block ends (each weight
        packed once). The caller promises no weight changes inside: a write through ``.data`` would not be seen."""
        self._fixed += 1
        try:
            yield
        finally:
            self._fixed -= 1
            if not self._fixed:
                self.clear()

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module, rows: int | None = None) -> Iterator[None]:
        """Run ``model``'s packable ``nn.Linear`` forwards packed in the block; copies dropped at its end unless a
        :meth:`fixed_weights` block is open. ``rows``: the row count to pack for (a ``generate`` call's batch: with
        oneDNN, whose copy serves any row count, the first forward packs and the prefill runs packed too); None: the
        second forward of one row count. Off where :func:`packing_blocker` says so (one log line), silently off
        the CPU; forwards restored on exit, also on error."""
        first = next(model.parameters(), None)
        if first is None or first.device.type != "cpu" or self.backend is None:
            yield  # a CPU saving: nothing to say for a model on a GPU; a backend turned off has said so
            return
        reason = packing_blocker(model)
        if reason is not None:
            announce(model, reason)
            yield
            return
        patched: list[torch.nn.Module] = []
        outer_rows, self._rows = self._rows, rows
        try:
            for module in model.modules():
                if packable(module):
                    module.forward = _packed_forward(self, module)
                    patched.append(module)
            yield
        finally:
            self._rows = outer_rows
            for module in patched:
                module.__dict__.pop("forward", None)
            if not self._fixed:
                self.clear()

    def _packed_for(self, module: torch.nn.Linear, rows: int) -> tuple[torch.Tensor, str] | None:
        """The packed copy of ``module``'s weight and its backend, for a servable forward of ``rows`` rows; packed now
        when this forward is the one to pack at; None where the plain forward must run."""
        weight = module.weight
        entry = self._entries.get(id(module))
        if entry is None or not entry.current(weight):  # new, or written in place / replaced since: start over
            entry = self._entries[id(module)] = _Entry(weight, weight.data_ptr(), weight._version)
        if entry.packed is not None:
            return (entry.packed, entry.backend) if entry.backend == "onednn" or entry.rows == rows else None
        if entry.refused:
            return None
        # decided before the probe, so that it runs on a row count that is packed (MKL's kernel depends on the
        # count), and again where the probe moved the backend
        planned = self.backend
        if self._waits(planned, rows, entry):
            return None
        backend = self._working_backend(rows)
        if backend is None or (backend != planned and self._waits(backend, rows, entry)):
            return None
        pack_rows = self._rows if self._any_rows(backend) else rows
        try:
            with torch.no_grad():
                entry.packed = _reorder(backend, weight.detach(), pack_rows)
        except RuntimeError:  # the backend refuses this weight: the module keeps its own forward
            entry.refused = True
            return None
        entry.rows, entry.backend = pack_rows, backend
        return entry.packed, backend

    def _any_rows(self, backend: str | None) -> bool:
        """oneDNN's copy serves any row count: inside a generate block (rows named) the prefill packs it, with the
        decode's count as the hint, and runs on it too."""
        return backend == "onednn" and self._rows is not None

    def _waits(self, backend: str | None, rows: int, entry: _Entry) -> bool:
        """True where a forward of ``rows`` rows runs plain instead of packing ``backend``'s copy. MKL's serves one
        count: inside a block that names its count only that count packs (any other -- a prefill's, a probe's --
        runs plain however often it comes, so it cannot take the copy the decode steps need); without a named
        count, a count seen before is packed at its second forward."""
        if self._any_rows(backend) or rows == self._rows:
            return False
        if self._rows is None and rows == entry.seen:
            return False
        entry.seen = rows
        return True

    def _working_backend(self, rows: int) -> str | None:
        """This object's backend once its probe passed (:func:`probe_backend`, once per process and backend); else
        the other backend where its probe passes, else None (no packing), said in one log line."""
        backend = self.backend
        if backend is None:
            return None
        reason = probe_backend(backend, rows)
        if reason is None:
            return backend
        other = "onednn" if backend == "mkl" else "mkl"
        # MKL's kernel depends on the row count: probed on the count it will pack for (the named one), not on the
        # prefill's count at which oneDNN's probe ran
        other_rows = self._rows if other == "mkl" and self._rows is not None else rows
        other_reason = probe_backend(other, other_rows) if other == "onednn" or _mkl_ops_available() else "no MKL ops"
        self.backend = None if other_reason else other
        message = f"trl_ext prepack_linear_weights: the {backend} backend is off ({reason}); " + (
            f"the {other} backend is used" if not other_reason else f"{other}: {other_reason}; plain forward used"
        )
        say_once(message, log=logger)
        return self.backend


def _packed_forward(owner: PackedLinearWeights, module: torch.nn.Linear):
    plain = type(module).forward.__get__(module)

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if (
            input.dtype != torch.float32
            or input.device.type != "cpu"
            or input.dim() < 2
            or input.shape[-1] != module.in_features
            or input.numel() == 0
            or (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
            or torch.is_autocast_enabled("cpu")
            or (bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu"))
        ):
            return plain(input)
        rows = input.numel() // module.in_features
        found = owner._packed_for(module, rows)
        if found is None:
            return plain(input)
        packed, backend = found
        if backend == "mkl":
            return _mkl_linear(input, packed, weight, bias, rows)
        return _pointwise(input, packed, bias)

    return forward


def _reorder(backend: str, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (out, in) packed by ``backend`` for ``rows`` rows (for oneDNN a hint: any row count is served)."""
    if backend == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _pointwise(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``input @ W^T + bias`` by oneDNN, ``W`` given packed (no activation fused)."""
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


def _mkl_linear(
    input: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``input @ W^T + bias`` by MKL's ``cblas_sgemm_compute``, ``W`` packed by ``cblas_sgemm_pack`` for ``rows``."""
    return torch.ops.mkl._mkl_linear(input, packed, weight, bias, rows)


PROBE_SHAPES = ((5, 7, True), (3, 16, False), (17, 33, True))
"""(out_features, in_features, bias) of the weights :func:`probe_backend` packs."""

_probe_results: dict[str, str | None] = {}  # backend -> None (its ops compute F.linear) or why not


def probe_backend(backend: str, rows: int) -> str | None:
    """None when ``backend``'s packing and packed-GEMM ops compute ``torch.nn.functional.linear`` on this PyTorch,
    else why not (the op's exception, or the largest difference). Decided once per process and backend.

    Weights of :data:`PROBE_SHAPES` from a private generator, inputs of 1, 3 and ``rows`` rows as (m, in) and
    (m, 1, in); each output within the worst-case float32 dot-product rounding of ``F.linear``'s:
    ``|packed - plain| <= gamma(in + 2) * (|x| @ |W|^T + |b|)``, ``gamma(n) = n u / (1 - n u)``, u = 2^-24 (Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1).
    """
    if backend not in _probe_results:
        try:
            _probe_results[backend] = _probe(backend, rows)
        except Exception as err:  # noqa: BLE001 -- any failure of a private op means: not this backend
            _probe_results[backend] = f"probe: {type(err).__name__}: {str(err)[:120]}"
    return _probe_results[backend]


def _probe(backend: str, rows: int) -> str | None:
    """The checks of :func:`probe_backend`: the first failure, or None."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, with_bias in PROBE_SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator) if with_bias else None
        unit = 2.0**-24
        gamma = (in_features + 2) * unit / (1 - (in_features + 2) * unit)
        onednn_packed = None
        for m in sorted({1, 3, rows}):
            x = torch.randn(m, in_features, generator=generator)
            if backend == "mkl":
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
            else:
                if onednn_packed is None:
                    onednn_packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
                packed = onednn_packed
            bound = gamma * (x.abs() @ weight.abs().t() + (0 if bias is None else bias.abs()))
            expected = torch.nn.functional.linear(x, weight, bias)
            for shaped in (x, x.unsqueeze(1)):
                if backend == "mkl":
                    got = torch.ops.mkl._mkl_linear(shaped, packed, weight, bias, m)
                else:
                    got = torch.ops.mkldnn._linear_pointwise(shaped, packed, bias, "none", [], "")
                got = got.reshape(expected.shape) if got.numel() == expected.numel() else got
                if got.shape != expected.shape or got.dtype != expected.dtype:
                    return f"probe: output {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)}"
                if not bool(((got - expected).abs() <= bound).all()):
                    gap = (got - expected).abs().max().item()
                    return (
                        f"probe: {gap:.3g} away from F.linear for a {out_features}x{in_features} weight and {m} rows, "
                        "beyond float rounding"
                    )
    return None


def announce(model: Any, reason: str) -> None:
    """Log once per model and reason that ``prepack_linear_weights`` is off and why."""
    say_once(
        "trl_ext prepack_linear_weights off for %s: %s (MKL's plain linear used)",
        type(model).__name__,
        reason,
        key=(id(model), reason),
        log=logger,
    )
