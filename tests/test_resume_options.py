"""Resume refuses what it cannot continue exactly (issue 18 item 6): the options a checkpoint was written with are
saved in it, and train(resume_from_checkpoint=...) compares them with the new run's before any step.

One real GRPO checkpoint (1 process, batch 4, accumulation 1, steps_per_generation 2, 4 generations, seed 0) is
written once; each refused option is then changed in a new trainer, and the error must name exactly the options that
changed, with both values. The number of processes is faked in a copy of the checkpoint (its state says 2, or an
older checkpoint has two per-process files). Changing what may change on resume (logging and save steps, the output
folder) resumes and trains.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil

import pytest
from conftest import CPU_TEST_ARGS, length_mod5_reward
from datasets import Dataset
from tiny import tiny_model_for_tests

import trl_ext
from trl_ext.cli import RecipeError
from trl_ext.run import RecipeRun
from trl_ext.trainers.upstream import ResumeMismatchError

GRPO_OPTIONS = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    steps_per_generation=2,
    gradient_accumulation_steps=1,
    max_completion_length=6,
    beta=0.0,
    learning_rate=1e-2,
)
LIBRARY_END = (
    ". Resume with the checkpoint's values, or start over: train without resume_from_checkpoint (into a new "
    "output_dir to keep these checkpoints)"
)


def grpo_trainer(tokenizer, output_dir, **overrides):
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    options = {**CPU_TEST_ARGS, **GRPO_OPTIONS, "save_strategy": "steps", "save_steps": 1, **overrides}
    args = trl_ext.GRPOConfig(output_dir=str(output_dir), **options)
    return trl_ext.GRPOTrainer(
        model=tiny_model_for_tests(tokenizer),
        reward_funcs=length_mod5_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Count to {i + 3}:" for i in range(8)]}),
        processing_class=tok,
    )


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    """checkpoint-1 of a 1-step GRPO run (its rollout of 2 micro-batches is half used)."""
    out = tmp_path_factory.mktemp("grpo_run")
    grpo_trainer(tokenizer, out).train()
    return out / "checkpoint-1"


def test_the_checkpoint_saves_the_options_resume_depends_on(checkpoint):
    state = json.loads((checkpoint / "trl_ext_state.json").read_text())
    assert state["resume_options"] == {
        "num_processes": 1,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "seed": 0,
        "data_seed": None,
        "steps_per_generation": 2,
        "num_iterations": 1,
        "num_generations": 4,
        "generation_batch_size": 8,  # 4 per device x 1 process x 2 steps per generation
    }


def test_trl_ext_files_are_in_the_checkpoint_before_trainer_state_marks_it_complete(tokenizer, tmp_path, monkeypatch):
    """transformers writes trainer_state.json last; a run killed right after it (what the recipes' resume and
    ``resume_from_checkpoint=True`` take as a complete checkpoint) must find trl_ext's state already there."""
    from transformers.trainer_callback import TrainerState

    present = []
    save_to_json = TrainerState.save_to_json

    def spy(self, json_path):
        folder = json_path.rsplit("/", 1)[0]
        present.append(sorted(f for f in os.listdir(folder) if f.startswith("trl_ext")))
        return save_to_json(self, json_path)

    monkeypatch.setattr(TrainerState, "save_to_json", spy)
    grpo_trainer(tokenizer, tmp_path, max_steps=2).train()
    assert present == [["trl_ext_rank_state_0.pt", "trl_ext_state.json"]] * 2


