"""Packed ``nn.Linear`` weights for the CPU inference forwards of generation and evaluation (issues 31, 37).

Why. On a CPU, ``torch.nn.functional.linear`` in fp32 goes to MKL's sgemm. A decode step multiplies only a few rows
(one per sequence) by every weight of the model, and MKL runs that small GEMM far below the machine's peak when the
weight is in its plain layout. On an AMD EPYC (AVX-512) the 211 projections of SmolLM2-135M plus its head take
78-100 ms for 16 rows, where oneDNN's inner-product with the weights reordered once into its blocked layout takes
44-47 ms (285 -> 165 ms for 100 rows); on an Intel Xeon (Sapphire Rapids) 83 ms plain, 66 ms oneDNN packed and 50 ms
with MKL's own packed sgemm (237 -> 181 ms for 100 rows; docs/performance.md). Packing costs about one weight copy
(0.15-0.3 s for the whole model), so it pays when the same weights serve many forwards: the decode steps of a
``generate`` call, the rounds of one training step, an evaluation.

What. :class:`PackedLinearWeights`, inside :meth:`PackedLinearWeights.applied`, makes each packable module's
forward run on a packed copy of its weight, with one of two backends (:func:`choose_backend`), both PyTorch's own
ops (the ones inductor uses for CPU linears):

- ``"mkl"`` (Intel CPUs): ``torch.ops.mkl._mkl_reorder_linear_weight`` (``cblas_sgemm_pack`` for one row count) and
  ``torch.ops.mkl._mkl_linear`` (``cblas_sgemm_compute``); a forward of another row count runs the module's own
  forward. MKL's kernel stays MKL's: on the embedded model a rollout's logits were bit-equal to the plain forward's
  (not guaranteed for every shape: for 1-7 rows MKL's plain path is a different kernel, and there outputs differ at
  float rounding).
- ``"onednn"`` (otherwise): ``torch.ops.mkldnn._reorder_linear_weight`` and ``torch.ops.mkldnn._linear_pointwise``,
  any row count. The sums run in oneDNN's order instead of MKL's, so outputs differ at float rounding (~1e-7
  relative), as any change of GEMM kernel does.

When a weight is packed, and for which rows. Lazily, at the module's forward, for the row count generation decodes
with: the first forward of the row count the caller names (``applied(model, rows=...)``: a ``generate`` call's
batch), or else the second forward of one same row count (a decode step's; a prefill's count is seen once). A
``generate`` whose forwards never repeat a row count (one new token, a prefill only) packs nothing. In a block where
the weights stay fixed (:meth:`PackedLinearWeights.fixed_weights`) each module keeps its first packing: the rounds
of one generation batch, the batches of one evaluation.

Never stale. A packed copy lives only as long as the :meth:`~PackedLinearWeights.applied` block that made it, or the
:meth:`~PackedLinearWeights.fixed_weights` block around it; the next block packs the weights as they are then. So no
write between uses -- an optimizer step, ``load_state_dict``, ``w.data.add_``, ``w.data.copy_``, ``w.data = ...``,
peft's ``merge_adapter()`` (writes through ``.data`` change no tensor version and could not be seen) -- can make a
packed forward use old weights. Inside a block the weights must not change; a write that bumps the weight's version
(an in-place op under ``no_grad``) or replaces its storage is still seen there: that module runs its plain forward
until it is packed again.

Exact or off, per call: a packed forward runs only for an fp32 CPU input without autograd (no grad mode, or
neither weight nor input requiring grad), outside CPU autocast, on the very weight tensor that was packed at the same
version; anything else runs the module's own forward. Modules are packed only when their class is exactly
``nn.Linear`` (quantized, LoRA and other subclasses keep their own forward; a LoRA layer's ``base_layer`` is packed),
with a plain 2-D fp32 CPU weight of the declared shape and no forward already replaced on the instance (accelerate's
offloading hooks). Per process and backend, before the backend's first packing, :func:`probe_backend` compares its
ops with ``torch.nn.functional.linear`` on small inputs from a private generator; an exception or a difference beyond
float rounding turns that backend off in one log line (the other backend is used if its probe passes, else no
packing). The whole saving is off, in one log line per model and reason (:func:`packing_blocker`), where PyTorch has
no oneDNN prepacking ops (both backends hold the packed buffer in a oneDNN tensor), where no such module exists, or
where the packed copies would take more than a quarter of the memory available now.
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
    """``"mkl"`` or ``"onednn"``: which packed GEMM :class:`PackedLinearWeights` uses.

    MKL's own packed sgemm (``cblas_sgemm_pack``/``cblas_sgemm_compute`` through ``torch.ops.mkl``) on an Intel CPU
    (it packs for one row count, the one generation decodes with: forwards of other row counts run the plain
    forward); oneDNN's blocked layout otherwise. Measured on the embedded model's 211 projections
    (docs/performance.md): on an Intel Xeon (Sapphire Rapids) 16 rows 83 ms plain, 66 ms oneDNN packed, 50 ms MKL
    packed; on an AMD EPYC 78-100 ms plain, 44-47 ms oneDNN packed (MKL's packed path not measured there, so not
    chosen there).
    """
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
class _Entry:
    """One module's packing state within a block: the weight it is for (identity, data pointer and version), the row
    count seen once and not yet packed for, and the packed copy with its row count and backend."""

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

    Use ``with packed.applied(model, rows=batch): model.generate(...)``; wrap several such blocks in
    ``with packed.fixed_weights():`` where the weights do not change between them, to pack once for all of them.
    See the module docstring for when a weight is packed and when a forward runs packed.
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
        """Keep the copies packed by the :meth:`applied` blocks inside this block until it ends, so each weight is
        packed once for all of them (GRPO: every generation round of a generation batch; evaluation: its batches).

        The caller promises that no weight changes inside the block: a write through ``.data`` (``merge_adapter``)
        here would not be seen. Writes that bump a weight's version or replace its storage still are (that module
        runs its plain forward until packed again). Every copy is dropped when the outermost such block ends."""
        self._fixed += 1
        try:
            yield
        finally:
            self._fixed -= 1
            if not self._fixed:
                self.clear()

    @contextlib.contextmanager
    def applied(self, model: torch.nn.Module, rows: int | None = None) -> Iterator[None]:
        """Run ``model``'s packable ``nn.Linear`` forwards packed for the duration of the block (see the module
        docstring for when a weight is packed and when a call still runs the plain forward). The copies are dropped
        when the block ends, unless a :meth:`fixed_weights` block is open around it.

        Args:
            model: the model whose ``nn.Linear`` modules to patch.
            rows: the rows most forwards of the block multiply (a ``generate`` call's batch: one per sequence of a
                decode step); a module is packed at its first forward of that row count. None: at the second forward
                of one row count.

        Off, with one log line per model and reason, where :func:`packing_blocker` says so; silently for a model
        whose parameters are not on the CPU. The modules' forwards are restored on exit, also on error.
        """
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
        if rows != self._rows and rows != entry.seen:
            entry.seen = rows  # a count seen once (a prefill's): packed only if it comes again
            return None
        backend = self._working_backend(rows)
        if backend is None:
            return None
        try:
            with torch.no_grad():
                entry.packed = _reorder(backend, weight.detach(), rows)
        except RuntimeError:  # the backend refuses this weight: the module keeps its own forward
            entry.refused = True
            return None
        entry.rows, entry.backend = rows, backend
        return entry.packed, backend

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
        other_reason = probe_backend(other, rows) if other == "onednn" or _mkl_ops_available() else "no MKL ops"
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
"""(out_features, in_features, bias) of the weights :func:`probe_backend` packs: odd and even widths, with and without
bias."""

_probe_results: dict[str, str | None] = {}  # backend -> None (its ops compute F.linear) or why not


def probe_backend(backend: str, rows: int) -> str | None:
    """None when ``backend``'s packing and packed-GEMM ops compute ``torch.nn.functional.linear`` on this PyTorch,
    else why not (the op's exception, or the largest difference). Decided once per process and backend.

    For each of :data:`PROBE_SHAPES` a weight (and bias) from a private generator is packed through the same ops as
    the forwards use and applied to inputs of 1, 3 and ``rows`` rows (as (m, in) and as a decode step's (m, 1, in));
    each output must equal ``F.linear``'s within the worst-case rounding of a float32 dot product in any summation
    order: ``|packed - plain| <= gamma(in + 2) * (|x| @ |W|^T + |b|)``, ``gamma(n) = n u / (1 - n u)``, u = 2^-24
    (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1). No global generator is used.
    """
    if backend in _probe_results:
        return _probe_results[backend]
    generator = torch.Generator().manual_seed(0)
    reason = None
    try:
        for out_features, in_features, with_bias in PROBE_SHAPES:
            weight = torch.randn(out_features, in_features, generator=generator)
            bias = torch.randn(out_features, generator=generator) if with_bias else None
            unit = 2.0**-24
            gamma = (in_features + 2) * unit / (1 - (in_features + 2) * unit)
            packed_for = {}
            for m in sorted({1, 3, rows}):
                x = torch.randn(m, in_features, generator=generator)
                if backend == "mkl":
                    packed = packed_for[m] = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
                else:
                    packed = packed_for.setdefault(0, torch.ops.mkldnn._reorder_linear_weight(weight, rows))
                bound = gamma * (x.abs() @ weight.abs().t() + (0 if bias is None else bias.abs()))
                expected = torch.nn.functional.linear(x, weight, bias)
                for shaped in (x, x.unsqueeze(1)):
                    if backend == "mkl":
                        got = torch.ops.mkl._mkl_linear(shaped, packed, weight, bias, m)
                    else:
                        got = torch.ops.mkldnn._linear_pointwise(shaped, packed, bias, "none", [], "")
                    got = got.reshape(expected.shape) if got.numel() == expected.numel() else got
                    if got.shape != expected.shape or got.dtype != expected.dtype:
                        reason = f"probe: output {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)}"
                    elif not bool(((got - expected).abs() <= bound).all()):
                        gap = (got - expected).abs().max().item()
                        reason = (
                            f"probe: {gap:.3g} away from F.linear for a {out_features}x{in_features} weight and "
                            f"{m} rows, beyond float rounding"
                        )
                    if reason:
                        break
                if reason:
                    break
            if reason:
                break
    except Exception as err:  # noqa: BLE001 -- any failure of a private op means: not this backend
        reason = f"probe: {type(err).__name__}: {str(err)[:120]}"
    _probe_results[backend] = reason
    return reason


def announce(model: Any, reason: str) -> None:
    """Log once per model and reason that ``prepack_linear_weights`` is off and why."""
    say_once(
        "trl_ext prepack_linear_weights off for %s: %s (MKL's plain linear used)",
        type(model).__name__,
        reason,
        key=(id(model), reason),
        log=logger,
    )
