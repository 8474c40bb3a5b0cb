"""How close each phase of a run comes to what the machine allows: a roofline report.

For each phase of a run (held-out evaluation, generation prefill and decode, the log-prob forward, other training
forwards, backward, optimizer) the report puts the seconds measured beside the floor this machine allows for that
phase's work: ``max(FLOPs / matmul peak, bytes / memory bandwidth)``, with the peak and the bandwidth **measured in
the run** (:func:`measure_peaks`, about a second), never taken from a data sheet. ``ratio = seconds / floor`` says how
many times slower than the floor the phase ran (1 = at the roofline); on CUDA the same numbers read as MFU
(``flops_utilization``: achieved FLOP/s over the measured matmul peak) and bandwidth use.

The work is counted, not estimated from wall time: :class:`WorkCounter` hooks the model's forward and, for every
call, counts from its inputs (Williams, Waterman & Patterson 2009, "Roofline"; Kaplan et al. 2020 for 2 x parameters
FLOPs per token):

* matmul FLOPs ``2 x P_body x T + 2 x P_head x T_head``: ``P_body`` the weights of every ``nn.Linear`` but the output
  head, ``T`` the tokens the call processes (rows x new tokens), ``P_head``/``T_head`` the output head and the tokens
  whose logits are computed (``logits_to_keep``);
* attention FLOPs ``4 x layers x heads x head_dim`` per (query, key) pair the mask allows (exact for a 4D mask,
  causal ``new x (past + (new + 1) / 2)`` per row otherwise, padding included);
* bytes: every weight read once per call, plus the keys and values of every layer read once per row;
* a forward run with gradients implies its backward: 2 x its FLOPs (the input and the weight gradients), and its
  weights read once more plus the weight gradients read and written;
* an optimizer step (AdamW with gradient clipping): 9 x the trainable weights' bytes (read weight, gradient and two
  moments, write weight and moments; read the gradients for the norm and again to scale them) and 14 FLOPs a weight.

These are floors, not predictions: activations, softmax, norms and the sampling loop are not counted, so a ratio
above 1 is time spent on them, on kernel and Python overhead, or on matmuls below peak.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

PHASES = (
    "evaluation",
    "generation_prefill",
    "generation_decode",
    "logprob_forward",
    "forward",
    "backward",
    "optimizer",
)
"""The report's rows, in order: where a forward is counted depends on the timer's phase when it runs
(:meth:`WorkCounter.bucket`)."""

OPTIMIZER_BYTES_PER_WEIGHT_BYTE = 9
OPTIMIZER_FLOPS_PER_WEIGHT = 14


# ------------------------------------------------------------------------------------------------ the machine
@dataclass
class MachinePeaks:
    """What this machine did in a short measurement: the best matmul FLOP/s and copy bandwidth seen.

    Attributes:
        device: ``"cpu"`` or ``"cuda:0"``...
        dtype: the matmul dtype measured (the model's compute dtype).
        matmul_flops_per_s: best ``2 n^3 / seconds`` of an ``n x n`` matmul.
        bandwidth_bytes_per_s: best ``2 x bytes / seconds`` of a large tensor copy (read + write).
        threads: ``torch.get_num_threads()`` during the measurement (CPU).
        seconds: how long the measurement took.
    """

    device: str
    dtype: str
    matmul_flops_per_s: float
    bandwidth_bytes_per_s: float
    threads: int
    seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(work: float, run: Callable[[], Any], device: torch.device, budget_s: float) -> float:
    """``work`` / the fastest of repeated ``run()`` calls within ``budget_s`` (one warm-up call first)."""
    run()
    _sync(device)
    best, spent = float("inf"), 0.0
    while spent < budget_s or best == float("inf"):
        start = time.perf_counter()
        run()
        _sync(device)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return work / best


def _matmul_rate(n: int, device: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    # operands from a private generator on the device: the run's own random numbers stay untouched (trl_ext.rng)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    return _best_rate(2.0 * n**3, lambda: torch.mm(a, b), device, budget_s)


def _copy_rate(size: int, device: torch.device, budget_s: float) -> float:
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_rate(2.0 * src.numel() * 4, lambda: dst.copy_(src), device, budget_s)


def measure_peaks(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    budget_s: float = 1.0,
    matmul_size: int | None = None,
    copy_bytes: int | None = None,
) -> MachinePeaks:
    """Measure the matmul peak and the memory bandwidth of ``device``, now, in about ``budget_s`` seconds.

    Args:
        device: where to measure (the model's device).
        dtype: the matmul dtype (the model's compute dtype: fp32, bf16...).
        budget_s: seconds for each of the two measurements (best of the repetitions is kept).
        matmul_size: n of the n x n matmul (default 1024 on CPU, 8192 on CUDA: large enough to reach the peak).
        copy_bytes: size of the copied tensor (default 256 MiB on CPU, 1 GiB on CUDA: beyond every cache).

    Returns:
        a :class:`MachinePeaks`.
    """
    device = torch.device(device)
    start = time.perf_counter()
    n = matmul_size or (8192 if device.type == "cuda" else 1024)
    flops = _matmul_rate(n, device, dtype, budget_s)
    size = copy_bytes or (2**30 if device.type == "cuda" else 2**28)
    bandwidth = _copy_rate(size, device, budget_s)
    return MachinePeaks(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        matmul_flops_per_s=flops,
        bandwidth_bytes_per_s=bandwidth,
        threads=torch.get_num_threads(),
        seconds=time.perf_counter() - start,
    )


# ------------------------------------------------------------------------------------------------- the work
@dataclass
class Work:
    """FLOPs and bytes of one phase's work, and the seconds its forwards took (hook-timed)."""

    flops: float = 0.0
    bytes: float = 0.0
    forward_seconds: float = 0.0
    calls: int = 0
    tokens: int = 0

    def add(self, other: Work) -> None:
        self.flops += other.flops
        self.bytes += other.bytes
        self.forward_seconds += other.forward_seconds
        self.calls += other.calls
        self.tokens += other.tokens


@dataclass
class ModelShape:
    """What the counts need to know of a causal LM: its weights by role, and its attention's size.

    Attributes:
        body_weights: elements of every ``nn.Linear`` weight but the output head's.
        head_weights: elements of the output head (``get_output_embeddings()``; tied or not, it is a matmul).
        trainable_weights: elements of the parameters with ``requires_grad`` (what backward and the optimizer touch).
        element_bytes: bytes per weight element (the weights' dtype).
        layers, heads, head_dim, kv_heads: the attention's shape, from the config.
    """

    body_weights: int
    head_weights: int
    trainable_weights: int
    element_bytes: int
    layers: int
    heads: int
    head_dim: int
    kv_heads: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """The shape of ``model`` (a PEFT or DDP wrapper is looked through)."""
        base = model
        while hasattr(base, "module") and isinstance(base.module, torch.nn.Module):
            base = base.module  # DDP / accelerate wrappers
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        linears = [m for m in base.modules() if isinstance(m, torch.nn.Linear)]
        body = sum(m.weight.numel() for m in linears if id(m.weight) not in head_ids)
        head_weights = head.weight.numel() if head is not None and hasattr(head, "weight") else 0
        config = getattr(base, "config", None)
        text = getattr(config, "text_config", None) or config
        heads = getattr(text, "num_attention_heads", 0) or 0
        hidden = getattr(text, "hidden_size", 0) or 0
        head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
        parameter = next(base.parameters())
        return cls(
            body_weights=body,
            head_weights=head_weights,
            trainable_weights=sum(p.numel() for p in base.parameters() if p.requires_grad),
            element_bytes=parameter.element_size(),
            layers=getattr(text, "num_hidden_layers", 0) or 0,
            heads=heads,
            head_dim=head_dim,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        )


def forward_work(
    shape: ModelShape, rows: int, new: int, past: int, head_tokens: int, attention_pairs: int | None = None
) -> Work:
    """The work of one forward (see the module docstring for the counts).

    Args:
        shape: the model's :class:`ModelShape`.
        rows: batch rows.
        new: new tokens per row (the input's length).
        past: tokens already in the key/value cache per row.
        head_tokens: tokens whose logits the head computes (all rows).
        attention_pairs: (query, key) pairs the mask allows, all rows; None = causal, ``rows x new x (past +
            (new + 1) / 2)``.

    Returns:
        a :class:`Work` with ``flops``, ``bytes``, ``calls`` 1 and ``tokens`` ``rows x new``.
    """
    tokens = rows * new
    pairs = rows * new * (past + (new + 1) / 2) if attention_pairs is None else attention_pairs
    flops = 2.0 * shape.body_weights * tokens + 2.0 * shape.head_weights * head_tokens
    flops += 4.0 * shape.layers * shape.heads * shape.head_dim * pairs
    weight_bytes = (shape.body_weights + shape.head_weights) * shape.element_bytes
    kv_bytes = 2.0 * shape.layers * shape.kv_heads * shape.head_dim * rows * (past + new) * shape.element_bytes
    return Work(flops=flops, bytes=weight_bytes + kv_bytes, calls=1, tokens=tokens)


def backward_work(shape: ModelShape, forward: Work) -> Work:
    """The backward of a forward with gradients: 2 x its FLOPs; its weights read again, the trainable weights'
    gradients read and written."""
    weight_bytes = (shape.body_weights + shape.head_weights) * shape.element_bytes
    grad_bytes = 2.0 * shape.trainable_weights * shape.element_bytes
    return Work(flops=2.0 * forward.flops, bytes=weight_bytes + grad_bytes, calls=1, tokens=forward.tokens)


def optimizer_work(shape: ModelShape, steps: int) -> Work:
    """``steps`` AdamW steps with gradient clipping over the trainable weights (see the module docstring)."""
    per_step = shape.trainable_weights
    return Work(
        flops=float(OPTIMIZER_FLOPS_PER_WEIGHT * per_step * steps),
        bytes=float(OPTIMIZER_BYTES_PER_WEIGHT_BYTE * per_step * shape.element_bytes * steps),
        calls=steps,
    )


def _past_length(kwargs: Mapping[str, Any]) -> int:
    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5.2x names it `cache`
    if cache is None:
        return 0
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001 -- a legacy or recurrent cache: count no past
        return 0


def _attention_pairs(mask: Any) -> int | None:
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        allowed = mask if mask.dtype == torch.bool else mask == 0
        return int(allowed.sum())
    return None


TIMED_BY_HOOK = ("generation_prefill", "forward")
"""Buckets whose seconds come from timing the forward itself (the rest come from the run's phase timer): on CUDA only
these forwards synchronize the device, so decoding and training keep their asynchrony."""


class WorkCounter:
    """Counts the work of every forward of ``model`` into the bucket of the phase it runs in.

    Args:
        model: the causal LM (hooks go on this module; pass the trainer's model or the one evaluated).
        current_phase: returns the innermost running phase of the run's timer (``PhaseTimer.current``).

    Attributes:
        work: bucket name (:data:`PHASES`) -> :class:`Work`.
    """

    def __init__(self, model: Any, current_phase: Callable[[], str | None]):
        self.shape = ModelShape.of(model)
        self.current_phase = current_phase
        self.work: dict[str, Work] = {}
        self._started: list[tuple[float, Work, str, bool]] = []
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._cuda = self.device.type == "cuda"
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True),
        ]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()

    def bucket(self, new_tokens: int) -> str:
        """Where a forward of ``new_tokens`` tokens per row counts: by the running phase (``evaluation``,
        ``generation`` -- ``generation_prefill`` for a forward of more than one token per row, ``generation_decode``
        for one --, ``logprob_forward``), ``forward`` otherwise (e.g. SFT's training forward)."""
        phase = self.current_phase()
        if phase == "generation":
            return "generation_prefill" if new_tokens > 1 else "generation_decode"
        if phase in ("evaluation", "logprob_forward"):
            return phase
        return "forward"

    def _before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return
        rows, new = int(ids.shape[0]), int(ids.shape[1])
        keep = kwargs.get("logits_to_keep", 0)
        head_rows = (
            new
            if isinstance(keep, int) and (keep == 0 or keep > new)
            else (keep if isinstance(keep, int) else int(torch.as_tensor(keep).numel()))
        )
        work = forward_work(
            self.shape,
            rows,
            new,
            _past_length(kwargs),
            rows * head_rows,
            _attention_pairs(kwargs.get("attention_mask")),
        )
        bucket = self.bucket(new)
        if self._cuda and bucket in TIMED_BY_HOOK:  # only these forwards' own seconds are read: no sync per token
            torch.cuda.synchronize()
        grad = torch.is_grad_enabled() and module.training
        self._started.append((time.perf_counter(), work, bucket, grad))

    def _after(self, module, args, kwargs, output):
        if not self._started:
            return
        start, work, bucket, grad = self._started.pop()
        if self._cuda and bucket in TIMED_BY_HOOK:
            torch.cuda.synchronize()
        work.forward_seconds = time.perf_counter() - start
        self.work.setdefault(bucket, Work()).add(work)
        if grad:
            self.work.setdefault("backward", Work()).add(backward_work(self.shape, work))


# ------------------------------------------------------------------------------------------------- the report
@dataclass
class PhaseRoofline:
    """One row of the report."""

    seconds: float
    flops: float
    bytes: float
    floor_seconds: float
    ratio: float | None
    bound: str
    flops_utilization: float | None
    bandwidth_utilization: float | None
    calls: int = 0
    tokens: int = 0


def phase_roofline(seconds: float, work: Work, peaks: MachinePeaks) -> PhaseRoofline:
    """``floor = max(flops / peak, bytes / bandwidth)``, ``ratio = seconds / floor``, and what was achieved as a
    fraction of each peak (MFU on a GPU).

    Args:
        seconds: the phase's measured seconds.
        work: its counted work.
        peaks: the machine's measured peaks.
    """
    compute = work.flops / peaks.matmul_flops_per_s
    memory = work.bytes / peaks.bandwidth_bytes_per_s
    floor = max(compute, memory)
    return PhaseRoofline(
        seconds=seconds,
        flops=work.flops,
        bytes=work.bytes,
        floor_seconds=floor,
        ratio=seconds / floor if floor > 0 else None,
        bound="compute" if compute >= memory else "memory",
        flops_utilization=work.flops / seconds / peaks.matmul_flops_per_s if seconds > 0 else None,
        bandwidth_utilization=work.bytes / seconds / peaks.bandwidth_bytes_per_s if seconds > 0 else None,
        calls=work.calls,
        tokens=work.tokens,
    )


def roofline_report(
    phase_seconds: Mapping[str, float],
    work: Mapping[str, Work],
    peaks: MachinePeaks,
    optimizer_steps: int = 0,
    shape: ModelShape | None = None,
) -> dict[str, Any]:
    """The report: the machine's peaks and one :class:`PhaseRoofline` per phase that ran.

    Seconds per phase: ``evaluation``, ``logprob_forward``, ``backward``, ``optimizer`` from the run's timer
    (``phase_seconds``); ``generation_prefill`` the hook-timed prefill forwards of ``generation``,
    ``generation_decode`` the rest of ``generation`` (the decode forwards and the sampling loop around them);
    ``forward`` the hook-timed forwards outside those phases (SFT, DPO and reward models' training forwards).

    Args:
        phase_seconds: ``PhaseTimer.seconds``.
        work: ``WorkCounter.work``.
        peaks: :func:`measure_peaks`'s result.
        optimizer_steps: optimizer steps taken (their work is not seen by the forward hooks).
        shape: the model's shape, for the optimizer's work.

    Returns:
        ``{"machine": {...}, "phases": {name: {...}}}`` (JSON-ready).
    """
    work = dict(work)
    if optimizer_steps and shape is not None:
        work["optimizer"] = optimizer_work(shape, optimizer_steps)
    prefill = work.get("generation_prefill", Work()).forward_seconds
    seconds = {
        "evaluation": phase_seconds.get("evaluation", 0.0),
        "generation_prefill": prefill,
        "generation_decode": max(0.0, phase_seconds.get("generation", 0.0) - prefill),
        "logprob_forward": phase_seconds.get("logprob_forward", 0.0),
        "forward": work.get("forward", Work()).forward_seconds,
        "backward": phase_seconds.get("backward", 0.0),
        "optimizer": phase_seconds.get("optimizer", 0.0),
    }
    phases = {
        name: asdict(phase_roofline(seconds[name], work[name], peaks))
        for name in PHASES
        if name in work and (work[name].flops > 0 or work[name].bytes > 0)
    }
    return {"machine": asdict(peaks), "phases": phases}


def format_roofline(report: Mapping[str, Any]) -> str:
    """The report as a console table: per phase seconds, floor, ratio, bound, FLOP/s and bandwidth achieved."""
    machine = report["machine"]
    lines = [
        f"roofline on {machine['device']} ({machine['dtype']}, {machine['threads']} threads): matmul peak "
        f"{machine['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, bandwidth {machine['bandwidth_bytes_per_s'] / 1e9:.1f} "
        "GB/s (measured in this run)",
        f"{'phase':<20}{'seconds':>9}{'floor s':>9}{'ratio':>8}  {'bound':<8}{'FLOP/s %':>9}{'bytes/s %':>10}",
    ]
    for name, row in report["phases"].items():
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.1f}x"
        fu = "-" if row["flops_utilization"] is None else f"{row['flops_utilization']:.1%}"
        bu = "-" if row["bandwidth_utilization"] is None else f"{row['bandwidth_utilization']:.1%}"
        lines.append(
            f"{name:<20}{row['seconds']:>9.1f}{row['floor_seconds']:>9.2f}{ratio:>8}  {row['bound']:<8}{fu:>9}{bu:>10}"
        )
    return "\n".join(lines)


