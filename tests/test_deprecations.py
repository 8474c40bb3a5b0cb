"""No deprecation warning caused by trl_ext's own configs or code (those TRL/transformers raise on their own stay)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import trl
from conftest import CPU_TEST_ARGS, load_recipe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))  # compare_upstream and grpo_ablations import grpo_math
CONFIGS = sorted(p.name for p in (ROOT / "recipes" / "configs").glob("*.yaml"))
CPU_FLAGS = {
    "--bf16": "false",
    "--use_cpu": "true",
    "--use_vllm": "false",
    "--backend": "hf",
}  # what a GPU config needs on a CPU


def _recipe_of(config: str) -> str:
    for recipe in (
        "grpo_math",
        "grpo_ablations",
        "grpo_sort",
        "expert_iteration",
        "compare_upstream",
        "eval_math",
        "sft_instruct",
        "dpo",
        "reward_model",
        "rlhf",
    ):
        if config.startswith(recipe):
            return recipe
    raise AssertionError(f"no recipe for {config}")


@pytest.mark.parametrize("config", CONFIGS)
def test_every_bundled_config_parses_without_a_deprecation_warning(config, hub_has_every_repo):
    module = load_recipe(_recipe_of(config))
    argv = ["--config", str(ROOT / "recipes" / "configs" / config), *_cpu_flags(module)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        module.main.parse_args(argv)


def _cpu_flags(module) -> list[str]:
    """The CPU-forcing flags this recipe's parser knows."""
    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        module.main.parse_args(["--help"])
    return [part for flag, value in CPU_FLAGS.items() if f"{flag} " in shown.getvalue() for part in (flag, value)]


def test_gpu_configs_that_ask_for_activation_checkpointing_get_it(hub_has_every_repo):
    # expert_iteration_math.yaml said `gradient_checkpointing: true` over a CPU default that sets
    # `activation_checkpointing: false`; transformers then kept the new name's False, silently
    for recipe, config in (
        ("expert_iteration", "expert_iteration_math.yaml"),
        ("grpo_ablations", "grpo_ablations_math.yaml"),
        ("grpo_ablations", "grpo_ablations_gsm8k.yaml"),
        ("grpo_math", "grpo_math_math.yaml"),
    ):
        module = load_recipe(recipe)
        args = module.main.parse_args(["--config", str(ROOT / "recipes" / "configs" / config), *_cpu_flags(module)])
        assert args[1].activation_checkpointing is True, config


def test_an_upstream_config_with_a_deprecated_option_warns_once(tokenizer, tmp_path):
    from datasets import Dataset
    from tiny import tiny_model_for_tests

    from trl_ext.trainers.dpo import DPOTrainer

    with pytest.warns(FutureWarning, match="`pad_token` is deprecated") as built:
        args = trl.DPOConfig(output_dir=str(tmp_path), pad_token=tokenizer.eos_token, **CPU_TEST_ARGS)
    assert len([w for w in built if "pad_token" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        DPOTrainer(
            model=tiny_model_for_tests(tokenizer, seed=1),
            ref_model=tiny_model_for_tests(tokenizer, seed=2),
            args=args,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["Hi\n"], "chosen": ["Hello."], "rejected": ["Go."]}),
        )
    assert not [w for w in seen if "pad_token" in str(w.message)]  # the copy into trl_ext.DPOConfig does not repeat it