@pytest.mark.parametrize(
    "change, named",
    [
        # a rollout of 1 micro-batch instead of 2: TRL's _prepare_inputs raised IndexError on the restored buffer
        (dict(steps_per_generation=1), "steps_per_generation was 2, now 1; generation_batch_size was 8, now 4"),
        # the same rollout, consumed by other optimizer steps (resumed silently before)
        (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps was 1, now 2"),
        (
            dict(per_device_train_batch_size=2, num_generations=2),
            "per_device_train_batch_size was 4, now 2; num_generations was 4, now 2; generation_batch_size was 8, now "
            "4",
        ),
        (dict(num_generations=2), "num_generations was 4, now 2"),
        (dict(seed=1), "seed was 0, now 1"),
        (dict(data_seed=5), "data_seed was None, now 5"),
        (dict(num_iterations=2), "num_iterations was 1, now 2"),
    ],
)
def test_resume_with_a_changed_option_is_refused_before_any_step(change, named, checkpoint, tokenizer, tmp_path):
    trainer = grpo_trainer(tokenizer, checkpoint.parent, **change)
    with pytest.raises(ResumeMismatchError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert str(err.value) == (
        f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue where it "
        f"stopped: {named}{LIBRARY_END}"
    )
    assert trainer.state.global_step == 0
    # resume_from_checkpoint=True finds the same checkpoint (the last one in output_dir) and refuses the same way
    with pytest.raises(ResumeMismatchError, match=named.split(";")[0]):
        trainer.train(resume_from_checkpoint=True)


def test_a_checkpoint_of_two_processes_is_refused_by_one(checkpoint, tokenizer, tmp_path):
    fake = tmp_path / "checkpoint-1"
    fake.mkdir()
    state = json.loads((checkpoint / "trl_ext_state.json").read_text())
    state["resume_options"].update(num_processes=2, generation_batch_size=16)
    (fake / "trl_ext_state.json").write_text(json.dumps(state))
    trainer = grpo_trainer(tokenizer, tmp_path)
    with pytest.raises(ResumeMismatchError) as err:
        trainer.train(resume_from_checkpoint=str(fake))
    assert str(err.value) == (
        f"cannot resume from {fake}: it was written with other options, and the run would not continue where it "
        f"stopped: num_processes was 2, now 1; generation_batch_size was 16, now 8{LIBRARY_END}"
    )


def test_an_older_checkpoint_is_checked_for_what_its_files_tell(checkpoint, tokenizer, tmp_path, caplog):
    """No saved options (an older trl_ext): the number of processes comes from the per-process state files, the
    batch size from trainer_state.json; the rest cannot be checked, which one warning says."""
    old = tmp_path / "out" / "checkpoint-1"
    shutil.copytree(checkpoint, old)
    state = json.loads((old / "trl_ext_state.json").read_text())
    del state["resume_options"]
    (old / "trl_ext_state.json").write_text(json.dumps(state))
    shutil.copy(old / "trl_ext_rank_state_0.pt", old / "trl_ext_rank_state_1.pt")  # written by 2 processes
    trainer = grpo_trainer(tokenizer, tmp_path / "out", per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(
        ResumeMismatchError, match=r"stopped: num_processes was 2, now 1; per_device_train_batch_size was 4, now 2\. "
    ):
        trainer.train(resume_from_checkpoint=str(old))

    (old / "trl_ext_rank_state_1.pt").unlink()  # 1 process, same batch size: resumes, with one warning
    trainer = grpo_trainer(tokenizer, tmp_path / "out", max_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.upstream"):
        trainer.train(resume_from_checkpoint=str(old))
    assert trainer.state.global_step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_ext.trainers.upstream"]
    assert warnings == [
        f"{old} was written by an older trl_ext that did not save its options: checked num_processes, "
        "per_device_train_batch_size only; resume with the gradient_accumulation_steps, seed, data_seed, "
        "steps_per_generation, num_iterations, num_generations, generation_batch_size it was written with, or the run "
        "will not continue exactly"
    ]


def test_options_that_may_change_on_resume_keep_working(checkpoint, tokenizer, tmp_path):
    # other logging and save steps, TensorBoard logging, another output folder, more steps: resumes and trains.
    # (transformers keeps the checkpoint's logging/save/eval steps on resume, with a warning of its own)
    out = tmp_path / "elsewhere"
    trainer = grpo_trainer(
        tokenizer, out, max_steps=3, logging_steps=2, save_steps=2, report_to=["tensorboard"], eval_strategy="no"
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 3
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry][-1] == 3
    assert (out / "checkpoint-3" / "trl_ext_state.json").is_file()
    assert list(out.glob("runs/*/events.out.tfevents.*"))


def test_the_recipes_refuse_before_loading_the_model(checkpoint, tmp_path):
    args = trl_ext.GRPOConfig(output_dir=str(checkpoint.parent), **{**CPU_TEST_ARGS, **GRPO_OPTIONS, "seed": 3})
    with pytest.raises(RecipeError) as err:
        RecipeRun("grpo_math", checkpoint.parent, {"training_args": args}, resume=str(checkpoint))
    assert str(err.value) == (
        f"cannot resume from {checkpoint}: it was written with other options, and the run would not continue where it "
        "stopped: seed was 0, now 3. Resume with the checkpoint's values, or start over: run without "
        "--resume_from_checkpoint, with a new --output_dir (or --overwrite_output_dir to replace this run)"
    )
    same = trl_ext.GRPOConfig(output_dir=str(checkpoint.parent), **{**CPU_TEST_ARGS, **GRPO_OPTIONS})
    assert RecipeRun(
        "grpo_math", checkpoint.parent, {"training_args": same}, resume="true"
    ).resume_from_checkpoint == str(checkpoint)


def test_sft_refuses_a_changed_accumulation(tokenizer, tiny_model, tmp_path):
    fake = tmp_path / "checkpoint-2"
    fake.mkdir()
    saved = {
        "num_processes": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "seed": 0,
        "data_seed": None,
    }
    (fake / "trl_ext_state.json").write_text(json.dumps({"total_train_tokens": 10, "resume_options": saved}))
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), **{**CPU_TEST_ARGS, "per_device_train_batch_size": 2})
    trainer = trl_ext.SFTTrainer(
        model=tiny_model,
        args=args,
        processing_class=copy.deepcopy(tokenizer),
        train_dataset=Dataset.from_dict({"prompt": ["Say hi.\n"] * 2, "completion": ["Hi!"] * 2}),
    )
    with pytest.raises(ResumeMismatchError, match=r"stopped: gradient_accumulation_steps was 4, now 1\. Resume"):
        trainer.train(resume_from_checkpoint=str(fake))
