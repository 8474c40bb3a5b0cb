"""trl_ext.compare: arm parsing and configs, summaries with hand-worked values, peak memory, reports, end to end."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch
import trl
from conftest import length_mod5_reward
from datasets import Dataset

import trl_ext
from trl_ext.compare import (
    ARM_PRESETS,
    TRAINERS,
    TRL_ADVANTAGE_EPS,
    TRL_UPDATE_FIELDS,
    Arm,
    PeakMemory,
    arm_config,
    comparison_table,
    metric_curve,
    parse_arms,
    run_comparison,
    summarize_arm,
    trl_defaults,
    trl_ext_at_trl_defaults,
    write_comparison,
)
from trl_ext.rewards import gsm8k_reward_fn
from trl_ext.tasks import Task

BASE = dict(
    use_cpu=True,
    bf16=False,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    learning_rate=1e-2,
    max_steps=2,
    seed=0,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
)


# ---------------------------------------------------------------------------------------------------------- arms
def test_parse_arms_presets_mappings_and_json():
    arms = parse_arms(
        [
            "trl",
            {"name": "lr_high", "preset": "course", "learning_rate": 5e-5},
            '{"name": "plain", "normalize_by_std": false}',
        ]
    )
    assert [a.name for a in arms] == ["trl", "lr_high", "plain"]
    assert arms[0].trainer == "trl" and arms[0].settings == {
        k: v for k, v in ARM_PRESETS["trl"].items() if k != "trainer"
    }
    assert arms[1].trainer == "trl_ext" and arms[1].settings["learning_rate"] == 5e-5
    assert arms[1].settings["normalize_by_std"] is True  # from the preset
    assert arms[2] == Arm("plain", "trl_ext", {"normalize_by_std": False})


@pytest.mark.parametrize(
    "specs, message",
    [
        (["nope"], "unknown preset 'nope'"),
        ([{"preset": "course"}], "mapping with a 'name'"),
        (["trl", "trl"], r"repeated: \['trl'\]"),
        ([{"name": "u", "trainer": "trl", "loss_type": "grpo"}], r"missing \['scale_rewards', 'beta', 'epsilon'\]"),
        ([{"name": "o", "preset": "course", "loss_type": "dr_grpo"}], "TRL.s names for length_normalization"),
        ([{"name": "o", "normalise_by_std": False}], r"\['normalise_by_std'\] are not fields"),
        ([{"name": "u", "trainer": "trl", "normalize_by_std": False}], "are not fields of trl"),
        ([{"name": "a b"}], "without spaces"),
        (['{"name": "x",'], "invalid JSON"),
        ([], "at least one arm"),
    ],
)
def test_parse_arms_rejects(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_arms(specs)


def test_arm_config_carries_shared_settings(tmp_path):
    base = trl.GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False, steps_per_generation=2, **BASE)
    upstream, course, dr = (arm_config(base, a) for a in parse_arms(["trl_grpo", "course", "dr_grpo"]))
    assert type(upstream) is trl.GRPOConfig and type(course) is trl_ext.GRPOConfig
    for config, name in ((upstream, "trl_grpo"), (course, "course"), (dr, "dr_grpo")):
        assert config.output_dir == str(tmp_path / name) and config.run_name == name
        assert config.learning_rate == 1e-2 and config.max_steps == 2 and config.seed == 0
        assert config.steps_per_generation == 2 and config.generation_batch_size == 8
        assert config.activation_checkpointing is False
    assert (upstream.loss_type, upstream.scale_rewards, upstream.beta, upstream.epsilon) == ("grpo", "group", 0.0, 0.2)
    assert (course.loss_type, course.scale_rewards) == ("grpo", "group")
    assert (dr.loss_type, dr.scale_rewards, dr.normalize_by_std) == ("dr_grpo", "none", False)


# Issue 41: what a TRL user expects, the fields that decide the update at their TRL 1.16 defaults (an unchanged
# trl.GRPOConfig: the DAPO token mean, std scaling, no KL, clip 0.2, one pass over each batch, gradient checkpointing)
TRL_1_16_DEFAULTS = dict(
    loss_type="dapo",
    scale_rewards="group",
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    num_iterations=1,
    mask_truncated_completions=False,
    top_entropy_quantile=1.0,
    importance_sampling_level="token",
    use_bias_correction_kl=True,
    activation_checkpointing=True,
)


def test_trl_preset_is_an_unchanged_trl_config(tmp_path):
    """The ``trl`` preset holds, for each field of TRL_UPDATE_FIELDS, what ``trl.GRPOConfig()`` itself resolves to
    (an instance, through transformers' alias gradient_checkpointing -> activation_checkpointing; the preset reads
    the dataclass defaults); and an arm built from it keeps them over a shared config that sets some otherwise."""
    plain = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    preset = ARM_PRESETS["trl"]
    assert preset["trainer"] == "trl" and set(preset) - {"trainer"} == set(TRL_UPDATE_FIELDS)
    for name in TRL_UPDATE_FIELDS:
        assert preset[name] == getattr(plain, name), name
    assert trl_defaults() == {k: v for k, v in preset.items() if k != "trainer"}
    if trl.__version__ == "1.16.0":
        assert trl_defaults() == TRL_1_16_DEFAULTS
    # the shared config turns checkpointing off and changes the comparison's own settings: the arm keeps TRL's
    base = trl.GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False, **BASE)
    config = arm_config(base, parse_arms(["trl"])[0])
    for name in TRL_UPDATE_FIELDS:
        assert getattr(config, name) == getattr(plain, name), name
    assert config.gradient_checkpointing is True  # the deprecated alias mirrors it
    assert config.learning_rate == 1e-2 and config.max_steps == 2  # the comparison's, not TRL's 1e-6


def test_trl_ext_preset_is_the_same_settings_in_the_course_names(tmp_path):
    """``trl_ext`` is trl_ext.GRPOTrainer at TRL's defaults: TRL's loss_type/scale_rewards in their course names, and
    TRL's advantage eps (1e-4, hard-coded in trl.GRPOTrainer), every other field of the upstream preset as is."""
    base = trl.GRPOConfig(output_dir=str(tmp_path), gradient_checkpointing=False, **BASE)
    upstream, ours = (arm_config(base, a) for a in parse_arms(["trl", "trl_ext"]))
    assert type(ours) is trl_ext.GRPOConfig
    for name in TRL_UPDATE_FIELDS:  # loss_type and scale_rewards derived back from the course names
        assert getattr(ours, name) == getattr(upstream, name), name
    assert (ours.pg_loss_type, ours.length_normalization, ours.normalize_by_std) == ("grpo_clip", "token_mean", True)
    assert ours.advantage_eps == TRL_ADVANTAGE_EPS == 1e-4
    # a default TRL changes is carried over, in the names the loss registry gives it
    assert trl_ext_at_trl_defaults({"loss_type": "bnpo", "scale_rewards": False, "beta": 0.04}) == {
        "pg_loss_type": "grpo_clip",
        "advantage_eps": 1e-4,
        "length_normalization": "local_token_mean",
        "normalize_by_std": False,
        "beta": 0.04,
    }
    settings = trl_ext_at_trl_defaults({**TRL_1_16_DEFAULTS, "loss_type": "cispo"})  # TRL's CISPO: its own loss
    config = arm_config(base, Arm("x", "trl_ext", settings))
    assert (config.pg_loss_type, config.length_normalization, config.loss_type) == ("cispo", "token_mean", "cispo")
    with pytest.raises(ValueError, match="loss_type"):  # a value TRL does not have either
        arm_config(base, Arm("x", "trl_ext", trl_ext_at_trl_defaults({**TRL_1_16_DEFAULTS, "loss_type": "nope"})))


