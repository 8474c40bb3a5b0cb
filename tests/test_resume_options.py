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
from trl_ext.trainers.resume import ResumeMismatchError

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


def grpo_trainer(tokenizer, output_dir, model=None, **overrides):
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "left"
    options = {**CPU_TEST_ARGS, **GRPO_OPTIONS, "save_strategy": "steps", "save_steps": 1, **overrides}
    args = trl_ext.GRPOConfig(output_dir=str(output_dir), **options)
    return trl_ext.GRPOTrainer(
        model=tiny_model_for_tests(tokenizer) if model is None else model,  # a path where beta > 0 needs a reference
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
        "seed": 0,  # (data_seed, train_sampling_strategy, dataloader_drop_last: not read by GRPO's RepeatSampler)
        "auto_find_batch_size": False,
        "dataloader_in_order": True,
        "accelerator_config": {  # its parts that place rows on processes and steps
            "split_batches": False,
            "dispatch_batches": None,
            "even_batches": True,
            "use_seedable_sampler": True,
            "gradient_accumulation_kwargs": None,
        },
        "parallelism_config": None,
        "steps_per_generation": 2,
        "num_iterations": 1,
        "num_generations": 4,
        "generation_batch_size": 8,  # 4 per device x 1 process x 2 steps per generation
        "shuffle_dataset": True,
        "dynamic_sampling": False,  # (max_sampling_rounds only while dynamic sampling is on)
    }
    assert state["changeable_options"]["temperature"] == 1.0 and state["changeable_options"]["learning_rate"] == 1e-2
    assert state["training_rows"] == 8  # the 8 prompts


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
        (dict(num_iterations=2), "num_iterations was 1, now 2"),
        # the extra rounds decide which samples each step trains on (issue 30)
        (dict(dynamic_sampling=True), "dynamic_sampling was False, now True"),
        # issue 37: the prompt order (RepeatSampler's shuffle)
        (dict(shuffle_dataset=False), "shuffle_dataset was True, now False"),
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
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(old))
    assert trainer.state.global_step == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_ext.trainers.resume"]
    assert warnings == [
        f"{old} was written by an older trl_ext that did not save its options: checked num_processes, "
        "per_device_train_batch_size, dynamic_sampling only; resume with the gradient_accumulation_steps, seed, "
        "auto_find_batch_size, dataloader_in_order, accelerator_config, parallelism_config, steps_per_generation, "
        "num_iterations, num_generations, generation_batch_size, shuffle_dataset it was written with, or the run will "
        "not continue exactly"
    ]


def test_options_that_may_change_on_resume_keep_working(checkpoint, tokenizer, tmp_path, caplog):
    # other logging and save steps, TensorBoard logging, another output folder, more steps: resumes and trains.
    # (transformers keeps the checkpoint's logging/save/eval steps on resume, with a warning of its own)
    # data_seed and train_sampling_strategy: GRPO's RepeatSampler never reads them (TRL 1.16), so no refusal
    out = tmp_path / "elsewhere"
    trainer = grpo_trainer(
        tokenizer,
        out,
        max_steps=3,
        logging_steps=2,
        save_steps=2,
        report_to=["tensorboard"],
        eval_strategy="no",
        data_seed=5,
        train_sampling_strategy="sequential",
    )
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert [r.getMessage() for r in caplog.records if r.name == "trl_ext.trainers.resume"] == []
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


def edited_copy(checkpoint, folder, edit):
    copy_ = folder / "checkpoint-1"
    shutil.copytree(checkpoint, copy_)
    state = json.loads((copy_ / "trl_ext_state.json").read_text())
    edit(state)
    (copy_ / "trl_ext_state.json").write_text(json.dumps(state))
    return copy_


def test_a_changed_max_sampling_rounds_is_refused_while_dynamic_sampling_is_on(checkpoint, tokenizer, tmp_path):
    def with_dynamic_sampling(state):
        state["resume_options"].update(dynamic_sampling=True, max_sampling_rounds=4)

    fake = edited_copy(checkpoint, tmp_path, with_dynamic_sampling)
    trainer = grpo_trainer(tokenizer, tmp_path, dynamic_sampling=True, max_sampling_rounds=2)
    with pytest.raises(ResumeMismatchError, match=r"stopped: max_sampling_rounds was 4, now 2\. Resume"):
        trainer.train(resume_from_checkpoint=str(fake))


