"""recipes/grpo_ablations.py and recipes/expert_iteration.py: arms, configs, reuse, and tiny end-to-end runs."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

import trl_ext
from trl_ext import tasks
from trl_ext.cli import RecipeError
from trl_ext.compare import ablations, arm_key, parse_arms, run_comparison

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import expert_iteration  # noqa: E402
import grpo_ablations  # noqa: E402


def parse_ablations(*argv, config=None):
    """The recipe's own parsing: its CPU defaults, ``config`` (a GPU file) layered over them, then ``argv``."""
    gpu = (
        []
        if config is None
        else [
            "--config",
            str(grpo_ablations.DEFAULT_CONFIG.parent / config),
            "--bf16",
            "false",
            "--use_cpu",
            "true",
            "--use_vllm",
            "false",
        ]
    )
    return grpo_ablations.main.parse_args([*gpu, *argv])


def arms_of(name, script_args, training_args):
    return parse_arms(ablations.experiment_arms(name, script_args, training_args))


def test_every_experiment_changes_one_thing_from_the_reference():
    script_args, training_args, _ = parse_ablations("--gradient_accumulation_steps", "2")
    ref = {k: v for k, v in ablations.REFERENCE.items() if k != "trainer"}
    names = {e: [a.name for a in arms_of(e, script_args, training_args)] for e in ablations.EXPERIMENTS}
    assert names == {
        "baselines": ["no_baseline", "reinforce_with_baseline"],
        "std_normalization": ["std_normalized", "no_std"],
        "length_normalization": ["masked_mean", "masked_normalize"],
        "learning_rate": ["lr_1.7e-05", "lr_5.0e-05", "lr_1.5e-04"],  # 5e-5 x (1/3, 1, 3)
        "off_policy": ["on_policy_1x1", "grpo_clip_2x1", "grpo_clip_2x2"],
        "clip_ablation": ["grpo_clip_2x2", "grpo_no_clip_2x2"],
        "prompt": ["r1_zero", "question_only"],
        "dynamic_sampling": ["dynamic_sampling_off", "dynamic_sampling_on"],
    }
    no_baseline, rwb = arms_of("baselines", script_args, training_args)
    assert rwb.settings == ref and no_baseline.settings == {**ref, "pg_loss_type": "no_baseline"}
    assert arms_of("std_normalization", script_args, training_args)[1].settings == {**ref, "normalize_by_std": False}
    assert arms_of("length_normalization", script_args, training_args)[1].settings == {
        **ref,
        "length_normalization": "masked_normalize",
    }
    # off-policy 'ExK': E epochs per rollout batch, a rollout batch of K train batches = K x gradient_accumulation_steps
    _, e2k1, e2k2 = arms_of("off_policy", script_args, training_args)
    assert (e2k1.settings["num_iterations"], e2k1.settings["steps_per_generation"]) == (2, 2)
    assert (e2k2.settings["num_iterations"], e2k2.settings["steps_per_generation"]) == (2, 4)
    clip, no_clip = arms_of("clip_ablation", script_args, training_args)
    assert clip.settings == e2k2.settings and no_clip.settings == {**e2k2.settings, "pg_loss_type": "grpo_no_clip"}
    assert [a.task for a in arms_of("prompt", script_args, training_args)] == ["r1_zero", "question_only"]
    off, on = arms_of("dynamic_sampling", script_args, training_args)
    assert off.settings == ref and on.settings == {**ref, "dynamic_sampling": True}


def test_arms_shared_between_experiments_have_one_key():
    script_args, training_args, _ = parse_ablations()
    key = lambda e, i: arm_key(arms_of(e, script_args, training_args)[i], training_args)  # noqa: E731
    reference = key("baselines", 1)
    # the reference arm under four more names, and on-policy GRPO-Clip (ratio 1: the same gradient)
    assert reference == key("std_normalization", 0) == key("length_normalization", 0) == key("learning_rate", 1)
    assert reference == key("off_policy", 0) == key("dynamic_sampling", 0)
    assert key("off_policy", 2) == key("clip_ablation", 0)
    keys = {arm_key(a, training_args) for e in ablations.EXPERIMENTS for a in arms_of(e, script_args, training_args)}
    assert len(keys) == 12  # what --experiment all trains