def test_the_two_arms_at_trls_defaults_compute_the_same_loss(tokenizer, tiny_model_dir, tmp_path):
    """Issue 41: upstream and trl_ext at TRL's defaults (gradient checkpointing on, as Trainer.train() turns it on)
    sample the same completions and give the same advantages (TRL's eps: 1e-6 would move them by ~1e-4 here), loss
    and gradients -- with old log-probs perturbed so that the clip acts."""
    from test_grpo_trainer import generation_batch, independent_log_probs, loss_and_grads, perturb_for_clipping

    from trl_ext.speed.shared_prompts import activation_checkpointing

    base = trl.GRPOConfig(
        output_dir=str(tmp_path), gradient_checkpointing=False, **{**BASE, "temperature": 1.5, "max_steps": 1}
    )
    trainers = []
    for arm in parse_arms(["trl", "trl_ext"]):
        config = arm_config(base, arm)
        assert config.activation_checkpointing and config.loss_type == "dapo"  # TRL's, over the shared config's
        tok = copy.deepcopy(tokenizer)
        tok.padding_side = "left"
        trainer = TRAINERS[arm.trainer][0](
            model=tiny_model_dir,
            reward_funcs=length_mod5_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": ["Count to 5:"] * 4}),
            processing_class=tok,
        )
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs)
        assert activation_checkpointing(trainer.model)
        trainers.append(trainer)
    ref, ext = trainers
    batch_ref, batch_ext = generation_batch(ref), generation_batch(ext)
    assert torch.equal(batch_ext["completion_ids"], batch_ref["completion_ids"])  # same seed, same samples
    assert batch_ref["advantages"].abs().max() > 0.1, "the toy batch should have distinct rewards"
    torch.testing.assert_close(batch_ext["advantages"], batch_ref["advantages"], atol=1e-6, rtol=1e-6)
    inputs = dict(batch_ref)
    with torch.no_grad():  # num_iterations=1 keeps no old log-probs: give both the same, off by up to +-0.6
        inputs["old_per_token_logps"] = independent_log_probs(ref.model, inputs, 1.5)
    inputs = perturb_for_clipping(inputs)
    loss_ext, grads_ext = loss_and_grads(ext, dict(inputs))
    loss_ref, grads_ref = loss_and_grads(ref, dict(inputs))
    assert loss_ref.abs() > 1e-3
    torch.testing.assert_close(loss_ext, loss_ref, atol=1e-6, rtol=1e-5)
    assert grads_ext.keys() == grads_ref.keys() and grads_ref
    for name in grads_ref:
        torch.testing.assert_close(grads_ext[name], grads_ref[name], atol=1e-6, rtol=1e-4, msg=name)
    assert ext._metrics["train"]["clip_ratio/region_mean"][-1] > 0, "the perturbation should clip some tokens"
    assert ext._metrics["train"]["clip_ratio/region_mean"][-1] == pytest.approx(
        ref._metrics["train"]["clip_ratio/region_mean"][-1], abs=1e-6
    )