def test_a_round_3_checkpoint_tells_whether_it_sampled_dynamically(checkpoint, tokenizer, tmp_path, caplog):
    """Round 3 saved no dynamic_sampling option, but its state holds the sampler's position (None when off)."""

    def round_3(state):
        del state["resume_options"]["dynamic_sampling"]
        assert state["dynamic_sampling"] is None

    fake = edited_copy(checkpoint, tmp_path, round_3)
    trainer = grpo_trainer(tokenizer, tmp_path, dynamic_sampling=True)
    with pytest.raises(ResumeMismatchError, match=r"stopped: dynamic_sampling was False, now True\. Resume"):
        trainer.train(resume_from_checkpoint=str(fake))


def test_changed_sampling_and_learning_rate_resume_with_one_warning_each(checkpoint, tokenizer, tmp_path, caplog):
    """Issue 30: temperature and max_completion_length change what the steps after the checkpoint compute, and they
    use the new values; a new learning_rate is ignored (transformers restores the optimizer and scheduler); each
    change is one warning naming both values and that effect."""
    trainer = grpo_trainer(
        tokenizer, tmp_path, max_steps=3, temperature=0.7, max_completion_length=4, learning_rate=0.5
    )
    lengths = []
    generate = trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        lengths.append(out["completion_ids"].size(1))
        return out

    trainer._generate_and_score_completions = recorded
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    warnings = [r.getMessage() for r in caplog.records if r.name == "trl_ext.trainers.resume"]
    assert warnings == [
        f"resuming {checkpoint}: learning_rate was 0.01, now 0.5; the checkpoint's optimizer and scheduler keep 0.01 "
        "(transformers restores their state); start over to train with 0.5",
        f"resuming {checkpoint}: temperature was 1.0, now 0.7; the steps after the checkpoint use 0.7",
        f"resuming {checkpoint}: max_completion_length was 6, now 4; the steps after the checkpoint use 4",
    ]
    assert trainer.state.global_step == 3 and trainer.temperature == 0.7
    # step 2 trains the checkpoint's buffered rollout (6 tokens wide at most), step 3 a new one of at most 4 tokens
    assert len(lengths) == 1 and lengths[0] <= 4
    # the optimizer's base rate is the checkpoint's 1e-2, not 0.5
    assert trainer.optimizer.param_groups[0]["initial_lr"] == 1e-2


def test_beta_from_zero_is_refused(checkpoint, tokenizer, tiny_model_dir, tmp_path):
    """A beta-0 run has no reference model and its buffered rollout no reference log-probs to train a KL term on."""
    trainer = grpo_trainer(tokenizer, tmp_path, tiny_model_dir, beta=0.1)
    with pytest.raises(ResumeMismatchError, match=r"stopped: beta was 0\.0, now 0\.1\. Resume"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


@pytest.fixture(scope="module")
def kl_checkpoint(tokenizer, tmp_path_factory):
    """checkpoint-1 of a 1-step GRPO run with beta 0.04 (a reference model: the policy's folder)."""
    model_dir = tmp_path_factory.mktemp("tiny")
    tiny_model_for_tests(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("grpo_kl_run")
    grpo_trainer(tokenizer, out, str(model_dir), beta=0.04).train()
    return out / "checkpoint-1", str(model_dir)


def test_a_changed_fixed_beta_is_used_and_an_adaptive_one_goes_on(kl_checkpoint, tokenizer, tmp_path, caplog):
    checkpoint, model_dir = kl_checkpoint
    trainer = grpo_trainer(tokenizer, tmp_path / "fixed", model_dir, max_steps=2, beta=0.1)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.beta == 0.1  # the checkpoint's state says 0.04; a fixed beta is the config's
    assert f"resuming {checkpoint}: beta was 0.04, now 0.1; the steps after the checkpoint use 0.1" in [
        r.getMessage() for r in caplog.records
    ]

    def adaptive(state):
        state["changeable_options"]["kl_target"] = 0.02
        state["beta"] = 0.07  # what the controller had reached

    fake = edited_copy(checkpoint, tmp_path, adaptive)
    trainer = grpo_trainer(tokenizer, tmp_path, model_dir, max_steps=1, beta=0.1, kl_target=0.02)
    with caplog.at_level(logging.WARNING, logger="trl_ext.trainers.resume"):
        trainer.train(resume_from_checkpoint=str(fake))
    # from 0.07, one controller update at most moves beta by 0.2 x 8 samples / 10000 = 1.6e-4 of itself; from the
    # configured 0.1 it would be 0.1 +- 1.6e-5
    assert trainer.beta == pytest.approx(0.07, rel=1.6e-4)
    assert (
        f"resuming {fake}: beta was 0.04, now 0.1; with kl_target the adaptive beta goes on from the checkpoint's "
        "value (0.1 is only a starting value)" in [r.getMessage() for r in caplog.records]
    )
