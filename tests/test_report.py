"""trl_ext.report: hyperparameters, experiment.md and the one closing call; what it records of git
(trl_ext.run.git_state) and of the training log (trl_ext.measurement.observations)."""

import dataclasses
import subprocess

import pytest

from trl_ext.measurement.observations import entropy_collapsed, observe_training
from trl_ext.report import config_hyperparameters, write_experiment_record
from trl_ext.run import git_state


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_git_state_commit_and_dirty_flag(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    root = str(tmp_path.resolve())
    assert git_state(tmp_path) == {"commit": head, "describe": head[:7], "dirty": False, "root": root}
    (tmp_path / "new.py").write_text("x = 1\n")  # an untracked, not ignored file makes the tree dirty
    git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "tag", "v9.9")
    assert git_state(tmp_path) == {"commit": head, "describe": "v9.9", "dirty": True, "root": root}
    (tmp_path / "tracked.py").write_text("x = 1\n")
    git(tmp_path, "add", "tracked.py")  # a tracked change: git describe says dirty too
    assert git_state(tmp_path)["describe"] == "v9.9-dirty"


def test_git_state_outside_a_repository(tmp_path_factory):
    assert git_state(tmp_path_factory.mktemp("nogit")) == dict.fromkeys(("commit", "describe", "dirty", "root"))


_INSTALLED_COPY = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import trl_ext.run as run
assert run.__file__.startswith(sys.argv[1]), run.__file__
os.chdir(sys.argv[2])
git = run.git_state()
project = run.project_git_state(git)
print(json.dumps({"git": git, "project": project, "lines": run.describe_code(git, project),
                  "versions": run.library_versions(git, project)}))
