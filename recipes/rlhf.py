"""The RLHF loop of the course supplement: a Bradley-Terry reward model, then GRPO against it with adaptive KL.

    uv run python recipes/rlhf.py                   # CPU: embedded model, bundled pairs, minutes
    uv run python recipes/rlhf.py --reward_model_path outputs/reward_model   # reuse a trained reward model

1. Reward model: loaded from --reward_model_path, or trained now by running recipes/reward_model.py with its default
   config into --output_dir/reward_model (one process; in a multi-process launch the main process runs it while the
   others wait).
2. Policy: trl_ext.GRPOTrainer with the reward model as its reward function (TRL scores prompt + completion with a
   sequence-classification model) and the adaptive KL coefficient (kl_target, Ziegler et al. 2019).
3. Report: reward-model score of greedy answers to held-out prompts before/after, KL to the reference and beta over
   training; metrics.json and rlhf.png in --output_dir.

A --config file is layered over recipes/configs/rlhf.yaml (it replaces only what it sets; flags override both).
Prompt files, options and --output_dir are checked before any model is loaded. --resume_from_checkpoint true continues
the GRPO stage from the latest checkpoint in --output_dir and reuses the reward model (and the before-score) of the
first run; a reward model already trained into --output_dir/reward_model is reused unless --overwrite_output_dir.
"""

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trl
from accelerate import PartialState
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

import trl_ext
from trl_ext import cli, report
from trl_ext.data import preferences

HERE = Path(__file__).parent
DEFAULT_CONFIG = HERE / "configs" / "rlhf.yaml"
PANELS = (("reward", "reward-model score (train)"), ("kl", "KL to reference (k3)"), ("beta", "beta (adaptive)"))
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What a distributed launch (accelerate launch, torchrun) sets, besides ACCELERATE_* and TORCHELASTIC_*: removed from
the reward model's process, which trains alone."""


@dataclass
class RLHFArguments(cli.RecipeArguments):
    reward_model_path: str | None = field(
        default=None, metadata={"help": "A trained sequence-classification reward model; None trains one first."}
    )
    train_file: str = field(default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "RL prompts."})
    test_file: str = field(
        default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out prompts."}
    )


def train_reward_model(output_dir: Path, overwrite: bool = False) -> Path:
    """Train recipes/reward_model.py's default reward model into ``output_dir``, as a command of its own (``python
    recipes/reward_model.py --output_dir ...``, run by the main process of a launch with the launch's variables
    removed, while the other processes wait for it, at most --ddp_timeout seconds); reuse it when that folder already
    holds a finished one (its metrics.json), unless ``overwrite``; resume it from its own last checkpoint.

    Raises:
        RecipeError: the reward model's command failed (its own ``error:`` line, if any, is printed above).
    """
    state = PartialState()
    if state.is_main_process and (output_dir / "metrics.json").is_file() and not overwrite:
        print(
            f"Reusing the reward model trained before in {output_dir} (--overwrite_output_dir retrains it)", flush=True
        )
    elif state.is_main_process:
        flags = ["--output_dir", str(output_dir)]
        if overwrite:
            flags.append("--overwrite_output_dir")
        elif list(output_dir.glob("checkpoint-*")):
            flags += ["--resume_from_checkpoint", "true"]
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in LAUNCH_VARIABLES and not k.startswith(("ACCELERATE_", "TORCHELASTIC_"))
        }
        sys.stdout.flush()
        status = subprocess.run([sys.executable, str(HERE / "reward_model.py"), *flags], env=env).returncode
        if status != 0:
            raise cli.RecipeError(
                f"the reward model's training (recipes/reward_model.py {shlex.join(flags)}) exited with "
                f"status {status}; its messages are above (or pass --reward_model_path)"
            )
    state.wait_for_everyone()  # the other processes of a launch wait for it
    return output_dir


@torch.no_grad()
def reward_scores(reward_model, tokenizer, prompts: list[str], completions: list[str]) -> list[float]:
    """Scalar reward of each prompt + completion, as TRL computes it for a model reward function."""
    batch = tokenizer(
        [p + c for p, c in zip(prompts, completions)],
        return_tensors="pt",
        padding=True,
        padding_side="right",
        add_special_tokens=False,
    )
    return reward_model(**batch).logits[:, 0].tolist()


