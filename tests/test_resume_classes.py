"""Resume with changed options, for SFT, DPO and the reward model (issue 37 item 7; GRPO: tests/test_resume_options.py).

Every config field of each trainer is classified (trl_ext/trainers/resume.py): refused (it changes which rows a step
reads), warned (it changes what the steps after the checkpoint compute) or free. Each trainer's base run here is a
real 2-step run of a tiny model with the options its recipe parses from its own YAML (so the recipe's resume check
compares the same options), checkpointed at steps 1 and 2. From checkpoint-1:

- a refused option changed stops the recipe before the model loads (one RecipeError naming the option and both
  values), and the library's ``train(resume_from_checkpoint=...)`` before any step;
- a warned option changed resumes with exactly one warning naming both values, through the recipe's check and the
  trainer's;
- nothing changed (only free options: another output folder, logging steps) ends with the base run's weights, bit
  for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset
from tiny import tiny_model_for_tests
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import trl_ext
from trl_ext.cli import RecipeError
from trl_ext.run import RecipeRun
from trl_ext.trainers import resume
from trl_ext.trainers.resume import ResumeMismatchError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import dpo  # noqa: E402
import reward_model  # noqa: E402
import sft_instruct  # noqa: E402

RECIPES = {"sft": sft_instruct, "dpo": dpo, "reward": reward_model}
RECIPE_NAMES = {"sft": "sft_instruct", "dpo": "dpo", "reward": "reward_model"}
# the recipes' YAML, made small: 2 steps of 2 rows, a checkpoint after each; max_length 64 fits every row below
BASE_FLAGS = (
    "--max_steps 2 --save_strategy steps --save_steps 1 --per_device_train_batch_size 2 --logging_steps 1 "
    "--learning_rate 1e-2 --max_length 64 --use_cpu true --report_to none"
).split()
LONG_PROMPT = "Read this carefully and then answer the short question that follows it at the very end: " * 2
SFT_ROWS = dict(
    prompt=["Say hi.\n", LONG_PROMPT + "What is 2 + 2?\n", "Name a colour.\n", "Add 2 and 3.\n"],
    completion=["Hi there!", "4.", "Blue.", "The sum is 5."],
    unsafe_completion=[None, "5.", "Red, like blood.", None],  # the safety penalty's unlikelihood term
)
PAIRS = dict(
    prompt=["The sky is", "Two plus two is", "Water is", "Fire is"],
    chosen=[" blue.", " four.", " wet.", " hot."],
    rejected=[" green.", " five.", " dry.", " cold."],
)
LIBRARY_END = (
    ". Resume with the checkpoint's values, or start over: train without resume_from_checkpoint (into a new "
    "output_dir to keep these checkpoints)"
)
RECIPE_END = (
    ". Resume with the checkpoint's values, or start over: run without --resume_from_checkpoint, with a new "
    "--output_dir (or --overwrite_output_dir to replace this run)"
)


# ------------------------------------------------------------------------------------------------ the classification


CONFIGS = [trl_ext.SFTConfig, trl_ext.DPOConfig, trl_ext.RewardConfig, trl_ext.GRPOConfig]


@pytest.mark.parametrize("config_cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_is_classified(config_cls):
    """A field TRL or transformers adds in an upgrade fails here until it is classified; a classified name that is
    no field (renamed or removed upstream) too."""
    args = config_cls(output_dir="unused", use_cpu=True, report_to="none")
    fields = {f.name for f in dataclasses.fields(config_cls)}
    rules = resume.resume_rules(args)
    assert sorted(fields - set(rules)) == [], "classify these fields in trl_ext/trainers/resume.py"
    assert sorted(set(rules) - fields) == ["num_processes"]  # the one classified value that is not a field
    assert {rule.kind for rule in rules.values()} == {resume.REFUSE, resume.WARN, resume.FREE}
    for name, rule in rules.items():
        assert rule.refuse_if is None or rule.kind == resume.WARN, name


def test_no_table_names_a_field_that_does_not_exist():
    training_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert sorted(set(resume.COMMON) - training_fields) == ["num_processes"]
    for table, config_cls in zip((resume.SFT, resume.DPO, resume.REWARD, resume.GRPO), CONFIGS):
        fields = {f.name for f in dataclasses.fields(config_cls)}
        assert sorted(set(table) - fields) == [], config_cls.__name__
    every = set().union(*({f.name for f in dataclasses.fields(c)} for c in CONFIGS))
    assert sorted(set(resume._TRL_SHARED) - every) == []


def test_the_reference_names_every_refused_option():
    """docs/reference.md's "Stopping and resuming" (the README links it) lists what a resume refuses, per trainer:
    every refused option is named."""
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert "docs/reference.md#stopping-and-resuming" in (ROOT / "README.md").read_text()
    section = reference[reference.index("## Stopping and resuming") :]
    section = section[: section.index("\n## ")]
    for config_cls in CONFIGS:
        for name, rule in resume.resume_rules(config_cls(output_dir="unused", use_cpu=True)).items():
            if rule.kind == resume.REFUSE or rule.refuse_if is not None:
                assert f"`{name}`" in section, f"{config_cls.__name__}.{name} is refused on resume: list it there"


# ------------------------------------------------------------------------------------------------ real tiny runs


def recipe_args(kind, output_dir, *flags):
    """The training config the recipe parses from its YAML with BASE_FLAGS and ``flags``."""
    parsed = RECIPES[kind].main.parse_args(["--output_dir", str(output_dir), *BASE_FLAGS, *flags])
    return next(c for c in parsed if isinstance(c, transformers.TrainingArguments))


def build(kind, args, tokenizer, model_dir):
    tok = copy.deepcopy(tokenizer)
    if kind == "sft":
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        # packing cannot carry per-row unsafe responses (trl_ext.SFTTrainer raises): the CE alone
        rows = {k: v for k, v in SFT_ROWS.items() if not (args.packing and k == "unsafe_completion")}
        return trl_ext.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok)
    if kind == "dpo":
        return trl_ext.DPOTrainer(
            model=model_dir, args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tok
        )
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return trl_ext.RewardTrainer(model=model, args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tok)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model_for_tests(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def base_runs(tokenizer, model_dir, tmp_path_factory):
    """kind -> (checkpoint-1 of its 2-step run, the run's final parameters); each run is trained on first use."""
    runs = {}

    def get(kind):
        if kind not in runs:
            out = tmp_path_factory.mktemp(f"{kind}_run")
            trainer = build(kind, recipe_args(kind, out), tokenizer, model_dir)
            trainer.train()
            assert trainer.state.global_step == 2
            runs[kind] = out / "checkpoint-1", {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return runs[kind]

    return get


def resume_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "trl_ext.trainers.resume"]


@pytest.mark.parametrize(
    "kind, change, named",
    [
        ("sft", ["--packing", "true"], "packing was False, now True"),
        ("sft", ["--shuffle_dataset", "true"], "shuffle_dataset was False, now True"),
        ("dpo", ["--train_sampling_strategy", "sequential"], "train_sampling_strategy was 'random', now 'sequential'"),
        ("dpo", ["--dataloader_drop_last", "true"], "dataloader_drop_last was False, now True"),
        # the reward trainer drops pairs longer than max_length
        ("reward", ["--max_length", "32"], "max_length was 64, now 32"),
        ("reward", ["--gradient_accumulation_steps", "2"], "gradient_accumulation_steps was 1, now 2"),
    ],
)
def test_a_refused_option_stops_the_recipe_before_the_model_loads(
    kind, change, named, base_runs, tokenizer, model_dir, tmp_path, monkeypatch
):
    checkpoint, _ = base_runs(kind)
    out = tmp_path / "resumed"
    # the recipe: one RecipeError before its data or model is loaded
    with monkeypatch.context() as patched:
        patched.setattr(trl_ext.models, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("model loaded"))
        patched.setattr(trl_ext.models, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
        recipe = RECIPES[kind].main
        with pytest.raises(RecipeError) as err:
            recipe(
                *recipe.parse_args(
                    ["--output_dir", str(out), *BASE_FLAGS, *change, "--resume_from_checkpoint", str(checkpoint)]
                )
            )
    assert str(err.value) == (
        f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue where it "
        f"stopped: {named}{RECIPE_END}"
    )
    # the library: the trainer refuses at train(), before any step
    trainer = build(kind, recipe_args(kind, out, *change), tokenizer, model_dir)
    with pytest.raises(ResumeMismatchError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value) == (
        f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue where it "
        f"stopped: {named}{LIBRARY_END}"
    )
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    "kind, change, named",
    [
        # at 44 tokens the long row (43 prompt tokens) keeps 1 of its 3 completion tokens: every row stays
        ("sft", ["--max_length", "44"], "max_length was 64, now 44"),
        ("sft", ["--completion_only_loss", "false"], "completion_only_loss was True, now False"),
        ("sft", ["--neftune_noise_alpha", "5"], "neftune_noise_alpha was None, now 5.0"),
        ("sft", ["--safety_penalty_weight", "0.5"], "safety_penalty_weight was 1.0, now 0.5"),
        ("dpo", ["--beta", "0.5"], "beta was 0.1, now 0.5"),
        ("dpo", ["--loss_type", "hinge"], "loss_type was ['sigmoid'], now ['hinge']"),
        ("dpo", ["--label_smoothing", "0.1"], "label_smoothing was 0.0, now 0.1"),
        ("reward", ["--center_rewards_coefficient", "0.01"], "center_rewards_coefficient was None, now 0.01"),
    ],
)
def test_a_warned_option_resumes_with_one_warning_naming_both_values(
    kind, change, named, base_runs, tokenizer, model_dir, tmp_path, caplog
):
    checkpoint, _ = base_runs(kind)
    out = tmp_path / "resumed"
    args = recipe_args(kind, out, *change)
    new = named.rsplit("now ", 1)[1]
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        RecipeRun(RECIPE_NAMES[kind], out, {"training_args": args}, resume=str(checkpoint))  # before the model loads
        assert resume_warnings(caplog) == [f"resuming {checkpoint}: {named}; the steps after the checkpoint use {new}"]
        trainer = build(kind, args, tokenizer, model_dir)
        trainer.train(resume_from_checkpoint=str(checkpoint))  # checks again: the same line is not repeated
    assert len(resume_warnings(caplog)) == 1
    assert trainer.state.global_step == 2
    # what the issue found silent: step 2 computed something else, so the weights are not the uninterrupted run's
    _, final = base_runs(kind)
    assert any(not torch.equal(param, final[name]) for name, param in trainer.model.named_parameters())
    saved = json.loads((out / "checkpoint-2" / "trl_ext_state.json").read_text())
    option = named.split(" was ")[0]
    assert repr(saved["changeable_options"][option]) == new  # the resumed run's checkpoints hold the new value


@pytest.mark.parametrize("kind", ["sft", "dpo", "reward"])
def test_nothing_changed_ends_with_the_uninterrupted_runs_weights(
    kind, base_runs, tokenizer, model_dir, tmp_path, caplog
):
    checkpoint, final = base_runs(kind)
    # only free options differ: another output folder, other logging steps
    args = recipe_args(kind, tmp_path / "elsewhere", "--logging_steps", "2")
    trainer = build(kind, args, tokenizer, model_dir)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert resume_warnings(caplog) == []
    assert trainer.state.global_step == 2
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, final[name]), f"{name}: max difference {(param - final[name]).abs().max():.3g}"


