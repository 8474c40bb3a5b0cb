"""recipes/grpo_math.py end to end on a tiny model, and its zero-argument defaults."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trl
import yaml

import trl_ext
from trl_ext import tasks
from trl_ext.cli import RecipeError
from trl_ext.rewards import without_credit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import grpo_math  # noqa: E402


def test_zero_argument_run_uses_the_cpu_config():
    parser = trl.TrlParser((tasks.MathTaskArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(["--config", str(grpo_math.DEFAULT_CONFIG)])
    assert model_args.model_name_or_path is None  # the embedded SmolLM2-135M-Instruct
    assert script_args.dataset_name is None and script_args.num_eval >= 200  # generated arithmetic, >= 200 held out
    # fp32 on purpose (bf16 autocast learned less, see the config); an explicit bf16 key, so trl_ext.runtime keeps it
    assert training_args.use_cpu and not training_args.bf16
    assert yaml.safe_load(grpo_math.DEFAULT_CONFIG.read_text())["bf16"] is False
    assert (training_args.pg_loss_type, training_args.loss_type, training_args.scale_rewards) == (
        "grpo_clip",
        "grpo",
        "group",
    )
    assert training_args.save_strategy == "steps"  # a crash mid-run leaves a loadable checkpoint


@pytest.mark.parametrize("name", ["grpo_math_math.yaml", "grpo_math_gsm8k.yaml"])
def test_gpu_configs_parse(name):
    parser = trl.TrlParser((tasks.MathTaskArguments, trl_ext.GRPOConfig, trl.ModelConfig))
    path = grpo_math.DEFAULT_CONFIG.parent / name
    # bf16 and vLLM need a GPU to validate; everything else is checked as written
    assert yaml.safe_load(path.read_text())["use_vllm"] is True
    overrides = ["--bf16", "false", "--use_cpu", "true", "--use_vllm", "false"]
    script_args, training_args, model_args = parser.parse_args_and_config(["--config", str(path), *overrides])
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-Math-1.5B"
    assert script_args.template == "r1_zero" and training_args.pg_loss_type == "reinforce_with_baseline"
    assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256


def _tiny_setup(tiny_model, tokenizer, tmp_path):
    """A saved tiny model and a 12-row local GSM8K file (the last 2 rows are held out)."""
    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {
            "question": f"Ann has {a} apples and buys {a + 3} more. How many now?",
            "answer": f"{a} + {a + 3}\n#### {2 * a + 3}",
        }
        for a in range(1, 13)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def _recipe_flags(model_dir, data, out, *extra):
    return [
        str(ROOT / "recipes" / "grpo_math.py"),
        "--dataset_name",
        str(data),
        "--model_name_or_path",
        str(model_dir),
        "--num_eval",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "6",
        "--output_dir",
        str(out),
        *extra,
    ]


@pytest.mark.slow
def test_recipe_runs_on_a_local_gsm8k_file(tiny_model, tokenizer, tmp_path):
    model_dir, data = _tiny_setup(tiny_model, tokenizer, tmp_path)
    out = tmp_path / "out"
    # default logging_steps (5) > max_steps (2): the last step must still be logged; TensorBoard on
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--cpu",
        *_recipe_flags(model_dir, data, out, "--max_steps", "2", "--report_to", "tensorboard", "--save_steps", "1"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # accelerate then exports its default 1
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    # the breakdown's wall time starts when the launcher did (not the training process, seconds later) and ends as
    # metrics.json is written: startup first, writing the outputs (finish) last
    breakdown = metrics["time_breakdown"]
    assert (out / "metrics.json").stat().st_mtime - breakdown["total"] == pytest.approx(launched, abs=0.5)
    assert list(breakdown)[0] == "startup" and list(breakdown)[-3:] == ["finish", "other", "total"]
    assert breakdown["startup"] > 0 and breakdown["finish"] > 0
    assert metrics["train_steps"] == 2 and metrics["n_eval"] == 2  # 12 rows: the last 12 // 5 = 2 held out
    assert 0.0 <= metrics["accuracy_before"] <= 1.0 and 0.0 <= metrics["accuracy_after"] <= 1.0
    assert metrics["reward"] == "gsm8k"
    assert "accuracy" in proc.stdout and "before" in proc.stdout and "2 held-out problems" in proc.stdout
    # provenance: the command, all three resolved configs, versions, phase times
    assert metrics["command"].endswith("--save_steps 1") and metrics["versions"]["trl"] == trl.__version__
    assert metrics["config"]["training_args"]["max_steps"] == 2 and metrics["config"]["model_args"][
        "model_name_or_path"
    ] == str(model_dir)
    assert metrics["config"]["script_args"]["dataset_name"] == str(data)
    assert {"load_data", "load_model", "eval_before", "train", "eval_after"} <= set(metrics["phase_seconds"])
    # the last step (2) was logged although logging_steps is 5; held-out accuracy at steps 0 and 2
    history = metrics["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [2]
    assert [(e["step"], e["eval_accuracy"]) for e in history if "eval_accuracy" in e] == [
        (0, metrics["accuracy_before"]),
        (2, metrics["accuracy_after"]),
    ]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "runs").glob("*")))).Reload()  # one run folder; two event files
    scalars = {}
    for path in sorted((out / "runs").rglob("events.*")):
        acc = EventAccumulator(str(path)).Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    assert events is not None and sorted(scalars["eval/accuracy"]) == [
        (0, pytest.approx(metrics["accuracy_before"])),
        (2, pytest.approx(metrics["accuracy_after"])),
    ]
    assert [step for step, _ in scalars["train/loss"]] == [2]
    # per-problem records include what the grader extracted
    records = [json.loads(line) for line in (out / "eval_after.jsonl").read_text().splitlines()]
    assert len(records) == 2
    from trl_ext.rewards import extract_last_number

    assert all(r["extracted"] == extract_last_number(r["response"]) for r in records)
    assert (out / "training_curves.png").stat().st_size > 5_000
    card = (out / "README.md").read_text()
    assert f"[{model_dir}]" not in card or "(local)" in card
    assert "None" not in card.split("## Training procedure")[0] and f'model="{out}"' in card
    # every core by default (accelerate exported OMP_NUM_THREADS=1 on its own), and where the time went
    assert metrics["runtime"]["threads_source"].startswith("default") and metrics["runtime"]["threads"] >= 1
    breakdown = metrics["time_breakdown"]
    for phase in ("model_load", "evaluation", "generation", "logprob_forward", "backward", "optimizer"):
        assert breakdown[phase] > 0, phase
    assert breakdown["reward"] >= 0  # a regex over 4 short completions: can round to 0 ms
    assert sum(v for k, v in breakdown.items() if k != "total") == pytest.approx(breakdown["total"], abs=0.02)
    assert "Where the" in proc.stdout
    # each phase beside the floor the machine allows for its work, the peaks measured in this run
    roofline = metrics["roofline"]
    assert roofline["machine"]["matmul_flops_per_s"] > 0 and roofline["machine"]["bandwidth_bytes_per_s"] > 0
    rows = {**roofline["phases"], **roofline["omitted"]}  # a row under its floor is left out, with the reason
    assert all(row["ratio"] >= 1 for row in roofline["phases"].values())
    assert all(row["seconds"] > 0 and row["ratio"] < 1 for row in roofline["omitted"].values())
    for phase in ("evaluation", "generation_prefill", "generation_decode", "logprob_forward", "backward", "optimizer"):
        row = rows[phase]
        floor = max(
            row["flops"] / roofline["machine"]["matmul_flops_per_s"],
            row["bytes"] / roofline["machine"]["bandwidth_bytes_per_s"],
        )
        assert row["floor_seconds"] == pytest.approx(floor) and row["ratio"] == pytest.approx(row["seconds"] / floor), (
            phase
        )
    assert rows["optimizer"]["calls"] == 2  # the two optimizer steps of this run
    assert "roofline on cpu" in proc.stdout
    assert (out / "model.safetensors").exists() and list(out.glob("checkpoint-*"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # the saved model loads
    # a second run into the finished folder is refused, naming both ways forward
    with pytest.raises(RecipeError) as refused:
        grpo_math.main(*grpo_math.main.parse_args(_recipe_flags(model_dir, data, out)[1:]))
    assert str(refused.value) == (
        f"--output_dir {out} holds a finished run (metrics.json); choose a new --output_dir, or pass "
        "--overwrite_output_dir to replace it"
    )


@pytest.mark.slow
def test_eval_every_logs_the_held_out_curve_and_rollouts_go_to_a_file(tiny_model, tokenizer, tmp_path, monkeypatch):
    """--eval_every 1 over 2 steps: held-out accuracy at steps 0, 1, 2 in metrics.json, TensorBoard and the plot,
    step 1's equal to an evaluation of the checkpoint saved at step 1; rollouts.jsonl holds 3 samples of each
    step, each scored as the task scores it; eval_before.jsonl exists when training starts."""
    import dataclasses

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trl_ext.models import load_model

    def even_length(response, ground_truth):  # a judge the random model's responses pass about half the time
        r = float(len(response) % 2 == 0)
        return {"reward": r, "format_reward": float(len(response) % 3 == 0), "answer_reward": r}

    grader = dataclasses.replace(tasks.GRADERS.get("gsm8k"), reward_fn=even_length)
    monkeypatch.setitem(tasks.GRADERS._entries, "gsm8k", grader)  # the registry's entry, for this test
    model_dir, data = _tiny_setup(tiny_model, tokenizer, tmp_path)
    out = tmp_path / "out"
    flags = ["--max_steps", "2", "--eval_every", "1", "--rollout_samples", "3", "--save_steps", "1"]
    flags += ["--save_total_limit", "2", "--report_to", "tensorboard"]  # logging_steps stays the config's 5
    configs = grpo_math.main.parse_args(_recipe_flags(model_dir, data, out, *flags)[1:])
    seen = []
    train = trl_ext.GRPOTrainer.train
    monkeypatch.setattr(
        trl_ext.GRPOTrainer,
        "train",
        lambda self, **kw: seen.append((out / "eval_before.jsonl").is_file()) or train(self, **kw),
    )
    grpo_math.main(*configs)
    assert seen == [True]  # eval_before.jsonl, which the zero-reward warning names, exists before training
    metrics = json.loads((out / "metrics.json").read_text())
    curve = metrics["eval_curve"]
    assert [p["step"] for p in curve] == [0, 1, 2]
    assert (curve[0]["accuracy"], curve[2]["accuracy"]) == (metrics["accuracy_before"], metrics["accuracy_after"])
    assert (curve[0]["format_rate"], curve[2]["format_rate"]) == (
        metrics["format_rate_before"],
        metrics["format_rate_after"],
    )
    task = tasks.load_task(configs[0], max_new_tokens=6)
    step1 = task.evaluate(load_model(str(out / "checkpoint-1")), tokenizer, progress=False)  # evaluated on its own
    assert (curve[1]["accuracy"], curve[1]["format_rate"]) == (step1["accuracy"], step1["format_rate"])
    scalars = {}
    for path in sorted((out / "runs").rglob("events.*")):
        acc = EventAccumulator(str(path)).Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    assert sorted(scalars["eval/accuracy"]) == [(p["step"], pytest.approx(p["accuracy"])) for p in curve]
    assert sorted(scalars["eval/format_rate"]) == [(p["step"], pytest.approx(p["format_rate"])) for p in curve]
    assert (out / "training_curves.png").stat().st_size > 5_000
    # 2 steps x 3 samples, each with the task's own scores of its response against its training row
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1, 1, 1, 2, 2, 2]
    by_prompt = {json.dumps(row["prompt"]): row for row in task.train}  # chat prompts: lists of messages
    for r in rollouts:
        assert {"prompt", "response", "reward", "format_reward", "answer_reward", "answer", "advantage"} <= set(r)
        row = by_prompt[json.dumps(r["prompt"])]
        assert r["answer"] == row["answer"]
        # the task's score, with no credit for a response the length limit cut where the task gives none
        expected = task.score(r["response"], row)
        if r["truncated"] and not task.credit_truncated:
            expected = without_credit(expected)
        assert {k: r[k] for k in ("reward", "format_reward", "answer_reward")} == expected
        assert r["rewards"] == {"gsm8k_reward": r["reward"]}  # what GRPO trained on
    history = {e["step"]: e for e in metrics["log_history"] if "loss" in e}
    assert set(history) == {1, 2}  # the evaluated steps were logged although logging_steps is 5


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    start = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() - start < timeout, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_run_resumed_from_the_command_line_ends_with_the_same_weights(tiny_model, tokenizer, tmp_path):
    """SIGKILL after the first checkpoint (step 2 of 4), then --resume_from_checkpoint true: the same weights,
    the same held-out numbers, the before-evaluation reused instead of repeated. Also Ctrl-C: one line, exit 130."""
    import torch
    from safetensors.torch import load_file

    model_dir, data = _tiny_setup(tiny_model, tokenizer, tmp_path)
    flags = ("--max_steps", "4", "--save_steps", "2", "--report_to", "none", "--logging_steps", "1")
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run = lambda out, *extra: subprocess.run(  # noqa: E731
        [sys.executable, *_recipe_flags(model_dir, data, out, *flags, *extra)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    proc = run(straight)
    assert proc.returncode == 0, proc.stderr[-3000:]

    killed = subprocess.Popen(
        [sys.executable, *_recipe_flags(model_dir, data, cut, *flags)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(cut / "checkpoint-2" / "trainer_state.json", killed)  # written last: the checkpoint is complete
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert not (cut / "metrics.json").exists()  # unfinished: resuming is allowed, restarting is refused
    with pytest.raises(RecipeError, match=f"--output_dir {cut} holds an unfinished run"):
        grpo_math.main(*grpo_math.main.parse_args(_recipe_flags(model_dir, data, cut, *flags)[1:]))
    resumed = run(cut, "--resume_from_checkpoint", "true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = json.loads((straight / "metrics.json").read_text()), json.loads((cut / "metrics.json").read_text())
    assert b["resumed_from"] == str(cut / "checkpoint-2") and b["reused"] == ["eval_before"]
    assert "eval_before" in b["phase_seconds"] and b["phase_seconds"]["eval_before"] < 1.0  # read, not generated
    assert b["train_steps"] == a["train_steps"] == 4
    # the summaries count each process's own steps: 4, and 2 after resuming from step 2
    assert re.search(r"^4 steps in \d+ s; gain", proc.stdout, re.M)
    assert re.search(r"^2 steps in \d+ s \(resumed from step 2; 4 in all\); gain", resumed.stdout, re.M)
    assert b["resumed_from_step"] == 2 and a["resumed_from_step"] == 0
    for key in ("accuracy_before", "accuracy_after", "format_rate_after"):
        assert b[key] == a[key], key
    wa, wb = load_file(straight / "model.safetensors"), load_file(cut / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name  # CPU: bit-identical
    # the steps after the checkpoint logged the same losses as the uninterrupted run
    losses = lambda m: {e["step"]: e["loss"] for e in m["log_history"] if "loss" in e}  # noqa: E731
    assert {s: v for s, v in losses(b).items() if s > 2} == {s: v for s, v in losses(a).items() if s > 2}
    assert set(losses(b)) >= {3, 4}

    # Ctrl-C (SIGINT) while training: one line with the last checkpoint and the resume command, exit 130, no traceback
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [
            sys.executable,
            *_recipe_flags(model_dir, data, stopped, "--max_steps", "200", "--save_steps", "2", "--report_to", "none"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(stopped / "checkpoint-2" / "trainer_state.json", proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 15
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"Stopped (Ctrl-C). Last checkpoint: {stopped}/checkpoint-")
    assert line.endswith(
        f"--output_dir {stopped} --max_steps 200 --save_steps 2 --report_to none --resume_from_checkpoint true"
    )


_SUBREAPER = """
import ctypes, json, os, signal, subprocess, sys, time
from pathlib import Path