def test_arm_config_rejects_shared_loss_type(tmp_path):
    base = trl.GRPOConfig(output_dir=str(tmp_path), loss_type="grpo", **BASE)
    with pytest.raises(ValueError, match="shared config sets loss_type='grpo'; set it per arm"):
        arm_config(base, parse_arms(["course"])[0])


# ------------------------------------------------------------------------------------------------------ summaries
def test_metric_curve_skips_missing_and_nan():
    history = [{"step": 1, "reward": 0.5}, {"step": 2}, {"step": 3, "reward": float("nan")}, {"step": 4, "reward": 1}]
    assert metric_curve(history, "reward") == [(1, 0.5), (4, 1.0)]


def test_summarize_arm_hand_worked():
    history = [
        {"step": s, "reward": r, "entropy": 2.0 - s / 10} for s, r in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 1)
    ]
    history.append({"step": 6, "train_runtime": 10.0})
    evals = [
        {"step": 20, "accuracy": 0.4},
        {"step": 0, "accuracy": 0.1},
        {"step": 10, "accuracy": 0.5},
        {"step": 15, "accuracy": 0.5},
    ]
    arm = Arm("a", "trl_ext", {"normalize_by_std": False})
    s = summarize_arm(
        arm,
        history,
        [3.0, 1.0, 2.0, 10.0],
        evals,
        generated_tokens=300,
        generation_seconds=1.5,
        peak_memory_bytes=2**30,
        memory_kind="rss_peak",
        train_seconds=16.0,
    )
    assert s["final_accuracy"] == 0.4  # last evaluated step (20), not the last in the list order
    assert (s["best_accuracy"], s["best_step"]) == (0.5, 10)  # the first of the tied best
    assert s["accuracy_curve"] == [[0, 0.1], [10, 0.5], [15, 0.5], [20, 0.4]]
    assert s["median_step_seconds"] == 2.5  # median of 1, 2, 3, 10
    assert s["final_reward"] == pytest.approx(0.4)  # mean of the last 5 rewards 0.2..0.6
    assert s["gen_tokens_per_second"] == 200.0
    assert s["steps"] == 4 and s["settings"] == {"normalize_by_std": False}
    assert s["curves"]["entropy"][0] == [1, pytest.approx(1.9)]
    assert "completions/mean_length" not in s["curves"]  # never logged
    empty = summarize_arm(arm, [], [], [])
    assert (
        empty["final_accuracy"] is None
        and empty["median_step_seconds"] is None
        and empty["gen_tokens_per_second"] is None
    )


