"""Grading throughput of ``trl_ext.rewards.math_reward_fn`` on ordinary MATH-style answers (issue 10, item 7).

Builds a fixed list of (response, ground truth) pairs -- fractions, roots, decimals, integers, expressions,
intervals, tuples, right and wrong -- grades them in the main thread, then other pairs of the same shapes in another
thread, then the first pairs
again (texts seen before, as the repeated reference of a GRPO group), and prints answers per second and how many
were graded right (which must not change between versions). Run: ``uv run python benchmarks/bench_grading.py``.
"""

from __future__ import annotations

import argparse
import threading
import time


def ordinary_pairs(n: int, first: int = 1) -> list[tuple[str, str]]:
    """n (response, ground truth) pairs, 6 of every 8 right, cycling through common answer shapes with k >= first."""
    shapes = []
    for k in range(first, first + 39):
        shapes += [
            (rf"so the answer is $\boxed{{\frac{{{k}}}{{{k + 1}}}}}$.", rf"\frac{{{k}}}{{{k + 1}}}"),
            (rf"Thus $\boxed{{{k / (k + 1):.6f}}}$", rf"\frac{{{k}}}{{{k + 1}}}"),
            (rf"We get $\boxed{{{2 * k}\sqrt{{2}}}}$", rf"\sqrt{{{8 * k * k}}}"),
            (rf"Final: \boxed{{{k + 1}}}", str(k)),
            (rf"The interval is $\boxed{{[{k}, {k + 3})}}$.", rf"[{k},{k + 3})"),
            (rf"Expanding, $\boxed{{x^2 + {2 * k}x + {k * k}}}$", rf"(x+{k})^2"),
            (rf"The point is $\boxed{{({k}, {-k})}}$", rf"({k},-{k})"),
            (rf"So $\boxed{{{k}\pi}}$ square units.", rf"{k + 1}\pi"),
        ]
    return [shapes[i % len(shapes)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=300, help="number of answers (default 300)")
    args = parser.parse_args()
    from trl_ext.rewards import math_reward_fn

    pairs, other_pairs = ordinary_pairs(args.n), ordinary_pairs(args.n, first=100)
    math_reward_fn(r"\boxed{0.5}", r"\frac{1}{2}")  # warm up: start the grading worker (math-verify)

    def run(batch: list[tuple[str, str]], out: dict) -> None:
        start = time.perf_counter()
        out["correct"] = sum(math_reward_fn(r, g)["reward"] for r, g in batch)
        out["seconds"] = time.perf_counter() - start

    results = {}
    results["main thread"] = {}
    run(pairs, results["main thread"])
    results["other thread"] = {}
    worker = threading.Thread(target=run, args=(other_pairs, results["other thread"]))
    worker.start()
    worker.join()
    results["main thread, same texts again"] = {}
    run(pairs, results["main thread, same texts again"])
    for name, res in results.items():
        print(
            f"{name}: {args.n} answers in {res['seconds']:.2f} s = {args.n / res['seconds']:.1f} answers/s, "
            f"{res['correct']:.0f} graded right"
        )


if __name__ == "__main__":
    main()
