"""Every recipe that trains through ``RecipeRun.train_and_evaluate`` (sft_instruct, dpo, reward_model, rlhf) times its
phases: with ``--max_steps 1`` on a tiny model, each row of the roofline in metrics.json is timed with a ratio of at
least 1, or left out with the reason (issue 37: reward_model reported ``backward 0.0 s, floor 9.53 s, ratio 0.0x``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_recipe
from transformers import LlamaForSequenceClassification


def _rows(tmp_path: Path, name: str, rows: slice, recipe_default: str) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(Path(recipe_default).read_text().splitlines()[rows]) + "\n")
    return str(path)


def _flags(recipe: str, module, model_dir: str, tmp_path: Path, tiny_model, tokenizer, lora: bool) -> list[str]:
    flags = ["--model_name_or_path", model_dir, "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    flags += ["--max_steps", "1", "--save_strategy", "no"]
    if lora:
        flags += ["--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "k_proj", "v_proj", "o_proj"]
    if recipe == "rlhf":  # a tiny reward model beside the tiny policy
        config = type(tiny_model.config)(**{**tiny_model.config.to_dict(), "num_labels": 1})
        LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
        tokenizer.save_pretrained(tmp_path / "rm")
        flags += ["--reward_model_path", str(tmp_path / "rm")]
        return flags + ["--per_device_train_batch_size", "4", "--max_completion_length", "4"]
    defaults = module.main.parse_args([])[0]
    flags += ["--per_device_train_batch_size", "2"]
    flags += ["--train_file", _rows(tmp_path, "train", slice(0, 4), defaults.train_file)]
    flags += ["--test_file", _rows(tmp_path, "test", slice(4, 7), defaults.test_file)]
    if recipe == "sft_instruct":
        flags += ["--max_new_tokens", "4"]
    if recipe == "reward_model" and lora:
        flags += ["--lora_task_type", "SEQ_CLS"]
    return flags


def check_roofline(roofline: dict) -> None:
    """The rule: each reported row timed with ratio >= 1; each left-out row with its reason; backward and optimizer
    timed (whatever else happened to their rows)."""
    for name, row in roofline["phases"].items():
        assert row["seconds"] > 0 and row["ratio"] >= 1, (name, row)
        assert row["ratio"] == pytest.approx(row["seconds"] / row["floor_seconds"])
    for name, row in roofline["omitted"].items():
        assert row["reason"].startswith(name) and (row["seconds"] <= 0 or row["ratio"] < 1), (name, row)
    rows = {**roofline["phases"], **roofline["omitted"]}
    for name in ("backward", "optimizer"):
        assert rows[name]["seconds"] > 0, f"{name} not timed: {rows[name]}"
    assert rows["optimizer"]["calls"] == 1  # the one optimizer step
    assert rows["backward"]["calls"] >= 1


@pytest.mark.parametrize(
    ("recipe", "lora"),
    [("sft_instruct", True), ("dpo", True), ("reward_model", False), ("reward_model", True), ("rlhf", False)],
)
def test_every_recipe_times_the_phases_of_its_roofline(recipe, lora, tiny_model, tokenizer, tiny_model_dir, tmp_path):
    module = load_recipe(recipe)
    module.main(*module.main.parse_args(_flags(recipe, module, tiny_model_dir, tmp_path, tiny_model, tokenizer, lora)))
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    check_roofline(metrics["roofline"])
    phases = {**metrics["roofline"]["phases"], **metrics["roofline"]["omitted"]}
    # a reward model's and SFT's training forwards are hook-timed forwards; GRPO's go through its log-prob phase
    assert ("logprob_forward" if recipe == "rlhf" else "forward") in phases