def score(trainer, tokenizer, reward_model, rm_tokenizer, prompts: list[str]) -> dict:
    """Mean reward-model score of the policy's greedy answers to ``prompts`` (budget: max_completion_length tokens),
    and the answers: ``{"score", "completions"}``."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    completions = trl_ext.eval.generate_completions(
        model, tokenizer, prompts, trainer.args.max_completion_length, desc="reward-model score"
    )
    mean = sum(reward_scores(reward_model, rm_tokenizer, prompts, completions)) / len(prompts)
    return {"score": mean, "completions": completions}


@cli.recipe("rlhf", (RLHFArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG)
def main(run, script_args: RLHFArguments, training_args, model_args: trl.ModelConfig) -> None:
    # the decorator checked the folder, the checkpoint and the model's options (cli.parse: --reward_model_path
    # exists); then the prompts, before any model
    with run.phase("load_data"):
        with cli.user_input("--train_file: "):
            train_prompts = preferences.unique_prompts(script_args.train_file)
        with cli.user_input("--test_file: "):
            test_prompts = preferences.unique_prompts(script_args.test_file)
    cli.check_fills_one_step(
        len(train_prompts), training_args, f"--train_file {script_args.train_file} (unique prompts)", "prompts"
    )
    with run.phase("reward_model"):
        rm_path = Path(
            script_args.reward_model_path
            or train_reward_model(run.output_dir / "reward_model", script_args.overwrite_output_dir)
        )
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()
    rm_tokenizer = trl_ext.models.load_tokenizer(str(rm_path))
    tokenizer = trl_ext.models.load_tokenizer(model_args.model_name_or_path)
    trainer = trl_ext.GRPOTrainer(
        model=trl_ext.models.resolve_model_name_or_path(model_args.model_name_or_path),  # reloaded as the reference
        reward_funcs=reward_model,
        reward_processing_classes=rm_tokenizer,
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": train_prompts}),
        processing_class=tokenizer,
    )
    # a resumed run reuses the before-score of the same reward model, policy, held-out prompts and budget
    weights = rm_path / "model.safetensors"
    key = trl_ext.run.evaluation_key(
        model_args.model_name_or_path,
        script_args.test_file,
        reward_model=trl_ext.run.file_digest(weights) if weights.is_file() else str(rm_path),
        max_completion_length=training_args.max_completion_length,
    )
    before, _, after = run.train_and_evaluate(
        trainer, lambda: score(trainer, tokenizer, reward_model, rm_tokenizer, test_prompts), key
    )
    trainer.save_model(str(run.output_dir))
    if not trainer.accelerator.is_main_process:
        return
    curves = {k: [(e["step"], e[k]) for e in trainer.state.log_history if "reward" in e and k in e] for k, _ in PANELS}
    metrics = {
        "reward_model": str(rm_path),
        "rm_score_before": before["score"],
        "rm_score_after": after["score"],
        "n_eval_prompts": len(test_prompts),
        "kl_final": curves["kl"][-1][1] if curves["kl"] else None,
        "beta_initial": training_args.beta,
        "beta_final": trainer.beta,
        "train_steps": trainer.state.global_step,
        "curves": curves,
        "example_after": {"prompt": test_prompts[0], "completion": after["completions"][0]},
    }
    report.finish(
        run,
        metrics,
        [
            report.Record("RLHF: reward model, then GRPO with an adaptive KL coefficient"),
            report.ModelCard(model_args.model_name_or_path, script_args.train_file),
            report.Curves("rlhf.png", PANELS),
            report.ConsoleLines(
                f"reward-model score on {len(test_prompts)} held-out prompts: {before['score']:.3f} -> "
                f"{after['score']:.3f}; KL {metrics['kl_final']}; beta {training_args.beta} -> "
                f"{trainer.beta:.4f} after {run.steps_summary(trainer.state.global_step)}."
            ),
        ],
        trainer=trainer,
    )


if __name__ == "__main__":
    cli.main(main)
