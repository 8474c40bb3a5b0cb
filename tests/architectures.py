"""Tiny random causal LMs of many architectures, built from configs (no downloads), for the architecture matrix.

``tiny_config(model_type, vocab_size)`` starts from transformers' default config of the architecture and shrinks the
size fields it has (2 layers, hidden 32, 4 heads, 4 experts, ...), then applies ``OVERRIDES`` for the few whose
fields must agree with each other. ``FAST`` is the representative set run by default (attention-only, sliding
window, hybrid and state-space, ALiBi, absolute positions, length-dependent RoPE, mixture of experts); every other
causal-LM architecture of transformers is in the slow long tail (``all_causal_lm_types``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

SMALL = dict(
    hidden_size=32,
    n_embd=32,
    d_model=32,
    num_hidden_layers=2,
    n_layer=2,
    n_layers=2,
    num_layers=2,
    num_attention_heads=4,
    n_head=4,
    n_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    ffn_dim=64,
    n_inner=64,
    head_dim=8,
    kv_channels=8,
    max_position_embeddings=256,
    n_positions=256,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)

# Architecture -> (config overrides, what it stands for in the matrix).
FAST: dict[str, tuple[dict[str, Any], str]] = {
    "llama": ({}, "attention-only, RoPE"),
    "llama:dynamic_rope": (
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        "dynamic-NTK RoPE",
    ),
    "phi3:longrope": (
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
            },
            "original_max_position_embeddings": 64,
        },
        "LongRoPE",
    ),
    "gpt2": ({}, "learned absolute positions"),
    "mistral": ({"sliding_window": 4}, "sliding window"),
    "gemma3_text": (
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
        "sliding + full layers",
    ),
    "mixtral": ({}, "mixture of experts"),
    "mpt": ({}, "ALiBi (cached forward bug)"),
    "bloom": ({}, "ALiBi"),
    "lfm2": ({"layer_types": ["conv", "full_attention"]}, "hybrid conv/attention"),
    "mamba2": ({"num_heads": 4, "head_dim": 16, "expand": 2, "n_groups": 1, "state_size": 8}, "state space"),
    "qwen3_next": (
        {
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
        },
        "hybrid linear attention",
    ),
    "falcon_h1": ({}, "hybrid attention/SSM"),
}


def all_causal_lm_types() -> list[str]:
    """Every ``model_type`` with an ``AutoModelForCausalLM`` class in the installed transformers."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(config: Any) -> None:
    for key, value in SMALL.items():
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # noqa: BLE001 -- read-only or validated fields keep their value
                pass


def tiny_config(name: str, vocab_size: int):
    """Config of a 2-layer model of architecture ``name`` (``model_type`` or ``model_type:variant`` of ``FAST``)."""
    model_type = name.split(":")[0]
    config = AutoConfig.for_model(model_type)
    _shrink(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        _shrink(text)
    for key, value in FAST.get(name, ({}, ""))[0].items():
        setattr(config, key, value)
    for target in {id(config): config, id(text): text}.values():
        if hasattr(target, "vocab_size"):
            target.vocab_size = vocab_size
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(target, key, None) is not None and not isinstance(getattr(target, key), list):
                setattr(target, key, min(getattr(target, key), vocab_size - 1))
    return config


MAX_PARAMETERS = 30_000_000
"""Largest stand-in built: a config whose size fields the generic shrink does not know (e.g. BLT's) would allocate
gigabytes, so such an architecture is reported as not built instead."""


def tiny_model(name: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A random fp32 model of ``tiny_config(name, vocab_size)`` in training mode, dropout off.

    Raises:
        ValueError: the shrunk config still has more than ``MAX_PARAMETERS`` parameters (counted on the meta
            device, nothing allocated).
    """
    config = tiny_config(name, vocab_size)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"{name}: {size / 1e6:.0f}M parameters after shrinking; not a tiny stand-in")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def decision_table(vocab_size: int = 49152, seconds: int = 120) -> list[tuple[str, str, str, str, str]]:
    """(architecture, prompt sharing, completion packing, zero-row skipping, the log-prob forwards' sharing under
    gradient checkpointing) for ``FAST`` and every other causal-LM type: "on", the reason a saving is off, or why
    the generic tiny config could not build the model (``uv run python tests/architectures.py`` prints it;
    docs/performance.md has the table). The last column is the one-sequence forward (``SavingsDecision.sequence``)
    that shares prompts and packs completions without a cache; TRL's MoE load-balancing loss, a trainer option,
    is not judged here. Each model gets ``seconds`` of wall time (more on a busy machine)."""
    import os
    import signal

    from trl_ext.speed.shared_prompts import savings_decision, training_noise

    rows = []
    names = list(FAST) + [t for t in all_causal_lm_types() if t not in {n.split(":")[0] for n in FAST}]
    for name in names:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # each model in a child: a model that allocates too much or hangs cannot stop the table
            os.close(read)
            signal.alarm(seconds)
            try:
                model = tiny_model(name, vocab_size)
                decision = savings_decision(model)
                noise = training_noise(model)
                share = decision.share_prompts or noise
                pack = "off with share_prompt_cache" if share else decision.pack
                sequence = "off with share_prompt_cache" if share else decision.sequence
                row = (share or "on", pack or "on", decision.skip_rows or noise or "on", sequence or "on")
            except BaseException as err:  # noqa: BLE001
                row = (f"not built: {type(err).__name__}: {str(err)[:80]}", "", "", "")
            os.write(write, "\t".join(row).replace("\n", " ").encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        os.waitpid(pid, 0)
        cells = text.split("\t") if text else ["not built: the process was killed", "", "", ""]
        rows.append((name, *cells))
    return rows


if __name__ == "__main__":
    import logging
    import os
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    logging.getLogger("trl_ext").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(
        "| architecture | share_prompt_cache | pack_completions | skip_zero_advantage_rows | log-prob sharing under "
        "gradient checkpointing |\n|---|---|---|---|---|"
    )
    for row in decision_table(seconds=int(os.environ.get("TRL_EXT_TABLE_SECONDS", "120"))):
        print("| " + " | ".join(row) + " |", flush=True)