def test_sft_max_length_that_drops_a_row_is_refused_before_any_step(base_runs, tokenizer, model_dir, tmp_path, caplog):
    """At 16 tokens the long row's prompt fills the whole sequence: no completion token is left, TRL drops the row
    (SFTTrainer._prepare_dataset) and every later row moves up one place. The recipe's check (no data yet) warns
    about max_length; the trainer, which has the prepared rows, refuses."""
    checkpoint, _ = base_runs("sft")
    args = recipe_args("sft", tmp_path / "resumed", "--max_length", "16")
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        RecipeRun("sft_instruct", tmp_path / "resumed", {"training_args": args}, resume=str(checkpoint))
    assert resume_warnings(caplog) == [
        f"resuming {checkpoint}: max_length was 64, now 16; the steps after the checkpoint use 16"
    ]
    trainer = build("sft", args, tokenizer, model_dir)
    assert len(trainer.train_dataset) == 3
    with pytest.raises(ResumeMismatchError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value) == (
        f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue where it "
        "stopped: training rows was 4, now 3 (the training data changed, or an option that drops rows: max_length, "
        f"truncation_mode, completion_only_loss, assistant_only_loss, dataset_kwargs){LIBRARY_END}"
    )
    assert trainer.state.global_step == 0


def test_sft_max_length_is_refused_while_packing(base_runs, tmp_path):
    """Packed, max_length is the length of each packed sequence: another one packs other rows together."""
    checkpoint, _ = base_runs("sft")
    packed = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(checkpoint, packed)
    state = json.loads((packed / "trl_ext_state.json").read_text())
    state["resume_options"].update(packing=True, packing_strategy="bfd")  # as a packed run of these options saves it
    (packed / "trl_ext_state.json").write_text(json.dumps(state))
    args = recipe_args("sft", packed.parent, "--packing", "true", "--max_length", "48")
    with pytest.raises(RecipeError) as err:
        RecipeRun("sft_instruct", packed.parent, {"training_args": args}, resume=str(packed))
    assert str(err.value) == (
        f"cannot resume from {packed}: it was written with other options, and the run would not continue where it "
        f"stopped: max_length was 64, now 48{RECIPE_END}"
    )
