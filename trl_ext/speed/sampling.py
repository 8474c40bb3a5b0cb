"""``torch.multinomial`` of one sample per row, drawn with the same random numbers three times faster on the CPU.

PyTorch's CPU one-sample path returns ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn by a serial float32
``exponential_`` (16 x 49,152 draws: 16-19 ms). :func:`multinomial` draws the same ``q = float32(-log1p(-u))`` from
float64 ``uniform_`` with ``probs``' strides: bit-equal variates, the same tokens, the generator left in the same state
(5-6 ms). :func:`probe` checks this on private generators before first use (a mismatch turns it off in one log line).
:func:`same_draws_multinomial` replaces ``torch.multinomial`` for a block; any call it cannot serve identically goes to
PyTorch's. Within a block the draws reuse one :class:`Workspace` instead of four fresh temporaries of a decode step's
size (16 x 49,152: 19 MB): a rollout step's draws 12.0 -> 8.5 ms inside the main job's generate call (medians).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from trl_ext.logs import say_once

logger = logging.getLogger("trl_ext")

_probe_result: str | None | bool = False  # False: not probed yet; None: identical; str: why not


def _valid(probs: torch.Tensor) -> bool:
    """Whether ``torch.multinomial`` would accept ``probs`` (B, V) as :func:`multinomial` serves it: no NaN, no
    negative entry (``min >= 0`` is False for both), every row's sum finite and positive (False for an infinite entry).
    Two passes; a finite row whose sum overflows float32 is refused too and goes to PyTorch, which draws identically."""
    if not bool(probs.min() >= 0):
        return False
    sums = probs.sum(-1)
    return bool(torch.isfinite(sums).all()) and bool((sums > 0).all())


class Workspace:
    """Buffers one block's draws reuse: for each ``(shape, strides)`` of the probabilities most recently drawn from,
    a float64 tensor laid out as ``at::empty_like`` lays out PyTorch's own variates (the order the generator fills)
    and a float32 one for the variates and ``probs / q``. A shape or layout other than the last one replaces them.
    Holds ``12 x B x V`` bytes while it lives (16 x 49,152: 9.4 MB); not shared across threads."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 uniforms, float32 variates) shaped and laid out for probabilities ``like``."""
        key = (tuple(like.shape), like.stride())
        if key != self._key or self._buffers is None:
            self._buffers = (torch.empty_like(like, dtype=torch.float64), torch.empty_like(like, dtype=torch.float32))
            self._key = key
        return self._buffers


def _exponential_variates(
    like: torch.Tensor, generator: torch.Generator | None = None, workspace: Workspace | None = None
) -> torch.Tensor:
    """float32 Exp(1) variates of ``like``'s shape and memory layout, drawn from ``generator`` (None: the default
    CPU generator): ``float32(-log1p(-u))`` with ``u`` float64 uniform on [0, 1), allocated as ``at::empty_like``
    allocates PyTorch's own variates (the same strides, so the generator fills the same elements in the same
    order, also for a transposed, sliced or expanded ``like``). What float32 ``torch.empty_like(like).exponential_()``
    draws (:func:`probe` checks it), vectorised. With ``workspace`` the result is its float32 buffer (overwritten by
    the next draw); without, fresh tensors."""
    if workspace is None:
        u, variates = torch.empty_like(like, dtype=torch.float64), None
    else:
        u, variates = workspace.buffers(like)
    u.uniform_(generator=generator)
    torch.log1p(u.neg_(), out=u)
    u.neg_()
    return u.to(torch.float32) if variates is None else variates.copy_(u)


def multinomial(
    probs: torch.Tensor, generator: torch.Generator | None = None, workspace: Workspace | None = None
) -> torch.Tensor:
    """One index per row of ``probs`` (B, V), float32 on the CPU, any strides, drawn from ``generator`` (None: the
    default CPU generator) exactly as ``torch.multinomial(probs, 1, generator=generator)`` draws it:
    ``argmax(probs / q)`` with ``q`` from :func:`_exponential_variates` (in ``workspace``'s buffers when given,
    default None: fresh ones). Returns (B, 1) int64. No validation: see :func:`same_draws_multinomial`."""
    q = _exponential_variates(probs, generator, workspace)
    return torch.argmax(torch.div(probs, q, out=q), dim=-1, keepdim=True)