def test_accuracy_against_training_seconds_and_the_time_to_a_gain():
    """Each evaluation at step k sits at the seconds of steps 1..k; the time to +55 points is the first such
    point at least 55 points over step 0, whatever comes later."""
    from trl_ext.compare.report import seconds_to_gain

    arm = Arm("a", "trl_ext", {})
    evals = [
        {"step": 0, "accuracy": 0.09},
        {"step": 2, "accuracy": 0.50},
        {"step": 3, "accuracy": 0.64},
        {"step": 4, "accuracy": 0.60},
    ]
    s = summarize_arm(arm, [], [4.0, 5.0, 6.5, 3.0], evals)
    assert s["accuracy_by_seconds"] == [[0, 0.09], [9.0, 0.5], [15.5, 0.64], [18.5, 0.6]]
    assert seconds_to_gain(s, 0.55) == 15.5  # 0.64 - 0.09 = 0.55 at step 3
    assert seconds_to_gain(s, 0.56) is None  # never 56 points over step 0
    assert seconds_to_gain(summarize_arm(arm, [], [4.0], [{"step": 1, "accuracy": 0.9}]), 0.1) is None  # no step 0


def test_time_to_upstream_final_gain_on_the_wall_and_cpu_clocks():
    """Upstream's final gain is its last evaluation over its step 0 (+0.30 here, reached first at step 4: 12 wall s,
    22 CPU s); trl_ext reaches +0.30 over its own step 0 at step 2 (3 wall s, 5 CPU s): ratios 3/12 and 5/22; an arm
    that never gets there has no time and no ratio."""
    from trl_ext.compare.report import time_to_gain_table, time_to_reference_gain

    upstream_settings = {"loss_type": "dapo", "scale_rewards": "group", "beta": 0.0, "epsilon": 0.2}

    def arm(name, trainer, wall, cpu, accuracies):
        evals = [{"step": step, "accuracy": a} for step, a in zip((0, 2, 4, 6), accuracies)]
        settings = upstream_settings if trainer == "trl" else {}
        return summarize_arm(Arm(name, trainer, settings), [], wall, evals, step_cpu_seconds=cpu)

    ours = arm(
        "trl_ext", "trl_ext", [1.0, 2.0, 2.0, 2.0, 1.0, 1.0], [2.0, 3.0, 4.0, 4.0, 2.0, 2.0], [0.1, 0.4, 0.5, 0.5]
    )
    upstream = arm("trl", "trl", [3.0] * 6, [5.0, 6.0, 5.0, 6.0, 5.0, 5.0], [0.1, 0.2, 0.4, 0.4])
    flat = arm("flat", "trl_ext", [1.0] * 6, [1.0] * 6, [0.1, 0.1, 0.2, 0.1])
    assert ours["accuracy_by_cpu_seconds"] == [[0, 0.1], [5.0, 0.4], [13.0, 0.5], [17.0, 0.5]]
    assert ours["median_step_cpu_seconds"] == 2.5
    out = time_to_reference_gain([ours, upstream, flat])  # the reference is the upstream arm, wherever it is
    assert out["reference"] == "trl" and out["gain"] == pytest.approx(0.3)
    rows = {a["name"]: a for a in out["arms"]}
    assert (rows["trl"]["wall_seconds"], rows["trl"]["cpu_seconds"]) == (12.0, 22.0)
    assert (rows["trl_ext"]["wall_seconds"], rows["trl_ext"]["cpu_seconds"]) == (3.0, 5.0)
    assert rows["trl_ext"]["wall_ratio"] == pytest.approx(3 / 12) and rows["trl_ext"]["cpu_ratio"] == pytest.approx(
        5 / 22
    )
    assert rows["trl"]["wall_ratio"] == 1.0 and rows["trl_ext"]["gain"] == pytest.approx(0.4)
    assert rows["flat"]["wall_seconds"] is None and rows["flat"]["cpu_ratio"] is None
    table = time_to_gain_table(out)
    assert "| trl_ext | trl_ext | +40.0 | 3.0 | 0.250 | 5.0 | 0.227 |" in table.splitlines()
    assert "| flat | trl_ext | +0.0 | n/a | n/a | n/a | n/a |" in table.splitlines()
    # a reference that did not gain: nothing to reach, said so; no arm evaluated at step 0: None
    lost = time_to_reference_gain([arm("trl", "trl", [1.0] * 6, [1.0] * 6, [0.3, 0.2, 0.2, 0.2]), ours])
    assert lost["gain"] == pytest.approx(-0.1) and lost["arms"] == []
    assert "did not gain (-10.0 points)" in time_to_gain_table(lost)
    assert (
        time_to_reference_gain(
            [summarize_arm(Arm("a", "trl", upstream_settings), [], [1.0], [{"step": 1, "accuracy": 0.5}])]
        )
        is None
    )


