"""A Bradley-Terry reward model (trl_ext.RewardTrainer) on the bundled preference pairs.

    uv run python recipes/reward_model.py    # embedded SmolLM2-135M-Instruct, CPU, a few minutes
    uv run python recipes/reward_model.py --config my.yaml --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct

Without `--config`, `recipes/configs/reward_model.yaml` is used; command-line flags override it. The causal LM is
loaded as a sequence classifier with one output (a fresh scalar head on the pretrained body), trained on
`recipes/data/preferences_train.jsonl` (format: trl_ext.data.preferences; the per-pair `margin` column is used
unless `--use_margin false`) and evaluated before and after on the held-out `preferences_test.jsonl`: pairwise
accuracy (fraction of pairs with r_chosen > r_rejected), mean reward margin and the Bradley-Terry loss. Writes
`metrics.json` and the trained model into `output_dir` (the model is what recipes/rlhf.py can load as a reward).

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
DEFAULT_CONFIG = HERE / "configs" / "reward_model.yaml"
KEYS = ("pairwise_accuracy", "reward_margin", "bt_loss")  # the console table's rows


@dataclass
class ScriptArguments(cli.RecipeArguments):
    train_file: str = field(
        default=str(HERE / "data" / "preferences_train.jsonl"), metadata={"help": "Training JSONL."}
    )
    test_file: str = field(default=str(HERE / "data" / "preferences_test.jsonl"), metadata={"help": "Held-out JSONL."})
    conversational: bool = field(
        default=False, metadata={"help": "Wrap pairs as chat turns (tokenizer chat template); default plain text."}
    )
    use_margin: bool = field(default=True, metadata={"help": "Use the per-pair margin column in the loss."})
    skip_bad_rows: bool = field(
        default=False, metadata={"help": "Drop malformed rows with one counted warning instead of failing."}
    )


def evaluate(trainer) -> dict:
    metrics = trainer.evaluate()
    return {
        "pairwise_accuracy": metrics["eval_accuracy"],
        "reward_margin": metrics["eval_margin"],
        "bt_loss": metrics["eval_loss"],
        "mean_reward": metrics["eval_mean_reward"],
    }


@cli.recipe("reward_model", (ScriptArguments, trl_ext.RewardConfig, trl.ModelConfig), DEFAULT_CONFIG)
def main(run, script_args: ScriptArguments, training_args, model_args: trl.ModelConfig) -> dict:
    # the decorator checked the folder, the checkpoint and the model's options; then the data, before the model loads
    with run.phase("load_data"):
        train, test = preferences.load_pair_files(
            script_args.train_file,
            script_args.test_file,
            conversational=script_args.conversational,
            skip_invalid=script_args.skip_bad_rows,
            margin=script_args.use_margin,
        )
    cli.check_fills_one_step(len(train), training_args, f"--train_file {script_args.train_file}", "pairs")
    model_path = trl_ext.models.resolve_model_name_or_path(model_args.model_name_or_path)  # embedded -> local folder
    training_args.model_init_kwargs = {
        **(training_args.model_init_kwargs or {}),
        "dtype": model_args.dtype,
        "revision": model_args.model_revision,
    }
    tokenizer = trl_ext.models.load_tokenizer(model_args.model_name_or_path, revision=model_args.model_revision)
    with run.phase("load_model"):  # the trainer loads the model from model_path, with a fresh scalar head
        trainer = trl_ext.RewardTrainer(
            model=model_path,
            args=training_args,
            train_dataset=train,
            eval_dataset=test,
            processing_class=tokenizer,
            peft_config=trl.get_peft_config(model_args),
        )
    # a resumed run reuses the before-evaluation of the same model, held-out file and recipe options
    key = trl_ext.run.evaluation_key(model_args.model_name_or_path, script_args.test_file, script_args=script_args)
    before, train_output, after = run.train_and_evaluate(trainer, lambda: evaluate(trainer), key)
    trainer.save_model(training_args.output_dir)
    if not trainer.accelerator.is_main_process:
        return {}
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
    )
    report.finish(
        run,
        metrics,
        [
            report.Record("Bradley-Terry reward model"),
            report.before_after_table(f"Bradley-Terry reward model, {len(test)} held-out pairs", before, after, KEYS),
            report.ConsoleLines(f"Trained on {len(train)} pairs: {run.steps_summary(train_output.global_step)}."),
            report.ModelCard(model_args.model_name_or_path, script_args.train_file),
        ],
        trainer=trainer,
    )
    return metrics


if __name__ == "__main__":
    cli.main(main)
