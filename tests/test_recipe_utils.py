"""What every recipe shares (trl_ext.recipe_utils): config layering, flag errors in the user's words, --help, the
output-folder rules, resume resolution, the cached before-evaluation, metrics.json provenance, and the order
"options, folder, data, then the model" in every recipe (checked by making the model loader explode)."""

import json
import sys
from pathlib import Path

import pytest
import trl
import yaml

from conftest import load_recipe
from trl_ext.data import load_math_dataset
from trl_ext.data.instructions import load_instruction_rows
from trl_ext.data.preferences import load_preference_rows
from trl_ext.recipe_utils import (
    RecipeError,
    RecipeRun,
    check_model_source,
    check_output_dir,
    recipe_main,
    resolve_resume,
    resume_command,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))  # compare_upstream imports grpo_math
grpo_math = load_recipe("grpo_math")
CPU_DEFAULTS = yaml.safe_load(grpo_math.DEFAULT_CONFIG.read_text())


# ------------------------------------------------------------------------------------------- parsing
def test_user_config_is_layered_over_the_recipe_defaults_and_flags_win(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("max_steps: 3\nnum_eval: 7\nlearning_rate: 1.0e-4\n")
    script_args, training_args, _ = grpo_math.parse_args(["--config", str(user), "--learning_rate", "3e-5"])
    assert training_args.max_steps == 3 and script_args.num_eval == 7  # from the user's file
    assert training_args.learning_rate == 3e-5  # the flag beats the file
    # everything the file does not set keeps the recipe's default, not TRL's dataclass default
    assert training_args.max_completion_length == CPU_DEFAULTS["max_completion_length"] == 20  # TRL: 256
    assert training_args.per_device_train_batch_size == CPU_DEFAULTS["per_device_train_batch_size"] == 16  # TRL: 8
    assert training_args.use_cpu is True and training_args.bf16 is False
    assert script_args.instruction == CPU_DEFAULTS["instruction"]


def test_trl_names_of_a_course_setting_replace_it_in_lower_layers(tmp_path):
    def settings(argv):
        args = grpo_math.parse_args(argv)[1]
        return args.length_normalization, args.normalize_by_std, args.loss_type, args.scale_rewards

    # the recipe's defaults set the course names (length_normalization: masked_mean, normalize_by_std: true)
    assert (CPU_DEFAULTS["length_normalization"], CPU_DEFAULTS["normalize_by_std"]) == ("masked_mean", True)
    assert settings([]) == ("masked_mean", True, "grpo", "group")
    # a flag with TRL's name beats the files, as any flag does (either spelling of a flag)
    assert settings(["--loss_type", "dr_grpo"]) == ("masked_normalize", True, "dr_grpo", "group")
    assert settings(["--loss_type=dr_grpo", "--scale_rewards", "false"]) == ("masked_normalize", False, "dr_grpo", "none")
    # a --config file with TRL's name beats the recipe's defaults; a flag with the course name beats that file
    user = tmp_path / "mine.yaml"
    user.write_text("loss_type: dr_grpo\nscale_rewards: none\n")
    assert settings(["--config", str(user)]) == ("masked_normalize", False, "dr_grpo", "none")
    assert settings(["--config", str(user), "--length_normalization", "masked_mean"]) == ("masked_mean", False, "grpo", "none")
    # both names in one layer are both given: they must agree
    with pytest.raises(RecipeError, match="loss_type='dr_grpo' conflicts with length_normalization='masked_mean'"):
        settings(["--loss_type", "dr_grpo", "--length_normalization", "masked_mean"])
    user.write_text("loss_type: dr_grpo\nlength_normalization: masked_mean\n")
    with pytest.raises(RecipeError, match="loss_type='dr_grpo' conflicts with length_normalization='masked_mean'"):
        settings(["--config", str(user)])


@pytest.mark.parametrize("flag, module", [("use_vllm", "vllm"), ("use_liger_kernel", "liger_kernel")])
def test_a_gpu_engine_flag_without_its_package_stops_before_the_model(flag, module):
    import importlib.util

    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(RecipeError, match=f"--{flag} true needs the '{module}' package: install the GPU extra"):
        grpo_math.parse_args([f"--{flag}", "true"])


def test_unknown_option_in_a_config_file_names_the_file(tmp_path):
    user = tmp_path / "typo.yaml"
    user.write_text("max_step: 3\n")
    with pytest.raises(RecipeError, match=rf"unknown option\(s\) 'max_step' \(from {user}\)"):
        grpo_math.parse_args(["--config", str(user)])
    with pytest.raises(RecipeError, match="--config .*nope.yaml: no such file"):
        grpo_math.parse_args(["--config", str(tmp_path / "nope.yaml")])


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
        grpo_math.parse_args(flags)


def test_valid_grouping_passes():
    _, training_args, _ = grpo_math.parse_args(["--num_generations", "4", "--per_device_train_batch_size", "12"])
    assert training_args.generation_batch_size == 12  # 3 groups of 4


def test_help_starts_with_the_recipe_usage_and_its_own_options():
    from trl_ext.recipe_utils import build_parser

    text = build_parser(
        (grpo_math.MathScriptArguments, trl_ext_grpo_config(), trl.ModelConfig), grpo_math.DEFAULT_CONFIG, grpo_math.__doc__
    ).format_help()
    assert text.index("usage:") < text.index("GRPO on math problems") < text.index("  --config FILE")
    own, trl_group = text.index("recipe options (MathScriptArguments)"), text.index("trl_ext.GRPOConfig options")
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
    def main(*args):
        raise RecipeError("--dataset_name x.jsonl line 3: invalid JSON (Expecting value)")

    with pytest.raises(SystemExit) as exit_info:
        recipe_main(main, lambda: ())
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --dataset_name x.jsonl line 3: invalid JSON (Expecting value)\n"
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # recipe_main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_recipe_main_applies_speed_defaults_to_the_training_args_before_main(monkeypatch):
    import signal

    import trl_ext.runtime

    seen = []

    def fake_apply(training_args, argv=None, default_config=None):
        seen.append((training_args, default_config))
        training_args["threads_set"] = True  # main must see the arguments after the defaults were applied
        return {"threads": 2, "threads_source": "default", "precision": "fp32", "cores": 2}

    monkeypatch.setattr(trl_ext.runtime, "apply_speed_defaults", fake_apply)
    script, training, model = object(), {}, object()
    got = recipe_main(lambda *a, **kw: (a, kw), lambda: (script, training, model), speed_defaults="cpu.yaml", command="c")
    assert seen == [(training, "cpu.yaml")]
    assert got == ((script, {"threads_set": True}, model), {"command": "c", "speed": fake_apply({}, None)})
    # without speed_defaults nothing is applied and main gets no speed argument
    assert recipe_main(lambda *a, **kw: kw, lambda: (script, training, model)) == {}
    assert len(seen) == 2  # the one call above building the expected value
    signal.signal(signal.SIGINT, signal.default_int_handler)  # recipe_main installed the recipe's handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ------------------------------------------------------------------------------------------- output folder
def test_a_finished_run_is_never_overwritten_silently(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-40").mkdir(parents=True)
    (out / "runs").mkdir()
    (out / "metrics.json").write_text("{}")
    (out / "model.safetensors").write_text("weights")
    with pytest.raises(RecipeError) as err:
        check_output_dir(out)
    message = str(err.value)
    assert f"--output_dir {out} holds a finished run (metrics.json)" in message
    assert "choose a new --output_dir" in message and "--overwrite_output_dir" in message
    assert (out / "metrics.json").exists()  # nothing touched
    check_output_dir(out, overwrite=True)
    # the previous run's metrics, checkpoints and TensorBoard logs are gone, so two runs never mix
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


def test_a_model_path_that_does_not_exist_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative paths: a main job run in the checkout must not make outputs/grpo_math exist
    with pytest.raises(RecipeError, match=r"--model_name_or_path outputs/grpo_math: no such local folder .*run that recipe first"):
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
    script_args, training_args, model_args = grpo_math.parse_args(["--output_dir", str(tmp_path), "--max_steps", "1"])
    run = RecipeRun("grpo_math", tmp_path, {"script_args": script_args, "training_args": training_args, "model_args": model_args})
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
    for name in loaders:
        monkeypatch.setattr(module, name, _explode)
    first = json.dumps(GOOD_FIRST[recipe]) + "\n" if recipe in GOOD_FIRST else BAD_LINE.splitlines()[0] + "\n"
    bad = _bad_file(tmp_path, "bad.jsonl", first + '{"question": oops}\n')
    argv = [f.format(bad=bad) for f in flags] + ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(RecipeError, match=rf"{bad} (row 1 \()?line 2\)?: invalid JSON"):
        module.main(*module.parse_args(argv))


@pytest.mark.parametrize("recipe", ["grpo_math", "eval_math", "sft_instruct", "dpo", "reward_model", "rlhf", "grpo_sort",
                                    "compare_upstream", "expert_iteration", "grpo_ablations"])
def test_every_recipe_refuses_a_finished_run_before_any_work(tmp_path, monkeypatch, recipe):
    module = load_recipe(recipe)
    for name in ("load_model_and_tokenizer", "load_eval_model", "load_tokenizer", "resolve_model_name_or_path",
                 "train_reward_model", "load_data", "load_eval_data", "load_pairs", "load_instruction_dataset",
                 "make_sorting_dataset"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, _explode)
    out = tmp_path / "out"
    out.mkdir()
    # grpo_ablations: each experiment's folder (the default experiment is baselines)
    marker = {"grpo_sort": "comparison.json", "compare_upstream": "comparison.json",
              "grpo_ablations": "baselines/comparison.json"}.get(recipe, "metrics.json")
    (out / marker).parent.mkdir(exist_ok=True)
    (out / marker).write_text("{}")
    with pytest.raises(RecipeError, match=rf"--output_dir {out} holds a finished run \({marker}\)"):
        module.main(*module.parse_args(["--output_dir", str(out)]))
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(RecipeError, match="is not writable"):
        module.main(*module.parse_args(["--output_dir", str(blocked / "out")]))


def test_grpo_math_checks_the_reward_and_the_model_path_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(grpo_math, "load_model_and_tokenizer", _explode)
    monkeypatch.setattr(grpo_math, "load_math_dataset", _explode)
    with pytest.raises(RecipeError, match=r"--reward 'nope' is not supported"):
        grpo_math.main(*grpo_math.parse_args(["--reward", "nope", "--output_dir", str(tmp_path / "a")]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RecipeError, match="--model_name_or_path outputs/nothing_here: no such local folder"):
        grpo_math.main(*grpo_math.parse_args(["--model_name_or_path", "outputs/nothing_here", "--output_dir", str(tmp_path / "b")]))


def test_wrong_columns_name_the_recipe_flag(tmp_path):
    path = _bad_file(tmp_path, "odd.jsonl", '{"text": "hi", "label": 1}\n' * 5)
    with pytest.raises(ValueError, match="--dataset_kind"):
        load_math_dataset(path)


def test_comparisons_refuse_resume(tmp_path):
    module = load_recipe("grpo_sort")
    with pytest.raises(RecipeError, match="cannot be resumed"):
        module.main(*module.parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "true"]))


# ------------------------------------------------------------------------------------------- resume in every recipe
class FakeTrainer:
    """Stands in for the TRL trainer: records what train() was asked to resume from."""

    resumed_from: list = []

    def __init__(self, *args, **kwargs):
        from types import SimpleNamespace

        self.args = kwargs.get("args")
        self.model = kwargs.get("model")
        self.state = SimpleNamespace(log_history=[], global_step=0)
        self.accelerator = SimpleNamespace(is_main_process=True, unwrap_model=lambda m: m)

    def add_callback(self, callback):
        pass

    def train(self, resume_from_checkpoint=None):
        from types import SimpleNamespace

        FakeTrainer.resumed_from.append(resume_from_checkpoint)
        self.state.global_step = 4
        return SimpleNamespace(global_step=4, training_loss=0.5)

    def save_model(self, output_dir):
        pass


EVAL_KEYS = ("heldout_ce_loss", "safety_penalty", "heldout_total_loss", "refusal_rate_safety", "refusal_rate_benign",
             "preference_accuracy", "reward_margin", "dpo_loss", "logp_chosen", "logp_rejected",
             "pairwise_accuracy", "bt_loss", "mean_reward")


@pytest.mark.parametrize(
    "recipe, trainer, loaders",
    [
        ("sft_instruct", "SFTTrainer", ["load_model_and_tokenizer"]),
        ("dpo", "DPOTrainer", ["load_model_and_tokenizer"]),
        ("reward_model", "RewardTrainer", ["load_tokenizer", "resolve_model_name_or_path"]),
    ],
)
def test_every_training_recipe_resumes_the_latest_checkpoint_and_reuses_its_before_evaluation(
    tmp_path, monkeypatch, recipe, trainer, loaders
):
    module = load_recipe(recipe)
    evaluations = []

    def evaluate(*args):
        evaluations.append(1)
        return {**dict.fromkeys(EVAL_KEYS, 0.25 * len(evaluations)), "samples_safety": []}

    monkeypatch.setattr(module, "evaluate", evaluate)
    monkeypatch.setattr(module, trainer, FakeTrainer)
    for name in loaders:
        monkeypatch.setattr(module, name, lambda *a, **k: (None, None, None) if name == "load_model_and_tokenizer" else "m")
    monkeypatch.setattr(module, "write_model_card", lambda *a, **k: None, raising=False)
    FakeTrainer.resumed_from = []
    out = tmp_path / "out"
    module.main(*module.parse_args(["--output_dir", str(out)]))
    assert FakeTrainer.resumed_from == [None] and len(evaluations) == 2  # before and after
    # the run is cut after its checkpoint at step 3 (no metrics.json), then resumed from the command line
    (out / "metrics.json").unlink()
    for step in (2, 3):
        (out / f"checkpoint-{step}").mkdir()
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-4").mkdir()  # cut short by the kill: no trainer_state.json, skipped
    module.main(*module.parse_args(["--output_dir", str(out), "--resume_from_checkpoint", "true"]))
    assert FakeTrainer.resumed_from == [None, str(out / "checkpoint-3")]
    assert len(evaluations) == 3  # only the evaluation after training ran again
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["before"][EVAL_KEYS[0] if recipe == "sft_instruct" else ("preference_accuracy" if recipe == "dpo" else "pairwise_accuracy")] == 0.25
    assert metrics["after"]["bt_loss" if recipe == "reward_model" else "logp_chosen" if recipe == "dpo" else "safety_penalty"] == 0.75
    assert metrics["reused"] == ["eval_before"] and metrics["resumed_from"] == str(out / "checkpoint-3")