def test_comparison_table_rows():
    arm = Arm("course", "trl_ext", {"beta": 0.0})
    s = summarize_arm(
        arm,
        [{"step": 1, "reward": 0.25}],
        [2.0],
        [{"step": 0, "accuracy": 0.1}, {"step": 5, "accuracy": 0.375}],
        generated_tokens=50,
        generation_seconds=2.0,
        peak_memory_bytes=3 * 2**29,
    )
    table = comparison_table([s])
    assert table.splitlines()[2] == "| course | trl_ext | 37.5% | 37.5% (5) | 0.250 | 2.00 | 1.50 | 25.0 | beta=0.0 |"


def test_peak_memory_sees_a_temporary_allocation():
    meter = PeakMemory(device="cpu").start()
    block = np.ones(25_000_000)  # 200 MB, touched
    del block
    with_block = meter.stop()
    meter.start()
    without = meter.stop()
    assert meter.kind in ("rss_peak", "rss_sampled")
    assert with_block - without > 180e6


def test_write_comparison_files(tmp_path):
    arms = parse_arms(["trl", "course"])
    results = [
        summarize_arm(
            a,
            [{"step": s, "reward": s / 10, "entropy": 1.0, "completions/mean_length": 5.0} for s in (1, 2, 3)],
            [1.0, 1.0, 1.0],
            [{"step": 0, "accuracy": 0.1}, {"step": 3, "accuracy": 0.2 + i / 10}],
        )
        for i, a in enumerate(arms)
    ]
    paths = write_comparison(results, tmp_path, {"model": "tiny", "steps per arm": 3}, title="t", command="uv run x")
    data = json.loads(paths["json"].read_text())
    assert data["setup"] == {"model": "tiny", "steps per arm": 3}
    assert [a["final_accuracy"] for a in data["arms"]] == [0.2, pytest.approx(0.3)]
    md = paths["md"].read_text()
    assert "    uv run x" in md and "| trl | trl | 20.0% |" in md and "![comparison](comparison.png)" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------ monitoring helpers