"""


def test_trl_ext_installed_inside_another_projects_checkout_is_not_that_checkout(tmp_path):
    """trl_ext's files copied into an ignored .venv of another git repository (the course repository with trl_ext
    installed into it): that repository's commit is the project's, not trl_ext's. trl_ext's own checkout is found."""
    import json
    import shutil
    import sys
    from pathlib import Path

    import trl_ext

    course = tmp_path / "course"
    site = course / ".venv" / "lib" / "site-packages"
    shutil.copytree(Path(trl_ext.__file__).parent, site / "trl_ext", ignore=shutil.ignore_patterns("__pycache__"))
    (course / ".gitignore").write_text(".venv/\n")
    git(course, "init", "-q")
    git(course, "add", ".gitignore")
    git(course, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "course")
    course_head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=course, capture_output=True, text=True).stdout
    out = subprocess.run(
        [sys.executable, "-c", _INSTALLED_COPY, str(site), str(course)], capture_output=True, text=True, check=True
    )
    seen = json.loads(out.stdout)
    assert seen["git"] == dict.fromkeys(("commit", "describe", "dirty", "root"))
    assert seen["project"]["commit"] == course_head.strip() and seen["project"]["root"] == str(course.resolve())
    assert seen["versions"]["trl_ext_git"] == "not a git checkout"
    assert seen["versions"]["project_git"]["commit"] == course_head.strip()
    assert seen["lines"][0].endswith(f"(not a git checkout: {site / 'trl_ext'})")
    assert seen["lines"][1].startswith(f"working directory: {course.resolve()} at git commit `{course_head.strip()}`")
    # this very checkout: trl_ext's own commit, the same as git says for the package folder
    package = Path(trl_ext.__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True).stdout.strip()
    assert git_state()["commit"] == head


@dataclasses.dataclass
class Config:
    learning_rate: float = 1e-5
    beta: float = 0.0
    warmup_steps: int = 0
    output_dir: str = "out"
    tags: list = dataclasses.field(default_factory=list)


def test_config_hyperparameters_lists_changed_and_important_fields():
    params = config_hyperparameters(Config(warmup_steps=5, output_dir="elsewhere"))
    # learning_rate and beta are important (listed at their defaults), warmup_steps changed, output_dir is plumbing
    assert params == {"learning_rate": 1e-5, "beta": 0.0, "warmup_steps": 5}
    assert list(params)[:2] == ["learning_rate", "beta"]  # important fields first, in IMPORTANT_FIELDS order
    assert config_hyperparameters(Config(tags=["a"]))["tags"] == ["a"]
    with pytest.raises(TypeError, match="dataclass instances"):
        config_hyperparameters({"learning_rate": 1})


def log(step, **values):
    return {"step": step, **values}


def test_observations_by_hand():
    rewards = [0.0, 0.0, 0.1, 0.1, 0.6, 0.9, 0.9, 1.0, 1.0, 1.0]
    history = [
        log(
            s + 1,
            reward=r,
            entropy=1.0 if s < 5 else 0.05,
            grad_norm=50.0 if s == 3 else 1.0,
            **{"completions/clipped_ratio": 0.8 if s == 9 else 0.0},
        )
        for s, r in enumerate(rewards)
    ]
    history.append({"step": 10, "train_runtime": 12.0})  # a summary entry without the keys is ignored
    notes = observe_training(history, max_completion_length=16)
    text = " ".join(notes)
    # first 3 mean 0.0333, last 3 mean 1.0; window = 10 // 5 = 2 points: the largest rise between consecutive
    # 2-point means is from steps (3, 4) mean 0.1 to steps (5, 6) mean 0.75: +0.65, reported as "around steps 4-6"
    assert "Train reward rose from 0.033 (first logged steps) to 1.000 (last)" in text
    assert "rose fastest around steps 4-6 (+0.650" in text
    assert "Entropy went from 1.000 to 0.050 nats/token; it collapsed" in text
    assert "80% of the last step's completions hit the length limit (16 tokens)" in text
    assert "Gradient norm spiked to 50 at step 4 (median 1)" in text
    assert observe_training([]) == []
    sft = observe_training([log(1, loss=2.0), log(2, loss=1.5), log(3, loss=1.0)])
    assert sft == ["Training loss went from 2.0000 to 1.0000 (-1.0000)."]


def test_write_experiment_record(tmp_path):
    path = write_experiment_record(
        tmp_path,
        "A run",
        configs=(Config(beta=0.1),),
        hyperparameters={"experiment": "baselines"},
        results=[("accuracy", "9.0%", "60.0%")],
        results_header=("metric", "before", "after"),
        plots=["curves.png"],
        observations=["Something happened."],
        log_history=[log(1, reward=0.0), log(2, reward=1.0)],
        command="uv run x --flag 1",
        git={"commit": "abc123", "describe": "v0.1-3-gabc123-dirty", "dirty": True},
        project_git={"commit": "def456", "dirty": False, "root": "/course"},
    )
    text = path.read_text()
    assert path == tmp_path / "experiment.md" and text.startswith("# A run")
    from trl_ext.run import trl_ext_version

    assert (
        f"- trl_ext {trl_ext_version()}, git commit `abc123` (`git describe`: v0.1-3-gabc123-dirty; dirty: true)"
        in (text)
    )
    assert "- working directory: /course at git commit `def456` (dirty: false; not trl_ext's repository)" in text
    assert "- command: `uv run x --flag 1`" in text
    assert "| beta | 0.1 |" in text and "| experiment | baselines |" in text and "| output_dir |" not in text
    assert "| metric | before | after |" in text and "| accuracy | 9.0% | 60.0% |" in text
    assert "![curves](curves.png)" in text
    assert "- Something happened." in text and "- Train reward rose from 0.000" in text


def test_finish_writes_the_record_from_memory_and_metrics_json_last(tmp_path, monkeypatch):
    """The one report call: experiment.md from the metrics it was given (scalars only; the log feeds the
    observations), the plots in the folder, then metrics.json with the run's provenance."""
    import json

    from trl_ext import report
    from trl_ext.run import RecipeRun

    run = RecipeRun("grpo", tmp_path / "run", {"training_args": Config(learning_rate=2e-5)})
    (run.output_dir / "curves.png").write_bytes(b"\x89PNG")
    order = []
    real_record, real_metrics = report.write_experiment_record, run.write_metrics
    monkeypatch.setattr(
        report, "write_experiment_record", lambda *a, **k: order.append("experiment.md") or real_record(*a, **k)
    )
    monkeypatch.setattr(run, "write_metrics", lambda m: order.append("metrics.json") or real_metrics(m))
    metrics = {
        "accuracy_before": 0.09,
        "accuracy_after": 0.675,
        "n_eval": 200,
        "model": "m",
        "flag": True,
        "log_history": [log(1, reward=0.1), log(2, reward=0.6)],
    }
    outputs = [report.Record("GRPO"), report.Records({"eval_after": [{"a": 1}]})]
    report.finish(run, metrics, outputs, log_history=metrics["log_history"])
    assert order == ["experiment.md", "metrics.json"]  # metrics.json last: it marks a finished run
    text = (run.output_dir / "experiment.md").read_text()
    assert "| accuracy_before | 0.09 |" in text and "| n_eval | 200 |" in text and "| model | m |" in text
    assert "flag" not in text and "log_history" not in text  # only scalar results; the log feeds the observations
    assert "| learning_rate | 2e-05 |" in text and "![curves](curves.png)" in text
    assert "Train reward rose from 0.100 (first logged steps) to 0.600 (last)" in text
    saved = json.loads((run.output_dir / "metrics.json").read_text())
    assert saved["accuracy_after"] == 0.675 and saved["recipe"] == "grpo" and "versions" in saved
    assert (run.output_dir / "eval_after.jsonl").read_text() == '{"a": 1}\n'


