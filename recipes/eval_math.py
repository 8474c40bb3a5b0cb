"""Greedy accuracy of any model on GSM8K, MATH or generated arithmetic, with format/answer breakdown and every response.

    python recipes/eval_math.py                                                   # embedded model, 200 additions
    python recipes/eval_math.py --dataset_name data/gsm8k_test.jsonl --model_name_or_path outputs/grpo_math
    python recipes/eval_math.py --config recipes/configs/eval_math_gsm8k.yaml     # GPU: Qwen2.5-Math, vLLM

Generation: vLLM when it is installed and a GPU is present (``--backend auto``, the default), else Hugging Face
generate; ``--backend hf`` or ``vllm`` forces one. Writes metrics.json and responses.jsonl (every prompt, response,
answer, extracted answer and score) into --output_dir and prints a summary with examples of responses that failed to
parse. Options, data, the model path and --output_dir (writable; no finished evaluation there unless
--overwrite_output_dir) are checked before the model is loaded. metrics.json also records the command, the resolved
options, library versions and phase times.
"""

from dataclasses import dataclass, field
from pathlib import Path

import trl
from rich.console import Console
from rich.table import Table

from trl_ext import rewards
from trl_ext.data import infer_kind, load_math_dataset, make_arithmetic_dataset
from trl_ext.eval import BACKENDS, evaluate_math, load_eval_model
from trl_ext.models import DEFAULT_MODEL
from trl_ext.recipe_utils import (
    RecipeArguments,
    RecipeError,
    RecipeRun,
    check_model_options,
    parse_recipe_args,
    recipe_main,
    user_input,
)

REWARD_FNS = {
    "gsm8k": rewards.gsm8k_reward_fn,  # last number in the response; also grades generated arithmetic
    "math": rewards.math_reward_fn,  # \boxed{} / <answer> graded with math-verify
    "r1_zero": rewards.r1_zero_reward_fn,  # "</think> <answer> ... </answer>" format + math-verify
}
EXTRACTORS = {  # what each grader reads from a response (recorded as "extracted" in responses.jsonl)
    "gsm8k": rewards.extract_last_number,
    "math": rewards.extract_math_answer,
    "r1_zero": lambda response: rewards.extract_math_answer(response) if "</think> <answer>" in response else None,
}


@dataclass
class EvalArguments(RecipeArguments):
    """What to evaluate on and how."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Local .jsonl/.json/.parquet file or hub id (GSM8K or MATH columns); unset = generated arithmetic."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset config (GSM8K: 'main')."})
    dataset_split: str = field(default="test", metadata={"help": "Hub split (a local file is read whole)."})
    dataset_kind: str | None = field(default=None, metadata={"help": "'gsm8k', 'math' or 'arithmetic'; inferred when unset."})
    template: str = field(default="chat", metadata={"help": "'chat' (instruct models), 'r1_zero' or 'question_only'."})
    instruction: str | None = field(default="Answer with just the number.", metadata={"help": "Appended to each question; '' for none."})
    system_prompt: str | None = field(default=None, metadata={"help": "Optional system message for 'chat'."})
    reward: str | None = field(
        default=None, metadata={"help": f"One of {sorted(REWARD_FNS)}; default: r1_zero for that template, else by dataset kind."}
    )
    num_eval: int = field(default=200, metadata={"help": "Evaluate the first this many rows (generated: this many problems)."})
    arithmetic_digits: int = field(default=2, metadata={"help": "Digits per operand of generated problems."})
    max_new_tokens: int = field(default=24, metadata={"help": "Generation budget per response."})
    batch_size: int = field(default=50, metadata={"help": "Prompts per HF generate call (vLLM takes all at once)."})
    backend: str = field(default="auto", metadata={"help": f"One of {BACKENDS}."})
    num_examples: int = field(default=5, metadata={"help": "Examples (and unparsed examples) kept in metrics.json."})
    output_dir: str = field(default="outputs/eval_math", metadata={"help": "Where metrics.json and responses.jsonl go."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Drop malformed dataset rows with a warning."})


def load_eval_data(args: EvalArguments):
    """The evaluation rows (``prompt``, ``answer``) and the name of the reward that grades them."""
    if args.reward is not None and args.reward not in REWARD_FNS:
        raise RecipeError(f"--reward {args.reward!r} is not supported; expected one of {sorted(REWARD_FNS)}")
    common = dict(template=args.template, system_prompt=args.system_prompt, instruction=args.instruction or None)
    if args.dataset_name is None:
        data = make_arithmetic_dataset(args.num_eval, seed=1, split="test", digits=args.arithmetic_digits, **common)
        kind = "gsm8k"
    else:
        data = load_math_dataset(
            args.dataset_name, split=args.dataset_split, kind=args.dataset_kind, config_name=args.dataset_config,
            skip_bad_rows=args.skip_bad_rows, max_rows=args.num_eval, **common,
        )
        kind = "math" if (args.dataset_kind or infer_kind(data.column_names)) == "math" else "gsm8k"
    name = args.reward or ("r1_zero" if args.template == "r1_zero" else kind)
    return data, name


def main(args: EvalArguments, model_args: trl.ModelConfig) -> dict:
    run = RecipeRun("eval_math", args.output_dir, {"eval_args": args, "model_args": model_args},
                    overwrite=args.overwrite_output_dir)
    if args.backend not in BACKENDS:
        raise RecipeError(f"--backend {args.backend!r}: expected one of {BACKENDS}")
    check_model_options(model_args)
    with run.phase("load_data"), user_input("--dataset_name: " if args.dataset_name else ""):
        data, reward_name = load_eval_data(args)
    with run.phase("load_model"):
        model, tokenizer, backend = load_eval_model(model_args, args.backend)
    out = Path(args.output_dir)
    with run.phase("generate_and_grade"):
        result = evaluate_math(
            model, tokenizer, data, REWARD_FNS[reward_name], args.max_new_tokens, args.batch_size, "eval",
            args.num_examples, jsonl_path=out / "responses.jsonl", extract_fn=EXTRACTORS[reward_name],
        )
    metrics = {k: v for k, v in result.items() if k != "records"}
    metrics.update(
        model=model_args.model_name_or_path or DEFAULT_MODEL,
        dataset=args.dataset_name or f"generated {args.arithmetic_digits}-digit addition",
        reward=reward_name,
        max_new_tokens=args.max_new_tokens,
    )
    run.write_metrics(metrics)

    console = Console(soft_wrap=True)
    table = Table(title=f"{metrics['model']} on {metrics['dataset']} ({result['n']} problems, greedy, {backend})")
    for column in ("accuracy", "format rate", "format+answer ok", "format ok, wrong", "unparsed", "ex/s", "tok/s"):
        table.add_column(column)
    b = result["breakdown"]
    table.add_row(
        f"{result['accuracy']:.1%}", f"{result['format_rate']:.1%}", str(b["format1_answer1"]), str(b["format1_answer0"]),
        str(result["num_unparsed"]), f"{result['examples_per_second']:.2f}", f"{result['tokens_per_second']:.1f}",
    )
    console.print(table)
    for record in result["unparsed_examples"]:
        console.print(f"unparsed: {record['response']!r} (answer {record['answer']})", markup=False)
    console.print(f"Wrote {out / 'metrics.json'} and {out / 'responses.jsonl'}", markup=False)
    return metrics


def parse_args(argv=None):
    return parse_recipe_args((EvalArguments, trl.ModelConfig), None, argv, __doc__)


if __name__ == "__main__":
    recipe_main(main, parse_args)
