"""Disjoint train/test splits of generated problems (:mod:`trl_ext.data.arithmetic`, :mod:`trl_ext.data.sorting`).

A problem belongs to the test split when ``sha256(its canonical key)``, read as a fraction of 2**64, is below
``test_fraction``, else to the train split. The rule depends on the problem alone (not the seed or ``n``), so no
train set shares a problem with a test set drawn with the same ``test_fraction``. A dataset is ``n`` distinct problems
of one split, drawn by rejection.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from typing import Any


def in_test_split(key: str, test_fraction: float) -> bool:
    """True when the problem with canonical ``key`` belongs to the test split."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 < test_fraction


def check_split_request(n: int, split: str, test_fraction: float) -> None:
    """Raises ValueError naming ``n`` (expected >= 1), ``split`` ("train"/"test") or ``test_fraction`` (in (0, 1))."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")


def draw_distinct(
    n: int, split: str, draw: Callable[[], tuple[Hashable, bool, Any]], accept: Callable[[Any], Any]
) -> list[Any]:
    """Up to ``n`` problems of ``split`` in 100 * n + 10_000 draws: ``draw() -> (key, in_test, problem)``; a problem
    of the other split or with a key drawn before is rejected, an accepted one is kept as ``accept(problem)``."""
    seen: set[Hashable] = set()
    kept: list[Any] = []
    for _ in range(100 * n + 10_000):
        if len(kept) == n:
            break
        key, in_test, problem = draw()
        if in_test != (split == "test") or key in seen:
            continue
        seen.add(key)
        kept.append(accept(problem))
    return kept
