"""The RLHF loop of the course supplement: a Bradley-Terry reward model, then GRPO against it with adaptive KL.

    uv run python recipes/rlhf.py                   # CPU: embedded model, bundled pairs, minutes
    uv run python recipes/rlhf.py --reward_model_path outputs/reward_model   # reuse a trained reward model

1. Reward model: loaded from --reward_model_path, or trained now by recipes/reward_model.py (its default config).
2. Policy: trl_ext.GRPOTrainer with the reward model as its reward function (TRL scores prompt + completion with a
   sequence-classification model) and the adaptive KL coefficient (kl_target, Ziegler et al. 2019).
3. Report: reward-model score of greedy answers to held-out prompts before/after, KL to the reference and beta over
   training; metrics.json and rlhf.png in --output_dir.

A --config file is layered over recipes/configs/rlhf.yaml (it replaces only what it sets; flags override both).
Prompt files, options and --output_dir are checked before any model is loaded. --resume_from_checkpoint true continues
the GRPO stage from the latest checkpoint in --output_dir and reuses the reward model (and the before-score) of the
first run; a reward model already trained into --output_dir/reward_model is reused unless --overwrite_output_dir.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402

import trl_ext  # noqa: E402
from trl_ext.recipe_utils import (  # noqa: E402
    RecipeArguments,
    RecipeError,
    RecipeRun,
    check_fills_one_step,
    check_model_options,
    file_digest,
    parse_recipe_args,
    recipe_main,
    user_input,
    write_model_card,
)
from trl_ext.data.preferences import load_preference_rows  # noqa: E402
from trl_ext.eval import generate_completions  # noqa: E402
from trl_ext.models import load_tokenizer, resolve_model_name_or_path  # noqa: E402
from trl_ext.experiment import write_recipe_record

HERE = Path(__file__).parent
DEFAULT_CONFIG = HERE / "configs" / "rlhf.yaml"


@dataclass
class RLHFArguments(RecipeArguments):
    reward_model_path: str | None = field(
        default=None, metadata={"help": "A trained sequence-classification reward model; None trains one first."}
    )
    train_file: str = field(default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "RL prompts."})
    test_file: str = field(default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out prompts."})


def prompts_from(path: str) -> list[str]:
    """Unique prompts of a preference file, as plain text followed by a newline (how the reward model saw them)."""
    return list(dict.fromkeys(row["prompt"] + "\n" for row in load_preference_rows(path)))


@torch.no_grad()
def reward_scores(reward_model, tokenizer, prompts: list[str], completions: list[str]) -> list[float]:
    """Scalar reward of each prompt + completion, as TRL computes it for a model reward function."""
    batch = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    return reward_model(**batch).logits[:, 0].tolist()


def train_reward_model(output_dir: Path, overwrite: bool = False) -> Path:
    """Train recipes/reward_model.py's default reward model into ``output_dir``; reuse it when that folder already
    holds a finished one (its metrics.json), unless ``overwrite``; resume it from its own last checkpoint."""
    sys.path.insert(0, str(HERE))
    import reward_model as recipe

    if (output_dir / "metrics.json").is_file() and not overwrite:
        print(f"Reusing the reward model trained before in {output_dir} (--overwrite_output_dir retrains it)")
        return output_dir
    flags = ["--output_dir", str(output_dir)]
    if overwrite:
        flags.append("--overwrite_output_dir")
    elif list(output_dir.glob("checkpoint-*")):
        flags += ["--resume_from_checkpoint", "true"]
    recipe.main(*recipe.parse_args(flags))
    return output_dir


def main(script_args, training_args, model_args):
    configs = {"script_args": script_args, "training_args": training_args, "model_args": model_args}
    run = RecipeRun("rlhf", training_args.output_dir, configs, overwrite=script_args.overwrite_output_dir,
                    resume=training_args.resume_from_checkpoint)
    check_model_options(model_args)
    if script_args.reward_model_path is not None and not Path(script_args.reward_model_path).is_dir():
        raise RecipeError(f"--reward_model_path {script_args.reward_model_path}: no such folder")
    with run.phase("load_data"):
        with user_input("--train_file: "):
            train_prompts = prompts_from(script_args.train_file)
        with user_input("--test_file: "):
            test_prompts = prompts_from(script_args.test_file)
    check_fills_one_step(len(train_prompts), training_args, f"--train_file {script_args.train_file} (unique prompts)", "prompts")
    console = Console(soft_wrap=True)
    out = Path(training_args.output_dir)
    with run.phase("reward_model"):
        rm_path = Path(script_args.reward_model_path or train_reward_model(out / "reward_model", script_args.overwrite_output_dir))
    run.make_current()  # the reward-model stage was a run of its own
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path, num_labels=1).eval()
    rm_tokenizer = load_tokenizer(str(rm_path))
    policy_path = resolve_model_name_or_path(model_args.model_name_or_path)  # a path: TRL reloads it as the reference
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    trainer = trl_ext.GRPOTrainer(
        model=policy_path,
        reward_funcs=reward_model,
        reward_processing_classes=rm_tokenizer,
        args=training_args,
        train_dataset=Dataset.from_dict({"prompt": train_prompts}),
        processing_class=tokenizer,
    )

    def score(desc):
        model = trainer.accelerator.unwrap_model(trainer.model)
        completions = generate_completions(model, tokenizer, test_prompts, training_args.max_completion_length, desc=desc)
        return sum(reward_scores(reward_model, rm_tokenizer, test_prompts, completions)) / len(test_prompts), completions

    run.attach(trainer)
    key = {"reward_model": file_digest(rm_path / "model.safetensors") if (rm_path / "model.safetensors").is_file() else str(rm_path),
           "policy": model_args.model_name_or_path, "test_file": file_digest(script_args.test_file),
           "max_completion_length": training_args.max_completion_length}
    with run.phase("eval_before"):
        before = run.reuse_or_compute("eval_before", key, lambda: score("eval before")[0])
    with run.phase("train"):
        trainer.train(resume_from_checkpoint=run.resume_from_checkpoint)
    with run.phase("eval_after"):
        after, completions_after = score("eval after")
    trainer.save_model(str(out))
    if not trainer.accelerator.is_main_process:
        return
    write_model_card(trainer, out, model_args.model_name_or_path, script_args.train_file)
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    curves = {key: [(e["step"], e[key]) for e in logs if key in e] for key in ("reward", "kl", "beta")}
    metrics = {
        "reward_model": str(rm_path),
        "rm_score_before": before,
        "rm_score_after": after,
        "n_eval_prompts": len(test_prompts),
        "kl_final": curves["kl"][-1][1] if curves["kl"] else None,
        "beta_initial": training_args.beta,
        "beta_final": trainer.beta,
        "train_steps": trainer.state.global_step,
        "curves": curves,
        "example_after": {"prompt": test_prompts[0], "completion": completions_after[0]},
    }
    run.write_metrics(metrics)

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for ax, (key, label) in zip(axes, [("reward", "reward-model score (train)"), ("kl", "KL to reference (k3)"), ("beta", "beta (adaptive)")]):
        if curves[key]:
            ax.plot(*zip(*curves[key]), marker="o")
        ax.set_title(label)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "rlhf.png", dpi=120)
    write_recipe_record(out, "RLHF: reward model, then GRPO with an adaptive KL coefficient", script_args, training_args, model_args)
    console.print(
        f"reward-model score on {len(test_prompts)} held-out prompts: {before:.3f} -> {after:.3f}; "
        f"KL {metrics['kl_final']}; beta {training_args.beta} -> {trainer.beta:.4f} after {run.steps_summary(metrics['train_steps'], run.phase_seconds['train'])}. "
        f"Wrote {out / 'metrics.json'} and {out / 'rlhf.png'}",
        markup=False,
    )


def parse_args(argv=None):
    return parse_recipe_args((RLHFArguments, trl_ext.GRPOConfig, trl.ModelConfig), DEFAULT_CONFIG, argv, __doc__)


if __name__ == "__main__":
    recipe_main(main, parse_args)