def test_a_tasks_first_reward_function_adds_each_completions_scores_to_trls_table():
    """Task.reward_funcs[0] hands TRL's log_extra the three scores and the answer of every completion, as the task
    scores them; the other functions add nothing (every function's columns go to the same table)."""
    rows = Dataset.from_dict({"prompt": ["1+1?", "2+3?"], "answer": ["2", "5"]})
    task = Task(name="t", train=rows, test=rows, scorer=lambda r, row: gsm8k_reward_fn(r, row["answer"]))
    task.rewards = (("t_reward", "reward"), ("t_exact", "answer_reward"))
    extra: dict = {}

    def log_extra(column, values):
        extra.setdefault(column, []).extend(values)

    first, second = task.reward_funcs
    kwargs = dict(prompts=["1+1?", "2+3?"], completions=["It is 2", "six"], answer=["2", "5"], log_extra=log_extra)
    assert first(**kwargs) == [1.0, 0.0]
    assert extra == {
        "reward": [1.0, 0.0],
        "format_reward": [1.0, 0.0],
        "answer_reward": [1.0, 0.0],
        "answer": ["2", "5"],
    }
    assert second(**kwargs) == [1.0, 0.0] and len(extra["reward"]) == 2  # nothing added by the second function


class _Logs:
    """A trainer holding a TRL 1.16-shaped completions table (``_logs``) of 6 completions."""

    def __init__(self):
        from collections import defaultdict, deque

        self._logs = {
            "prompt": deque([f"p{i}" for i in range(6)]),
            "completion": deque([[{"role": "assistant", "content": f"c{i}"}] for i in range(6)]),
            "rewards": defaultdict(deque, {"t_reward": deque([0.0, 1.0, 0.0, 1.0, float("nan"), 0.0])}),
            "advantages": deque([-0.5, 0.5, -0.5, 0.5, 0.0, -1.0]),
            "extra": defaultdict(deque, {"reward": deque([0.0, 1.0, 0.0, 1.0, None, 0.0]), "answer": deque("abcdef")}),
        }


def test_rollout_log_keeps_samples_spread_over_the_batch_of_each_step_that_generated(tmp_path):
    from types import SimpleNamespace

    from trl_ext.compare.monitoring import RolloutLog

    trainer, path = _Logs(), tmp_path / "rollouts.jsonl"
    trainer.add_callback = lambda cb: None
    log = RolloutLog(path, samples=4).attach(trainer)
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0, is_world_process_zero=True)
    log.on_train_begin(None, state, None)
    state.global_step, state.num_input_tokens_seen = 1, 40  # step 1 generated
    log.on_step_end(None, state, None)
    state.global_step = 2  # step 2 trained on the same rollouts (num_input_tokens_seen unchanged): no rows
    log.on_step_end(None, state, None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["p0", "p1", "p3", "p4"]  # rows i * 6 // 4 for i < 4
    assert rows[1] == {
        "step": 1,
        "prompt": "p1",
        "response": "c1",
        "reward": 1.0,
        "answer": "b",
        "rewards": {"t_reward": 1.0},
        "advantage": 0.5,
    }
    assert rows[3]["reward"] is None and rows[3]["rewards"] == {"t_reward": None}  # TRL's NaN: no score
    # a run resumed from step 1 keeps step 1's rows; a fresh run (step 0) starts the file anew
    path.write_text(path.read_text() + json.dumps({"step": 2, "prompt": "lost"}) + "\n")
    state.global_step = 1
    log.on_train_begin(None, state, None)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 1, 1]
    state.global_step = 0
    log.on_train_begin(None, state, None)
    assert path.read_text() == ""


