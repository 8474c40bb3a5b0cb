"""Say it once: one log line per distinct thing to say (a leaf: imports nothing of trl_ext).

A saving that turns itself off, an option that changed on resume, a warning about the run's completions: each is said
once per process (or once per trainer, with its own ``said`` set), not at every step that would say it again.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger("trl_ext")

SAID: set[Hashable] = set()
"""What this process has said (the keys of :func:`say_once`)."""


def say_once(
    message: str,
    *args: Any,
    key: Hashable = None,
    said: set[Hashable] | None = None,
    level: int = logging.WARNING,
    log: logging.Logger | None = None,
) -> bool:
    """Log ``message % args`` unless the same thing was said before; return whether it was said now.

    Args:
        message, args: the line, as ``logging`` formats it.
        key: what counts as the same thing (default: the message and its arguments); e.g. ``(id(model), reason)``
            to say a reason once per model.
        said: where what was said is kept (default: :data:`SAID`, once per process); a trainer passes a set of its
            own to say a thing once per trainer.
        level: the logging level (default WARNING).
        log: the logger (default ``logging.getLogger("trl_ext")``).
    """
    key = (message, *args) if key is None else key
    said = SAID if said is None else said
    if key in said:
        return False
    said.add(key)
    (log or logger).log(level, message, *args)
    return True