# PR_SET_CHILD_SUBREAPER: the worker, orphaned when its launcher dies, is reparented here and its status read
ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)
ready, how, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
launcher = subprocess.Popen(command, start_new_session=True)  # its own process group, as a scheduler's job step
start = time.monotonic()
while not ready.exists():
    if launcher.poll() is not None or time.monotonic() - start > 600:
        sys.exit(f"the run ended (status {launcher.returncode}) or took too long before {ready} appeared")
    time.sleep(0.05)
group = {}
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == launcher.pid:  # pgrp
            group[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\\0", b" ").decode()
    except (OSError, ValueError):
        pass
if how == "group":
    os.killpg(launcher.pid, signal.SIGTERM)  # what SLURM, systemd and Kubernetes send
else:
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, outright: the kernel tells the worker
statuses = {}
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    statuses[pid] = os.waitstatus_to_exitcode(status)
print(json.dumps({"launcher": launcher.pid, "group": group, "statuses": statuses}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and a subreaper: Linux")
@pytest.mark.parametrize("how", ["group", "launcher_killed"])
def test_sigterm_to_an_accelerate_launch_group_stops_like_a_plain_run(how, tiny_model, tokenizer, tmp_path):
    """Issue 45 item 3: `accelerate launch --config_file accelerate_configs/single_process.yaml recipes/grpo_math.py`
    and, once training saved a checkpoint, a SIGTERM to its process group (or a SIGKILL of the launcher alone): the
    worker says `Stopped (SIGTERM)` and exits 143 (it said `Stopped (Ctrl-C)` and exited 130 when the launcher's
    death signalled it with SIGINT), the resume line repeats the launch as typed (it printed `uv run python ...`),
    and the last checkpoint loads."""
    from transformers import AutoModelForCausalLM

    model_dir, data = _tiny_setup(tiny_model, tokenizer, tmp_path)
    out = tmp_path / "out"
    bin_dir = Path(sys.executable).parent
    config = ROOT / "accelerate_configs" / "single_process.yaml"
    recipe = _recipe_flags(model_dir, data, out, "--max_steps", "200", "--save_steps", "1", "--report_to", "none")
    launch = ["accelerate", "launch", "--config_file", str(config)]
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    ready = out / "checkpoint-1" / "trainer_state.json"  # written last: the first checkpoint is complete
    done = subprocess.run(
        [sys.executable, "-c", _SUBREAPER, str(ready), how, str(bin_dir / "accelerate"), *launch[1:], *recipe],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    workers = [pid for pid, cmd in report["group"].items() if int(pid) != report["launcher"] and "grpo_math.py" in cmd]
    assert len(workers) == 1, report["group"]
    assert report["statuses"][workers[0]] == 143, (report, done.stderr[-3000:])  # 128 + 15, as under python
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("Stopped (")]
    assert len(line) == 1, done.stderr[-3000:]
    match = re.fullmatch(r"Stopped \(SIGTERM\)\. Last checkpoint: (\S+)\. Resume with: (.*)", line[0])
    assert match, line[0]
    typed = [*launch, *recipe]
    assert shlex.split(match[2]) == [*typed, "--resume_from_checkpoint", "true"]
    last = Path(match[1])
    assert last.parent == out and int(last.name.split("-")[1]) >= 1
    assert json.loads((last / "trainer_state.json").read_text())["global_step"] == int(last.name.split("-")[1])
    loaded = AutoModelForCausalLM.from_pretrained(last)
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in tiny_model.parameters())