def _probe_cases() -> Iterator[torch.Tensor]:
    """Probability tensors for :func:`probe`, from a private generator: contiguous, transposed, strided-slice,
    expanded and a last-position slice of a 3-D tensor (as ``logits[:, -1, :]``)."""
    g = torch.Generator().manual_seed(20250)

    def probs(*shape: int, dim: int = -1) -> torch.Tensor:
        return torch.softmax(torch.randn(shape, generator=g) * 3, dim=dim)

    yield probs(4, 1000)
    yield probs(4, 1000)  # the same shape again: the workspace's buffers reused
    yield probs(2, 49152)
    yield probs(7, 3)
    yield probs(300, 5, dim=0).t()
    yield probs(9, 400)[::2, 1::3]
    yield probs(1, 600).expand(5, 600)
    yield probs(3, 4, 700)[:, -1, :]


def probe() -> str | None:
    """None when :func:`multinomial` gives PyTorch's draws on this PyTorch, else why not. Decided once per process.

    On private generators, over contiguous and non-contiguous probabilities (:func:`_probe_cases`): the same
    variates as float32 ``exponential_``, the same indices as ``torch.multinomial(probs, 1, generator=g)`` and the
    generator left in the same state. Then the property the replacement relies on, for the default CPU generator
    (which ``torch.multinomial`` without a generator uses): its state is set to a private one, PyTorch's draw and the
    replica's are compared from it, and its own state is put back exactly. No seeding function is called and no
    other generator -- CUDA, MPS, XPU, Python's, NumPy's -- is touched.
    """
    global _probe_result
    if _probe_result is not False:
        return _probe_result
    reason = None
    workspace = Workspace()  # as a block draws: buffers reused across shapes and layouts
    for seed, probs in enumerate(_probe_cases()):
        expected_gen, ours_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        expected = torch.multinomial(probs, 1, generator=expected_gen)
        ours = multinomial(probs, ours_gen, workspace)
        variates = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(seed))
        same_variates = torch.equal(_exponential_variates(probs, torch.Generator().manual_seed(seed)), variates)
        if not (
            same_variates
            and torch.equal(ours, expected)
            and torch.equal(ours_gen.get_state(), expected_gen.get_state())
        ):
            reason = (
                "this PyTorch's multinomial draws other random numbers than the vectorised replica "
                f"(probe: {tuple(probs.shape)} probabilities, strides {probs.stride()})"
            )
            break
    if reason is None:
        reason = _default_generator_reason()
    _probe_result = reason
    return reason


def _default_generator_reason() -> str | None:
    """Why the replica without a generator draws otherwise than ``torch.multinomial(probs, 1)``, or None; the
    default CPU generator's state is restored exactly afterwards."""
    probs = torch.softmax(torch.randn(3, 500, generator=torch.Generator().manual_seed(7)) * 3, dim=-1)
    start = torch.Generator().manual_seed(11).get_state()
    saved = torch.default_generator.get_state()
    try:
        torch.default_generator.set_state(start)
        expected, expected_state = torch.multinomial(probs, 1), torch.default_generator.get_state()
        torch.default_generator.set_state(start)
        ours, ours_state = multinomial(probs, None, Workspace()), torch.default_generator.get_state()
    finally:
        torch.default_generator.set_state(saved)
    if torch.equal(ours, expected) and torch.equal(ours_state, expected_state):
        return None
    return "this PyTorch's multinomial draws otherwise from its default generator than the vectorised replica"


def _serves(probs: torch.Tensor, num_samples: int, generator) -> bool:
    # one sample: PyTorch draws the same way with or without replacement
    return (
        num_samples == 1
        and generator is None
        and probs.dim() == 2
        and probs.dtype == torch.float32
        and probs.device.type == "cpu"
        and probs.numel() > 0
    )


@contextlib.contextmanager
def same_draws_multinomial() -> Iterator[None]:
    """Within the block, ``torch.multinomial(probs, 1)`` of a 2-D float32 CPU tensor runs :func:`multinomial` (the
    same tokens and random numbers, see the module docstring); every other call is PyTorch's. Off, in one log line,
    where :func:`probe` finds a difference. Not reentrant across threads: the replacement is module-global while the
    block runs, and answers identically for every caller."""
    reason = probe()
    if reason is not None:
        say_once("trl_ext vectorised sampling off: %s (torch.multinomial used)", reason, key="sampling off", log=logger)
        yield
        return
    original = torch.multinomial
    if getattr(original, "_trl_ext_same_draws", False):  # already inside a block
        yield
        return

    workspace = Workspace()

    def replaced(input, num_samples, replacement=False, *, generator=None, out=None):
        if out is None and _serves(input, num_samples, generator) and _valid(input):
            return multinomial(input, None, workspace)
        kwargs = {"generator": generator} if out is None else {"generator": generator, "out": out}
        return original(input, num_samples, replacement, **kwargs)

    replaced._trl_ext_same_draws = True
    torch.multinomial = replaced
    try:
        yield
    finally:
        torch.multinomial = original
