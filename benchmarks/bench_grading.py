"""Grading throughput of ``trl_ext.rewards.math_reward_fn`` on ordinary MATH-style answers (issue 10, item 7).

Builds a fixed list of (response, ground truth) pairs -- fractions, roots, decimals, integers, expressions,
intervals, tuples, right and wrong -- grades them in the main thread and in a worker thread, and prints answers per
second and the accuracy (which must not change between versions). Run: ``uv run python benchmarks/bench_grading.py``.
"""

from __future__ import annotations

import argparse
import threading
import time


def ordinary_pairs(n: int) -> list[tuple[str, str]]:
    """n (response, ground truth) pairs, about half of them right, cycling through common answer shapes."""
    shapes = []
    for k in range(1, 40):
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

    pairs = ordinary_pairs(args.n)
    math_reward_fn(r"\boxed{0.5}", r"\frac{1}{2}")  # warm up: start the grading worker (math-verify)

    def run(out: dict) -> None:
        start = time.perf_counter()
        out["correct"] = sum(math_reward_fn(r, g)["reward"] for r, g in pairs)
        out["seconds"] = time.perf_counter() - start

    main_thread: dict = {}
    run(main_thread)
    other: dict = {}
    worker = threading.Thread(target=run, args=(other,))
    worker.start()
    worker.join()
    for name, res in (("main thread", main_thread), ("other thread", other)):
        print(
            f"{name}: {len(pairs)} answers in {res['seconds']:.2f} s = {len(pairs) / res['seconds']:.1f} answers/s, "
            f"{res['correct']:.0f} graded right"
        )


if __name__ == "__main__":
    main()
