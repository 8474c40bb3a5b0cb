"""The random-number generators a user owns stay as the user left them (issue 37; pytorch/pytorch#96309).

Library code draws from private ``torch.Generator``\\ s (or ``random.Random``) and never seeds (``torch.manual_seed``
also seeds every GPU generator, so restoring only the CPU state would not undo it). A computation that draws from the
global generators by itself (a dropout check, a model built from a config) runs inside :func:`preserved_rng`, which
restores exactly every generator it can reach. Recipes seed with the user's own ``--seed`` by design.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def model_devices(model: Any) -> list[torch.device]:
    """The distinct devices ``model`` computes on, in order of first appearance: those of its parameters and buffers,
    and the execution devices of accelerate's hooks (offloaded weights wait on ``meta`` or the CPU and are moved
    there for each forward). None for an object without them."""
    devices: list[torch.device] = []
    for source in ("parameters", "buffers"):
        try:
            tensors = getattr(model, source)()
        except (AttributeError, TypeError):
            continue
        for tensor in tensors:
            if tensor.device not in devices:
                devices.append(tensor.device)
    modules = model.modules() if hasattr(model, "modules") else ()
    for module in modules:
        execution = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if execution is not None and torch.device(execution) not in devices:
            devices.append(torch.device(execution))
    return devices


def unpreservable(devices: Iterable[torch.device | str]) -> torch.device | None:
    """The first of ``devices`` whose generator :func:`preserved_rng` cannot save (no torch module with
    ``get_rng_state``/``set_rng_state`` for its type), or None."""
    for device in devices:
        device = torch.device(device)
        if device.type not in ("cpu", "meta") and _generator_module(device) is None:
            return device
    return None


def _generator_module(device: torch.device) -> Any:
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:
        return None
    return module if hasattr(module, "get_rng_state") and hasattr(module, "set_rng_state") else None


@contextlib.contextmanager
def preserved_rng(devices: Iterable[torch.device | str] = ()) -> Iterator[None]:
    """Run the block, then put back (also on error) the state of: torch's default CPU generator, the default
    generator of each device in ``devices`` (any accelerator type torch has a module for -- ``cuda``, ``xpu``,
    ``mps``, ...; each device its own), Python's ``random`` and NumPy's global RNG.

    Nothing is seeded; no other device is touched (reading a CUDA device's state initialises it, so a device that
    is not named is left alone: pass every device the block computes on, e.g. :func:`model_devices`). CPU and
    ``meta`` entries of ``devices`` need nothing beyond the CPU generator.

    Raises:
        RuntimeError: a device whose generator cannot be saved (:func:`unpreservable`; callers check first and
            leave out the computation that would draw there).
    """
    accelerators = []
    for device in dict.fromkeys(torch.device(d) for d in devices):
        if device.type in ("cpu", "meta"):
            continue
        module = _generator_module(device)
        if module is None:
            raise RuntimeError(f"torch has no generator module for device {device}: its state cannot be saved")
        accelerators.append((module, device, module.get_rng_state(device)))
    cpu = torch.default_generator.get_state()
    python = random.getstate()
    numpy = _numpy_random()
    numpy_state = numpy.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.default_generator.set_state(cpu)
        for module, device, state in accelerators:
            module.set_rng_state(state, device)
        random.setstate(python)
        if numpy is not None:
            numpy.set_state(numpy_state)


def _numpy_random() -> Any:
    try:
        import numpy

        return numpy.random
    except ImportError:  # pragma: no cover -- numpy comes with torch's and transformers' dependencies
        return None