def test_arm_monitor_evaluates_every_n_steps_but_the_last_when_asked():
    from trl_ext.compare import ArmMonitor

    monitor = ArmMonitor(lambda model: {"accuracy": 0.5}, eval_every=2, skip_last=True)
    assert [s for s in range(1, 7) if monitor.due(s, 6)] == [2, 4]
    monitor = ArmMonitor(lambda model: {"accuracy": 0.5}, [3], eval_every=2)
    assert [s for s in range(1, 7) if monitor.due(s, 6)] == [2, 3, 4, 6]
    assert not ArmMonitor(None, [1]).due(1, 2)  # nothing to evaluate with


# ---------------------------------------------------------------------------------------------------- end to end
def test_run_comparison_tiny_model_two_arms(tiny_model, tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tok = copy.deepcopy(tokenizer)

    def load_model():
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir), copy.deepcopy(tok), None

    train = Dataset.from_dict({"prompt": [f"Count to {i}:" for i in range(8)]})
    test = Dataset.from_dict({"prompt": ["What is 1 + 1?", "What is 2 + 3?"], "answer": ["2", "5"]})

    def score(response, row):
        # one judge: trains on length mod 5 (a random model varies), held-out accuracy is the GSM8K answer check
        answer = gsm8k_reward_fn(response, row["answer"])["answer_reward"] if "answer" in row else 0.0
        return {"reward": length_mod5_reward([response])[0], "format_reward": 1.0, "answer_reward": answer}

    task = Task(
        name="gsm8k",
        train=train,
        test=test,
        scorer=score,
        dataset="toy",
        source="toy",
        description="toy",
        max_new_tokens=4,
    )
    base = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        logging_steps=1,
        temperature=1.5,
        gradient_checkpointing=False,
        log_completions=True,
        **{**BASE, "report_to": "tensorboard"},
    )
    results = run_comparison(
        parse_arms(["trl", "course"]),
        base,
        load_model,
        task,
        tok,
        [0, 2],
        curve_keys=("reward", "heldout/accuracy"),
        log=lambda m: None,
    )
    assert [r["name"] for r in results] == ["trl", "course"]
    for r in results:
        assert r["steps"] == 2 and r["median_step_seconds"] > 0
        assert [s for s, _ in r["accuracy_curve"]] == [0, 2]
        assert r["generated_tokens"] > 0 and r["gen_tokens_per_second"] > 0
        assert r["peak_memory_bytes"] > 0
        assert [s for s, _ in r["curves"]["reward"]] == [1, 2]
        assert r["curves"]["heldout/accuracy"] == [r["accuracy_curve"][1]]  # logged with TRL's metrics at step 2
        arm_dir = tmp_path / "out" / r["name"]
        assert list(arm_dir.rglob("events.out.tfevents.*")), "tensorboard logs expected"
        tables = sorted(arm_dir.glob("completions/completions_*.parquet"))  # TRL's completions table, one per log
        assert [t.name for t in tables] == ["completions_00001.parquet", "completions_00002.parquet"]
        assert len(pd.read_parquet(tables[0])) == 4  # 4 completions per step
    # same seed, same initial model, same prompts: the first rollout batch (and its reward) is identical
    assert results[0]["curves"]["reward"][0] == results[1]["curves"]["reward"][0]
    assert results[0]["accuracy_curve"][0] == results[1]["accuracy_curve"][0]  # the shared step-0 evaluation
