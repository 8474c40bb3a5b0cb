"""Direct preference optimization (trl_ext.DPOTrainer, the course's per-instance DPO loss) on the bundled pairs.

    uv run python recipes/dpo.py    # embedded SmolLM2-135M-Instruct, CPU, a few minutes
    uv run python recipes/dpo.py --config my.yaml --label_smoothing 0.1    # cDPO

Without `--config`, `recipes/configs/dpo.yaml` is used; command-line flags override it. The reference is the
starting model (its log-probs precomputed once, `precompute_ref_log_probs`). Trained on
`recipes/data/preferences_train.jsonl` and evaluated before and after on `preferences_test.jsonl`: preference
accuracy (fraction of pairs whose implicit reward beta * (log pi - log pi_ref) is higher for the chosen response),
implicit reward margin (mean beta * h) and the DPO loss. Before training the policy is the reference, so every
implicit reward is 0: accuracy 0, margin 0, loss log 2. Writes `metrics.json` into `output_dir`.

A `--config` file is layered over the recipe's defaults (it replaces only what it sets; flags override both). Data,
options and `--output_dir` are checked before the model is loaded. `--resume_from_checkpoint true` continues from the
latest checkpoint in `--output_dir` (the before-evaluation saved by the first run is reused); a finished run is
never overwritten unless `--overwrite_output_dir` is given. metrics.json also records the command, the resolved
configs, library versions and phase times.
"""

from dataclasses import dataclass, field
from pathlib import Path

import trl

import trl_ext
from trl_ext import cli, report
from trl_ext.data import preferences

HERE = Path(__file__).parent
DEFAULT_CONFIG = HERE / "configs" / "dpo.yaml"
KEYS = ("preference_accuracy", "reward_margin", "dpo_loss", "logp_chosen", "logp_rejected")  # the console table's rows


@dataclass
class ScriptArguments(cli.RecipeArguments):
    train_file: str = field(
        default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "Training JSONL."}
    )
    test_file: str = field(default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out JSONL."})
    conversational: bool = field(
        default=False, metadata={"help": "Wrap pairs as chat turns (tokenizer chat template); default plain text."}
    )
    skip_bad_rows: bool = field(
        default=False, metadata={"help": "Drop malformed rows with one counted warning instead of failing."}
    )


def evaluate(trainer) -> dict:
    metrics = trainer.evaluate()
    return {
        "preference_accuracy": metrics["eval_rewards/accuracies"],
        "reward_margin": metrics["eval_rewards/margins"],
        "dpo_loss": metrics["eval_loss"],
        "logp_chosen": metrics["eval_logps/chosen"],
        "logp_rejected": metrics["eval_logps/rejected"],
    }


@cli.recipe("dpo", (ScriptArguments, trl_ext.DPOConfig, trl.ModelConfig), DEFAULT_CONFIG)
def main(run, script_args: ScriptArguments, training_args, model_args: trl.ModelConfig) -> dict:
    # the decorator checked the folder, the checkpoint and the model's options; then the data, before the model loads
    with run.phase("load_data"):  # DPO has no margin: a margin column is dropped
        train, test = preferences.load_pair_files(
            script_args.train_file,
            script_args.test_file,
            conversational=script_args.conversational,
            skip_invalid=script_args.skip_bad_rows,
            margin=False,
        )
    cli.check_fills_one_step(len(train), training_args, f"--train_file {script_args.train_file}", "pairs")
    with run.phase("load_model"):
        model, tokenizer, peft_config = trl_ext.models.load_model_and_tokenizer(model_args)
    trainer = trl_ext.DPOTrainer(  # the reference: the starting model (its log-probs precomputed, or a frozen copy)
        model=model,
        args=training_args,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    # a resumed run reuses the before-evaluation of the same model, held-out file, recipe options and beta
    key = trl_ext.run.evaluation_key(
        model_args.model_name_or_path, script_args.test_file, script_args=script_args, beta=training_args.beta
    )
    before, train_output, after = run.train_and_evaluate(trainer, lambda: evaluate(trainer), key)
    if not trainer.accelerator.is_main_process:
        return {}
    beta, smoothing = training_args.beta, training_args.label_smoothing
    metrics = report.before_after_metrics(
        run,
        trainer,
        train_output,
        before,
        after,
        model=model_args.model_name_or_path,
        script_args=script_args,
        train_pairs=len(train),
        test_pairs=len(test),
        beta=beta,
        label_smoothing=smoothing,
    )
    caption = f"DPO (beta {beta}, label smoothing {smoothing}), {len(test)} held-out pairs"
    report.finish(
        run,
        metrics,
        [
            report.Record("DPO"),
            report.before_after_table(caption, before, after, KEYS),
            report.ConsoleLines(f"Trained on {len(train)} pairs: {run.steps_summary(train_output.global_step)}."),
        ],
    )
    return metrics


if __name__ == "__main__":
    cli.main(main)