def test_run_comparison_reuses_a_cached_arm_without_training(tmp_path):
    _, training_args, _ = parse_ablations("--output_dir", str(tmp_path))
    arm = parse_arms([{"name": "again", **ablations.REFERENCE}])[0]
    cached = {"name": "first", "settings": {}, "task": None, "final_accuracy": 0.5, "curves": {}}
    cache = {arm_key(arm, training_args): cached}

    def load_model():
        raise AssertionError("a cached arm must not be trained again")

    [result] = run_comparison([arm], training_args, load_model, None, cache=cache, log=lambda m: None)
    assert result["name"] == "again" and result["final_accuracy"] == 0.5 and result["settings"] == arm.settings
    with pytest.raises(ValueError, match=r"arms use tasks \['question_only', 'r1_zero'\] that are not in tasks"):
        run_comparison(arms_of("prompt", *parse_ablations()[:2]), training_args, load_model, None)


def test_bad_options_fail_fast():
    with pytest.raises(ValueError, match="--experiment 'lr'"):
        parse_ablations("--experiment", "lr")
    with pytest.raises(ValueError, match="off-policy setting '2y2'"):
        parse_ablations("--clip_ablation_setting", "2y2")
    with pytest.raises(ValueError, match="expected E, K >= 1"):
        ablations.parse_setting("0x1")


@pytest.mark.parametrize("config", ["grpo_ablations_math.yaml", "grpo_ablations_gsm8k.yaml"])
def test_gpu_configs_hold_the_handout_hyperparameters(config, hub_has_every_repo):
    assert yaml.safe_load((grpo_ablations.DEFAULT_CONFIG.parent / config).read_text())["use_vllm"] is True
    script_args, training_args, model_args = parse_ablations(config=config)
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-Math-1.5B" and script_args.template == "r1_zero"
    assert training_args.max_steps == 200 and training_args.learning_rate == 1e-5
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256
    assert training_args.num_generations == 8 and training_args.max_grad_norm == 1.0
    assert (training_args.adam_beta1, training_args.adam_beta2) == (0.9, 0.95)


def test_expert_iteration_configs_parse(hub_has_every_repo):
    script_args, training_args, model_args = expert_iteration.main.parse_args([])
    assert model_args.model_name_or_path is None and script_args.num_eval == 200  # the main job's held-out set
    assert training_args.completion_only_loss and training_args.max_grad_norm == 1.0
    assert script_args.overwrite_output_dir is False  # RecipeArguments: the flag exists
    path = expert_iteration.DEFAULT_CONFIG.parent / "expert_iteration_math.yaml"
    script_args, training_args, model_args = expert_iteration.main.parse_args(
        ["--config", str(path), "--bf16", "false", "--use_vllm", "false"]  # bf16 needs a GPU here
    )
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-Math-1.5B" and script_args.template == "r1_zero"
    # layered over the CPU defaults, the GPU file must switch the CPU off itself
    assert training_args.use_cpu is False and script_args.ei_batch_size == 1024 and script_args.num_eval == 1024
    with pytest.raises(RecipeError, match="--num_generations 0: expected >= 2"):
        expert_iteration.main.parse_args(["--num_generations", "0"])
    with pytest.raises(RecipeError, match="--n_ei_steps=0; expected an integer >= 1"):
        expert_iteration.main.parse_args(["--n_ei_steps", "0"])


@pytest.mark.parametrize("config", ["grpo_ablations_math.yaml", "grpo_ablations_gsm8k.yaml"])
def test_gpu_ablation_configs_switch_the_cpu_off(config, hub_has_every_repo):
    _, training_args, _ = grpo_ablations.main.parse_args(
        ["--config", str(grpo_ablations.DEFAULT_CONFIG.parent / config), "--bf16", "false", "--use_vllm", "false"]
    )
    assert training_args.use_cpu is False  # the CPU defaults underneath say use_cpu: true


