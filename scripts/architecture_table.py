"""Which causal-LM architectures keep trl_ext's speed savings, and why the others turn them off (docs/performance.md).

    uv run python scripts/architecture_table.py            # the representative set of tests/test_architectures.py
    uv run python scripts/architecture_table.py --all      # every causal-LM architecture transformers can build

For each architecture, a tiny random model is built from its config (tests/architectures.py; no downloads) and asked
what ``trl_ext.GRPOTrainer`` would ask it: ``trl_ext.shared_prompts.savings_decision`` (static rules, then the
sub-second probe against the plain computation) and ``training_noise`` (dropout in the training forward). It prints
a Markdown table: ``share`` (both savings on), ``skip only`` (prompt sharing off, zero-advantage skipping on),
``plain`` (both off), each with the reason; architectures the generic tiny config cannot build are listed as such.
The full GRPO-step comparison against the plain path is the test matrix (tests/test_architectures.py), not this.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from trl_ext.models import load_tokenizer
from trl_ext.shared_prompts import savings_decision, training_noise

_spec = importlib.util.spec_from_file_location("architectures", Path(__file__).resolve().parents[1] / "tests" / "architectures.py")
architectures = importlib.util.module_from_spec(_spec)  # the tiny configs of the test matrix
_spec.loader.exec_module(architectures)
FAST, all_causal_lm_types, tiny_model = architectures.FAST, architectures.all_causal_lm_types, architectures.tiny_model


def decide(name: str, vocab_size: int) -> tuple[str, str]:
    try:
        model = tiny_model(name, vocab_size)
    except Exception as err:  # noqa: BLE001 -- the generic tiny config does not fit every architecture
        return "not built", f"{type(err).__name__}: {str(err).splitlines()[0][:90]}"
    model.train()
    decision, noise = savings_decision(model), training_noise(model)
    share, skip = decision.share_prompts or noise, decision.skip_rows or noise
    if share is None and skip is None:
        return "share", ""
    if share is not None and skip is None:
        return "skip only", share
    return "plain", "; ".join(dict.fromkeys(r for r in (share, skip) if r))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every causal-LM architecture, not only the representative set")
    args = parser.parse_args(argv)
    vocab = len(load_tokenizer())
    names = list(FAST) + ([t for t in all_causal_lm_types() if t not in {n.split(":")[0] for n in FAST}] if args.all else [])
    print("| architecture | stands for | savings | why off |\n|---|---|---|---|")
    start = time.perf_counter()
    for name in names:
        what = FAST[name][1] if name in FAST else ""
        verdict, why = decide(name, vocab)
        print(f"| {name} | {what} | {verdict} | {why.replace('|', '/')} |", flush=True)
    print(f"\n{len(names)} architectures in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