@dataclass
class RooflineRecorder:
    """Counts a run's work (:class:`WorkCounter` on each model it is given) and reports it against the peaks measured
    when :meth:`report` is called."""

    current_phase: Callable[[], str | None]
    counters: list[WorkCounter] = field(default_factory=list)

    watched: set[int] = field(default_factory=set)

    def watch(self, model: Any) -> None:
        """Count the forwards of ``model`` (once per model; anything but a ``torch.nn.Module``, e.g. a model name
        a recipe hands its trainer to load, is left alone)."""
        if not isinstance(model, torch.nn.Module) or id(model) in self.watched:
            return
        self.watched.add(id(model))
        self.counters.append(WorkCounter(model, self.current_phase))

    def report(self, phase_seconds: Mapping[str, float], optimizer_steps: int = 0) -> dict[str, Any] | None:
        """The roofline report of everything counted so far (None when no model was watched)."""
        if not self.counters:
            return None
        work: dict[str, Work] = {}
        for counter in self.counters:
            for name, w in counter.work.items():
                work.setdefault(name, Work()).add(w)
        first = self.counters[0]
        peaks = measure_peaks(first.device, first.dtype)  # in the weights' dtype, on their device
        return roofline_report(phase_seconds, work, peaks, optimizer_steps, first.shape)