def test_expert_iteration_refuses_bad_options_and_resume_before_the_model(tmp_path, monkeypatch):
    def explode(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(trl_ext.models, "load_model_and_tokenizer", explode)  # the loader the recipe calls
    out = str(tmp_path / "out")
    with pytest.raises(RecipeError, match="expert iteration keeps no checkpoints.*cannot be resumed"):
        expert_iteration.main(
            *expert_iteration.main.parse_args(["--output_dir", out, "--resume_from_checkpoint", "true"])
        )
    with pytest.raises(RecipeError, match="--max_steps 5: the SFT length is set by --sft_epochs"):
        expert_iteration.main(*expert_iteration.main.parse_args(["--output_dir", out, "--max_steps", "5"]))
    # 3 steps x 16 questions drawn without replacement from 40 training problems
    with pytest.raises(
        RecipeError, match="--n_ei_steps 3 x --ei_batch_size 16 = 48 questions, but the training split has 40"
    ):
        expert_iteration.main(*expert_iteration.main.parse_args(["--output_dir", out, "--num_train_problems", "40"]))


def test_grpo_ablations_refuse_resume_and_a_step_budget_of_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(trl_ext.models, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
    with pytest.raises(RecipeError, match="cannot be resumed"):
        grpo_ablations.main(*parse_ablations("--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"))
    with pytest.raises(RecipeError, match=r"--max_steps -1: a comparison needs a fixed step budget"):
        grpo_ablations.main(*parse_ablations("--output_dir", str(tmp_path), "--max_steps", "-1"))


def test_grpo_ablations_run_experiments_one_by_one_into_one_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(trl_ext.models, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "comparison.json").write_text("{}")
    (tmp_path / "prompt").mkdir()
    (tmp_path / "prompt" / "comparison.json").write_text("{}")
    # 'all' redoes both finished experiments: refused, naming the first
    with pytest.raises(RecipeError, match=r"holds a finished run \(baselines/comparison.json\)"):
        grpo_ablations.main(*parse_ablations("--output_dir", str(tmp_path), "--experiment", "all"))
    with pytest.raises(RecipeError, match=r"holds a finished run \(prompt/comparison.json\)"):
        grpo_ablations.main(*parse_ablations("--output_dir", str(tmp_path), "--experiment", "prompt"))
    # another experiment may share the folder: it gets past the folder check (to the tokenizer, stubbed to fail)
    with pytest.raises(pytest.fail.Exception, match="tokenizer loaded"):
        grpo_ablations.main(*parse_ablations("--output_dir", str(tmp_path), "--experiment", "std_normalization"))
    # --overwrite_output_dir for 'all' removes every finished marker it will redo, so none survives a stopped run
    with pytest.raises(pytest.fail.Exception, match="tokenizer loaded"):
        grpo_ablations.main(
            *parse_ablations("--output_dir", str(tmp_path), "--experiment", "all", "--overwrite_output_dir")
        )
    assert (
        not (tmp_path / "baselines" / "comparison.json").exists()
        and not (tmp_path / "prompt" / "comparison.json").exists()
    )


def even_length_reward_fn(response, ground_truth):
    """Toy course reward: 1 for an even number of characters (a random tiny model gets about half)."""
    r = float(len(response) % 2 == 0)
    return {"reward": r, "format_reward": 1.0, "answer_reward": r}


@pytest.mark.slow
def test_expert_iteration_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    # filter and evaluation
    grader = dataclasses.replace(tasks.GRADERS.get("arithmetic"), reward_fn=even_length_reward_fn)
    monkeypatch.setitem(tasks.GRADERS._entries, "arithmetic", grader)  # the registry's entry
    out = tmp_path / "out"
    args = expert_iteration.main.parse_args(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(out),
            "--n_ei_steps",
            "2",
            "--num_generations",
            "4",
            "--ei_batch_size",
            "2",
            "--max_completion_length",
            "4",
            "--num_eval",
            "4",
            "--num_train_problems",
            "20",
            "--per_device_train_batch_size",
            "2",
            "--sft_epochs",
            "2",
            "--report_to",
            "none",
        ]
    )
    expert_iteration.main(*args)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_eval"] == 4 and len(metrics["ei_steps"]) == 2
    assert metrics["accuracy_after"] == metrics["ei_steps"][-1]["accuracy"]
    assert metrics["recipe"] == "expert_iteration" and metrics["config"]["script_args"]["n_ei_steps"] == 2  # provenance
    assert {"load_data", "load_model", "eval_before", "sample", "sft", "eval_steps", "save"} <= set(
        metrics["phase_seconds"]
    )
    for step in metrics["ei_steps"]:
        assert step["generated"] == 8 and step["questions"] == 2  # 2 questions x G = 4
        assert 0 < step["kept"] <= 8, "the toy reward keeps about half the samples"
        # one SFT epoch over the kept samples in batches of 2, twice (sft_epochs 2)
        assert step["sft_steps"] == 2 * math.ceil(step["kept"] / 2)
        # a random model over the 49152-token vocabulary is nearly uniform: entropy close to ln 49152 = 10.80 nats
        assert step["entropy"] == pytest.approx(math.log(49152), abs=0.1)
    # every SFT trainer profiled: its backward and optimizer rows timed, one optimizer row call per SFT step
    roofline = metrics["roofline"]
    assert all(row["ratio"] >= 1 for row in roofline["phases"].values())
    rows = {**roofline["phases"], **roofline["omitted"]}
    assert rows["backward"]["seconds"] > 0 and rows["optimizer"]["seconds"] > 0
    assert rows["optimizer"]["calls"] == sum(step["sft_steps"] for step in metrics["ei_steps"])
    assert {"generation_prefill", "generation_decode", "evaluation"} <= set(rows)  # sampling and held-out phases
    assert (out / "ei_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = (out / "experiment.md").read_text()
    assert "- trl_ext " in record and "git commit `" in record and "| n_ei_steps | 2 |" in record
    assert "![ei_curves](ei_curves.png)" in record
    # every stage of the loop is charged to a phase of the breakdown (sampling, filtering, entropy, SFT set-up and
    # training, evaluation, ...): what is left as "other" is the time outside every stage, not the loop's work
    breakdown, stages = metrics["time_breakdown"], metrics["phase_seconds"]
    assert {"model_load", "evaluation", "generation", "reward", "entropy", "sft", "sampler_setup", "save"} <= set(
        breakdown
    )
    assert {"filter", "entropy", "sft", "sampler_setup"} <= set(stages)
    timed = sum(v for k, v in stages.items() if k not in ("total", "load_data"))
    assert breakdown["other"] <= breakdown["total"] - timed + 0.1


@pytest.mark.slow
def test_grpo_ablations_baselines_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = parse_ablations(
        "--experiment",
        "baselines",
        "--model_name_or_path",
        tiny_model_dir,
        "--output_dir",
        str(out),
        "--max_steps",
        "2",
        "--eval_every",
        "1",
        "--num_eval",
        "4",
        "--num_train_problems",
        "16",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "4",
        "--report_to",
        "none",
    )
    grpo_ablations.main(*args, command="uv run accelerate launch recipes/grpo_ablations.py --experiment baselines")
    data = json.loads((out / "baselines" / "comparison.json").read_text())
    assert data["recipe"] == "grpo_ablations" and data["config"]["training_args"]["max_steps"] == 2  # provenance
    assert [a["name"] for a in data["arms"]] == ["no_baseline", "reinforce_with_baseline"]
    for arm in data["arms"]:
        assert arm["steps"] == 2 and [s for s, _ in arm["accuracy_curve"]] == [0, 1, 2]
        assert arm["n_eval"] == 4 and arm["final_accuracy_se"] == pytest.approx(
            math.sqrt(arm["final_accuracy"] * (1 - arm["final_accuracy"]) / 4)
        )
        assert {"reward", "entropy", "completions/mean_length", "grad_norm"} <= set(arm["curves"])
    assert data["arms"][0]["accuracy_curve"][0] == data["arms"][1]["accuracy_curve"][0]  # one shared step-0 evaluation
    assert data["setup"]["held-out problems"] == 4 and data["setup"]["code"].startswith("trl_ext ")
    assert "git commit `" in data["setup"]["code"] and data["versions"]["trl_ext_git"]["commit"]
    assert (out / "baselines" / "comparison.png").stat().st_size > 10_000
    record = (out / "baselines" / "experiment.md").read_text()
    assert "GRPO ablation: baselines" in record and "| no_baseline |" in record and "dirty:" in record
    # the step-0 records, written before any arm trained: one per held-out row, scored by the task's judge
    rows = [json.loads(line) for line in (out / "baselines" / "eval_before.jsonl").read_text().splitlines()]
    assert (
        len(rows) == 4 and [r["answer_reward"] for r in rows].count(1.0) / 4 == data["arms"][0]["accuracy_curve"][0][1]
    )
    task = tasks.load_task(args[0], max_new_tokens=4)
    assert all(task.score(r["response"], {"answer": r["answer"]})["reward"] == r["reward"] for r in rows)
    # the random tiny model earns no reward on two-digit additions: said before training, and by the record
    if all(r["reward"] == 0 for r in rows):
        assert any(str(out / "baselines" / "eval_before.jsonl") in w for w in data["warnings"])
    every_reward_zero = all(
        v == 0 and dict(arm["curves"]["reward_std"])[s] == 0 for arm in data["arms"] for s, v in arm["curves"]["reward"]
    )
    assert ("No arm trained: every reward was 0" in record) == every_reward_zero
    if every_reward_zero:
        assert "within noise" not in record and "Best final" not in record


def test_report_lists_finished_experiments_with_standard_errors_and_what_is_missing(tmp_path):
    arms = [
        {
            "name": "no_baseline",
            "final_accuracy": 0.46,
            "final_accuracy_se": math.sqrt(0.46 * 0.54 / 100),
            "n_eval": 100,
        }
    ]
    path = ablations.write_report(tmp_path, [("baselines", arms)], ["prompt"], "uv run x")
    text = path.read_text()
    assert "Not run yet: prompt." in text and "![baselines](baselines/comparison.png)" in text
    assert "- no_baseline: 46.0% ± 5.0 (100 held-out problems)" in text  # sqrt(0.46 * 0.54 / 100) = 0.0498


def _arm(name, accuracy, rewards, stds, n=100):
    return {
        "name": name,
        "final_accuracy": accuracy,
        "n_eval": n,
        "curves": {
            "reward": [[s + 1, r] for s, r in enumerate(rewards)],
            "reward_std": [[s + 1, v] for s, v in enumerate(stds)],
        },
    }


def test_arms_that_never_saw_a_reward_are_not_compared_as_noise():
    # two arms whose every reward was 0 at every step (mean 0 and std 0): not "within noise" of each other
    both = [
        _arm("no_baseline", 0.09, [0.0] * 6, [0.0] * 6),
        _arm("reinforce_with_baseline", 0.09, [0.0] * 6, [0.0] * 6),
    ]
    notes = ablations.observations(both)
    assert notes[0].startswith("No arm trained: every reward was 0 (every completion of every step of all 2 arms)")
    assert not any("noise" in n or "Best" in n for n in notes)
    # one arm trained (a nonzero reward at step 3), the other never did: said per arm, the trained gap compared
    mixed = [
        _arm("a", 0.40, [0.0, 0.0, 0.125, 0.25], [0.0, 0.0, 0.33, 0.45]),
        _arm("b", 0.09, [0.0] * 4, [0.0] * 4),
        _arm("c", 0.35, [0.0, 0.125, 0.0, 0.0], [0.0, 0.33, 0.0, 0.0]),
    ]
    notes = ablations.observations(mixed)
    assert notes[0] == "Best final held-out accuracy: a (40.0% on 100 problems)."
    assert notes[1] == (
        "b: did not train: every reward was 0 in its 4 logged steps, so its loss had no learning signal: its 9.0% "
        "measures the initial model, not its setting."
    )
    # c: 5 points below a; SE of the gap sqrt(.4 * .6 / 100 + .35 * .65 / 100) = 0.0683 -> 0.7 SE, within noise
    assert notes[2] == "c: 35.0%, 5.0 points below (0.7 SE of the gap): within noise (<= 2 standard errors)."
    # a mean reward of 0 from rewards of both signs is not "every reward 0": std > 0
    assert not ablations.never_rewarded(_arm("d", 0.1, [0.0, 0.0], [0.0, 1.0]))
    assert not ablations.never_rewarded({"curves": {"reward": [[1, 0.0]]}})  # no std logged: cannot say
