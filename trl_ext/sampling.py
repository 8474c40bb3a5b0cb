"""``torch.multinomial`` of one sample per row, drawn with the same random numbers three times faster on the CPU.

Why. transformers' sampling loop draws each token with ``torch.multinomial(probs, num_samples=1)``. On the CPU, for
one sample, PyTorch draws an exponential variate per entry, ``q ~ Exp(1)`` of the shape of ``probs``, and returns
``argmax(probs / q)`` per row (the Gumbel-max trick in exponential form; ``aten/src/ATen/native/Distributions.cpp``,
the ``n_sample == 1`` fast path). Its float32 ``exponential_`` is a serial loop, one generator call and one ``log``
per entry: 16 rows of a 49,152-token vocabulary take 16-19 ms, a seventh of a decode step of the main job.

What. :func:`multinomial` draws the same variates vectorised: ``q = float32(-log1p(-u))`` with ``u`` from float64
``uniform_`` on the same generator, which is, bit for bit, what float32 ``exponential_`` returns, and leaves the
generator in the same state (checked by :func:`probe` on this PyTorch before first use; a mismatch turns the
replacement off in one log line). Then ``argmax(probs / q)`` as PyTorch does it: the same tokens, and every later
random number the same. 5-6 ms for the same 16 x 49,152 draws.

Scope. :func:`same_draws_multinomial` replaces ``torch.multinomial`` for the duration of a block (a ``generate``
call); a call it cannot serve identically -- not one sample, with replacement over several samples, another generator,
not 2-D, not float32, not on the CPU, or probabilities that are not finite, non-negative and of positive sum (PyTorch's
errors) -- goes to PyTorch's own ``torch.multinomial``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger("trl_ext")

_probe_result: str | None | bool = False  # False: not probed yet; None: identical; str: why not


def _valid(probs: torch.Tensor) -> bool:
    return bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()) and bool((probs.sum(-1) > 0).all())


def _exponential_variates(shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 Exp(1) variates from the default generator, ``float32(-log1p(-u))`` with ``u`` float64 uniform on
    [0, 1): what float32 ``torch.empty(shape).exponential_()`` draws (:func:`probe` checks it), vectorised."""
    u = torch.empty(shape, dtype=torch.float64, device=device).uniform_()
    return torch.log1p(u.neg_()).neg_().to(torch.float32)


def multinomial(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` (B, V), float32 on the CPU, drawn from the default CPU generator exactly as
    ``torch.multinomial(probs, 1)`` draws it: ``argmax(probs / q)`` with ``q`` from :func:`_exponential_variates`.
    Returns (B, 1) int64. No validation: see :func:`same_draws_multinomial`."""
    q = _exponential_variates(probs.shape, probs.device)
    return torch.argmax(probs / q, dim=-1, keepdim=True)


def probe() -> str | None:
    """None when :func:`multinomial` gives PyTorch's draws on this PyTorch (the same indices and variates, the
    generator left in the same state, over a few shapes), else why not. Decided once per process; the default CPU
    generator's state is restored afterwards."""
    global _probe_result
    if _probe_result is not False:
        return _probe_result
    state = torch.get_rng_state()
    reason = None
    try:
        for seed, shape in ((0, (4, 1000)), (1, (2, 49152)), (2, (7, 3))):
            probs = torch.softmax(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3, dim=-1)
            torch.manual_seed(seed)
            expected, expected_state = torch.multinomial(probs, 1), torch.get_rng_state()
            torch.manual_seed(seed)
            q = torch.empty(shape).exponential_()
            torch.manual_seed(seed)
            same_variates = torch.equal(_exponential_variates(shape), q)
            torch.manual_seed(seed)
            ours = multinomial(probs)
            same_state = torch.equal(torch.get_rng_state(), expected_state)
            if not (same_variates and same_state and torch.equal(ours, expected)):
                reason = "this PyTorch's multinomial draws other random numbers than the vectorised replica"
                break
    finally:
        torch.set_rng_state(state)
    _probe_result = reason
    return reason


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
        if not getattr(same_draws_multinomial, "_announced", False):
            same_draws_multinomial._announced = True
            logger.warning("trl_ext vectorised sampling off: %s (torch.multinomial used)", reason)
        yield
        return
    original = torch.multinomial
    if getattr(original, "_trl_ext_same_draws", False):  # already inside a block
        yield
        return

    def replaced(input, num_samples, replacement=False, *, generator=None, out=None):
        if out is None and _serves(input, num_samples, generator) and _valid(input):
            return multinomial(input)
        kwargs = {"generator": generator} if out is None else {"generator": generator, "out": out}
        return original(input, num_samples, replacement, **kwargs)

    replaced._trl_ext_same_draws = True
    torch.multinomial = replaced
    try:
        yield
    finally:
        torch.multinomial = original
