"""vLLM generation in ``trl_ext.GRPOTrainer``: TRL 1.16's colocate engine made to sample from the policy being trained.

Three fixes, applied by ``GRPOTrainer.__init__`` (reproductions: docs/scaling.md, "vLLM on CPU"):

1. **dtype**: vLLM's ``"auto"`` runs a float32 checkpoint in bf16; :func:`engine_options` passes the policy's dtype
(``GRPOConfig.vllm_dtype``). 2. **seed**: TRL seeds the engine (and so the training process's RNGs) with the process
index only; :func:`engine_options` adds ``args.seed``. 3. **weights on vLLM's CPU build**: vLLM repacks linear weights
and deletes the parameters, so TRL's ``load_weights`` fails; :func:`sync_weights_in_place` reloads layerwise and repacks
the tied layers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger("trl_ext")

VLLM_DTYPES = ("policy", "auto", "float32", "bfloat16", "float16")
"""Choices of ``GRPOConfig.vllm_dtype``: the policy's own dtype, vLLM's choice (TRL 1.16), or a named dtype."""


def policy_dtype(model: Any) -> torch.dtype | None:
    """The floating dtype the policy computes in (``PreTrainedModel.dtype``: its first floating parameter's; a PEFT
    model answers for its base model), or None when it has none of float32, bfloat16 and float16."""
    dtype = getattr(model, "dtype", None)
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else None


def engine_dtype(choice: str, model: Any) -> torch.dtype | str:
    """The ``dtype`` to build the colocated engine with for ``GRPOConfig.vllm_dtype`` = ``choice`` (one of
    :data:`VLLM_DTYPES`): ``"policy"`` -> :func:`policy_dtype` (``"auto"`` when the policy has none), ``"auto"`` and the
    named dtypes as given."""
    if choice == "policy":
        return policy_dtype(model) or "auto"
    return choice


@contextlib.contextmanager
def engine_options(dtype: Callable[[], torch.dtype | str], seed: int) -> Iterator[None]:
    """Within the block, every ``vllm.LLM`` that TRL's ``VLLMGeneration`` builds gets ``dtype=dtype()`` (called when the
    engine is built, once the policy is loaded) and ``seed = seed +`` the seed TRL gives it (process index //
    tensor_parallel_size). See the module docstring (1, 2). Nothing else TRL passes changes."""
    from trl.generation import vllm_generation

    build = getattr(vllm_generation, "LLM", None)
    if build is None:  # vLLM is not installed: TRL raises its own ImportError when it builds the engine
        yield
        return

    def with_options(*args: Any, **kwargs: Any) -> Any:
        kwargs["dtype"] = dtype()
        kwargs["seed"] = seed + kwargs.get("seed", 0)
        return build(*args, **kwargs)

    vllm_generation.LLM = with_options
    try:
        yield
    finally:
        vllm_generation.LLM = build


def runs_on_cpu(generation: Any) -> bool:
    """Whether TRL's colocated engine (``VLLMGeneration`` in colocate mode) is vLLM's CPU platform."""
    from vllm.platforms import current_platform

    return generation.mode == "colocate" and current_platform.is_cpu()


def sync_weights_in_place(generation: Any) -> None:
    """Load the policy's current weights into TRL's colocated engine on vLLM's CPU build: what
    ``VLLMGeneration.sync_weights`` (TRL 1.16, colocate mode) does, through vLLM's own reload (module docstring, 3).

    The policy's parameters come from TRL's own ``_iter_named_params`` (PEFT adapters merged, names as vLLM expects);
    vLLM's worker reloads them layer by layer and repacks each layer's kernel weights
    (``Worker.reload_weights(is_checkpoint_format=True)``); every layer backed by an embedding matrix
    (``UnquantizedEmbeddingMethod``: the input embedding and the LM head, tied or not) then repacks from its current
    weight, since a tied head is not among the reloaded layers. Finally the prefix cache is reset, as TRL does.

    Args:
        generation: the trainer's ``trl.generation.vllm_generation.VLLMGeneration`` (colocate mode).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    worker = generation.llm.llm_engine.model_executor.driver_worker
    worker.reload_weights(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True)
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
    generation.llm.reset_prefix_cache()