def test_finish_takes_the_outputs_as_one_list(tmp_path, capsys):
    """Each item of ``outputs`` is one thing written or printed, whatever the order: without a ``Record`` no
    experiment.md; two tables both printed, lines after tables; a ``Written`` file named in the closing line; an item
    that is no output, or a second ``Record``, is refused by name before anything is written."""
    from trl_ext import report
    from trl_ext.run import RecipeRun

    run = RecipeRun("eval", tmp_path / "run", {})
    outputs = [
        report.ConsoleLines("closing line"),
        report.ConsoleTable("first", ("a", "b"), [(1, 2)]),
        report.Written("responses.jsonl"),
        report.ConsoleTable("second", ("c",), [(3,)]),
    ]
    report.finish(run, {"accuracy": 0.5}, outputs)
    printed = capsys.readouterr().out
    assert printed.index("first") < printed.index("second") < printed.index("closing line")
    assert f"Wrote metrics.json, responses.jsonl to {run.output_dir}" in printed
    assert sorted(p.name for p in run.output_dir.iterdir()) == ["metrics.json"]

    with pytest.raises(TypeError, match=r"outputs\[1\] is a tuple; expected one of report.Records, "):
        report.finish(RecipeRun("x", tmp_path / "x", {}), {}, [report.Record("t"), ("caption", (), [])])
    with pytest.raises(ValueError, match="2 report.Record outputs; give at most one"):
        report.finish(RecipeRun("y", tmp_path / "y", {}), {}, [report.Record("t"), report.Record("u")])
    assert not (tmp_path / "x" / "metrics.json").exists() and not (tmp_path / "y" / "metrics.json").exists()


def test_comparison_results_one_row_per_arm_and_its_observations():
    from trl_ext.report import comparison_results

    arm = {
        "name": "course",
        "final_accuracy": 0.5,
        "final_accuracy_se": 0.05,
        "final_reward": 0.4,
        "train_seconds": 10.0,
        "curves": {"reward": [[1, 0.0], [2, 0.5]], "entropy": [[1, 1.0], [2, 0.9]]},
    }
    rows, notes = comparison_results([arm])
    assert rows == [("course", 0.5, 5.0, 0.4, 10.0)]
    assert any(n.startswith("course: Train reward rose from 0.000") for n in notes)
    assert "course: Entropy went from 1.000 to 0.900 nats/token; no collapse." in notes


def test_entropy_collapse_rule():
    assert entropy_collapsed(1.0, 0.09) and entropy_collapsed(1.0, 0.19) and not entropy_collapsed(1.0, 0.21)
    assert entropy_collapsed(0.4, 0.099) and not entropy_collapsed(0.4, 0.1)


@pytest.mark.parametrize("name", [None, "embedded", "embedded:SmolLM2-135M-Instruct"])
def test_the_record_names_the_embedded_model_by_its_hub_id(tmp_path, name):
    import trl

    text = write_experiment_record(
        tmp_path, "A run", configs=(trl.ModelConfig(model_name_or_path=name),), git={"commit": None}
    ).read_text()
    assert "| model_name_or_path | HuggingFaceTB/SmolLM2-135M-Instruct (trl_ext's embedded copy) |" in text
    assert "None" not in text.split("## Hyperparameters")[1]
    other = write_experiment_record(tmp_path, "A run", configs=(trl.ModelConfig(model_name_or_path="Qwen/Q"),))
    assert "| model_name_or_path | Qwen/Q |" in other.read_text()
