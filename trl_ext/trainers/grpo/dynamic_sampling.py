"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): train only on prompt groups that carry a gradient.

With ``GRPOConfig.dynamic_sampling`` the trainer draws whole extra generation rounds until each process holds as many
informative groups (some row's advantage nonzero) as its batch has groups, or ``max_sampling_rounds`` were drawn; the
rest is filled with the earliest uninformative groups, so shapes never change. Prompts come from the trainer's own
seeded permutation (or shuffled stream), saved with each checkpoint (``DynamicSamplingState``). The loss must declare
``zero_advantage_zero_gradient``. Same rule as verl's ``filter_groups`` and OpenRLHF's ``dynamic_filtering``; TRL has
none (huggingface/trl#3708).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import IterableDataset
from trl.trainer.utils import nanstd

from trl_ext import functional
from trl_ext.logs import say_once

logger = logging.getLogger("trl_ext")


def informative_groups(advantages: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups of consecutive rows carry a gradient.

    Args:
        advantages: (N,) per-row advantages, N a multiple of ``group_size``, rows of a group consecutive.
        group_size: G >= 1.

    Returns:
        (N // G,) bool: True where some row of the group has a nonzero advantage.

    Raises:
        ValueError: when N is not a multiple of ``group_size``.
    """
    if group_size < 1 or advantages.numel() % group_size:
        raise ValueError(f"advantages has {advantages.numel()} rows; expected a multiple of group_size={group_size}")
    return (advantages.view(-1, group_size) != 0).any(dim=1)


def select_groups(informative: list[torch.Tensor], wanted: int) -> list[tuple[int, int]]:
    """The (round, group) pairs a batch of ``wanted`` groups is made of: informative groups in the order drawn, then
    the earliest uninformative ones when fewer than ``wanted`` were found.

    Args:
        informative: per round, (groups,) bool from ``informative_groups``.
        wanted: groups the batch must hold.

    Returns:
        ``wanted`` pairs (round index, group index within the round), informative first.
    """
    good = [(r, g) for r, flags in enumerate(informative) for g in flags.nonzero().flatten().tolist()]
    rest = [(r, g) for r, flags in enumerate(informative) for g in (~flags).nonzero().flatten().tolist()]
    return (good + rest)[:wanted]


def _align(tensors: list[torch.Tensor], left: bool, value: float) -> list[torch.Tensor]:
    width = max(t.size(1) for t in tensors)
    out = []
    for t in tensors:
        pad = torch.full((t.size(0), width - t.size(1), *t.shape[2:]), value, dtype=t.dtype, device=t.device)
        out.append(torch.cat([pad, t] if left else [t, pad], dim=1))
    return out


def whole_groups_problem(
    per_device_batch: int,
    steps_per_generation: int,
    group_size: int,
    flags: bool = False,
    steps_name: str = "steps_per_generation",
) -> str | None:
    """Why one process's generation batch is not a whole number of prompt groups, or None: dynamic sampling picks
    whole groups on each process (upstream may split a group across processes).

    Args:
        per_device_batch: ``per_device_train_batch_size``.
        steps_per_generation: TRL's ``steps_per_generation`` (default ``gradient_accumulation_steps``).
        group_size: ``num_generations``.
        flags: word it with the command-line flags (``--per_device_train_batch_size 6``) instead of field names.
        steps_name: the option that set ``steps_per_generation`` (``gradient_accumulation_steps`` when it was not
            given: TRL's default).
    """
    rows = per_device_batch * steps_per_generation
    if rows % group_size == 0:
        return None
    name = (lambda n, v: f"--{n} {v}") if flags else (lambda n, v: f"{n} ({v})")
    return (
        f"{name('per_device_train_batch_size', per_device_batch)} x {name(steps_name, steps_per_generation)} "
        f"= {rows} is not a multiple of {name('num_generations', group_size)}"
    )


PROMPT_KEYS = ("prompt_ids", "prompt_mask")
ROW_KEYS = ("advantages",)


def merge_rounds(
    rounds: list[dict[str, Any]], picks: list[tuple[int, int]], group_size: int, pad_token_id: int
) -> dict[str, Any]:
    """One batch from the picked groups of several rounds' outputs of ``_generate_and_score_completions``.

    Prompt tensors (``prompt_ids``, ``prompt_mask``: left-padded) are padded on the left to the longest round,
    completion-aligned tensors ((B, C): ids, mask, per-token log-probs, ratios) on the right with 0 (masked out),
    per-row tensors are concatenated. ``num_items_in_batch`` is left to the caller.
    """
    merged: dict[str, Any] = {}
    for key, first in rounds[0].items():
        if key == "num_items_in_batch" or not torch.is_tensor(first) or first.dim() == 0:
            continue
        parts = []
        for r, g in picks:
            parts.append(rounds[r][key][g * group_size : (g + 1) * group_size])
        if first.dim() >= 2 and key in PROMPT_KEYS:
            parts = _align(parts, left=True, value=pad_token_id if key == "prompt_ids" else 0)
        elif first.dim() >= 2:
            parts = _align(parts, left=False, value=pad_token_id if key == "completion_ids" else 0)
        merged[key] = torch.cat(parts)
    return merged


STREAM_SHUFFLE_BUFFER = 1000
"""Rows of a streaming training set held by the shuffle of dynamic sampling's extra rounds (``datasets``' default)."""


@dataclass
class DynamicSamplingState:
    """Where the extra rounds' prompts come from, and the position in it. Saved with each checkpoint
    (``as_dict``/``from_dict``), so a resumed run draws the same prompts.

    A map-style training set (``size`` its length): a permutation of its indices drawn from ``seed + epoch``. A
    streaming one (``datasets.IterableDataset``, ``size`` None): the stream shuffled with ``seed`` and a buffer of
    ``STREAM_SHUFFLE_BUFFER`` rows, ``set_epoch(epoch)`` (datasets shuffles epoch e with seed + e), read from
    ``position``; a resumed run opens the stream again and skips ``position`` rows.
    """

    seed: int
    size: int | None
    epoch: int = 0
    position: int = 0
    _rows: Iterator[dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    _rows_at: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def take(self, count: int) -> list[int]:
        """The next ``count`` dataset indices (the same on every process), moving to a new permutation at the end."""
        out: list[int] = []
        while len(out) < count:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
            chunk = order[self.position : self.position + count - len(out)]
            out += chunk
            self.position += len(chunk)
            if self.position >= self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def take_rows(self, dataset: Any, count: int) -> list[dict[str, Any]]:
        """The next ``count`` rows of ``dataset`` (the same on every process): by index for a map-style set
        (``take``), else from the shuffled stream, starting its next epoch when it ends.

        Raises:
            ValueError: a stream with no row.
        """
        if self.size is not None:
            return [dataset[i] for i in self.take(count)]
        rows: list[dict[str, Any]] = []
        while len(rows) < count:
            if self._rows is None or self._rows_at != (self.epoch, self.position):
                stream = dataset.shuffle(seed=self.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
                stream.set_epoch(self.epoch)
                self._rows = itertools.islice(iter(stream), self.position, None)
            row = next(self._rows, None)
            if row is None:
                if self.position == 0:
                    raise ValueError("dynamic_sampling: the streaming training set yields no row")
                self.epoch, self.position, self._rows = self.epoch + 1, 0, None
                continue
            rows.append(row)
            self.position += 1
            self._rows_at = (self.epoch, self.position)
        return rows

    def as_dict(self) -> dict[str, int | None]:
        return {"seed": self.seed, "size": self.size, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, state: dict[str, int | None]) -> DynamicSamplingState:
        return cls(**state)


class DynamicSamplingMixin:
    """Adds dynamic sampling to ``trl_ext.GRPOTrainer``: ``_generate_and_score_completions`` draws rounds through
    ``_generate_and_score_round`` (the trainer's one-round method) until the batch is informative."""

    _dynamic_state: DynamicSamplingState | None = None

    def _check_dynamic_sampling(self) -> None:
        args = self.args
        problem = whole_groups_problem(
            args.per_device_train_batch_size, args.steps_per_generation, self.num_generations
        )
        if problem:
            raise ValueError(f"dynamic_sampling needs whole groups on each process: {problem}")
        if args.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds={args.max_sampling_rounds}; expected >= 1")
        streaming = isinstance(self.train_dataset, IterableDataset)  # no len(): drawn from the stream
        size = None if streaming else len(self.train_dataset)
        self._dynamic_state = DynamicSamplingState(seed=args.seed + 1_000_003, size=size)

    def _log_trained_rewards(self, rewards: list[tuple[torch.Tensor, torch.Tensor]], picks: list[tuple[int, int]]):
        """Log the trained batch's ``dynamic_sampling/reward``, ``reward_std`` and ``frac_reward_zero_std`` (all
        processes), beside upstream's ``reward``, ``reward_std`` and ``frac_reward_zero_std``, which keep their
        meaning over everything generated (every round, as each round appends its own value)."""
        size = self.num_generations
        picked = [
            (rewards[r][0][g * size : (g + 1) * size], rewards[r][1][g * size : (g + 1) * size]) for r, g in picks
        ]
        batch = self.accelerator.gather(torch.cat([reward for reward, _ in picked]))
        terms = self.accelerator.gather(torch.cat([term for _, term in picked]))
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/reward"].append(torch.nanmean(batch).item())
        metrics["dynamic_sampling/reward_std"].append(nanstd(batch).item())
        equal = functional.equal_reward_groups(batch, size, terms)
        metrics["dynamic_sampling/frac_reward_zero_std"].append(equal.float().mean().item())

    def _draw_round_inputs(self, local_groups: int) -> list[dict[str, Any]]:
        """This process's rows of a new round: each of its prompts ``num_generations`` times, as upstream's
        ``RepeatSampler`` gives them (processes take consecutive slices of the same global draw)."""
        total = local_groups * self.accelerator.num_processes
        rows = self._dynamic_state.take_rows(self.train_dataset, total)
        mine = rows[self.accelerator.process_index * local_groups : (self.accelerator.process_index + 1) * local_groups]
        return [row for row in mine for _ in range(self.num_generations)]

    def _generate_and_score_completions(self, inputs):
        # every round of the generation batch is drawn with the same weights: generation's packed linear weights
        # (GRPOSpeedMixin._fixed_generation_weights) are packed once for all of them and dropped when it is complete
        with self._fixed_generation_weights():
            return self._generate_and_score_rounds(inputs)

    def _generate_and_score_rounds(self, inputs):
        """The generation batch: one round (``_generate_and_score_round``), or with ``dynamic_sampling`` rounds
        until every process holds enough informative groups (at most ``max_sampling_rounds``), merged."""
        if not (self.args.dynamic_sampling and self.model.training):
            return self._generate_and_score_round(inputs)
        group_size = self.num_generations
        rounds = [self._generate_and_score_round(inputs)]
        rewards = [self._round_rewards]  # per round: this process's (rewards (B,), terms (B, K))
        wanted = rounds[0]["completion_ids"].size(0) // group_size
        found = [informative_groups(rounds[0]["advantages"], group_size)]
        device = self.accelerator.device
        while len(rounds) < self.args.max_sampling_rounds:
            # every process draws again while any process lacks informative groups: the same collective work
            have = torch.tensor([int(sum(f.sum() for f in found))], device=device)
            if int(self.accelerator.gather(have).min()) >= wanted:
                break
            rounds.append(self._generate_and_score_round(self._draw_round_inputs(wanted)))
            rewards.append(self._round_rewards)
            found.append(informative_groups(rounds[-1]["advantages"], group_size))
        picks = select_groups(found, wanted)
        self._log_trained_rewards(rewards, picks)
        output = merge_rounds(rounds, picks, group_size, self.processing_class.pad_token_id)
        items = output["completion_mask"].sum()
        output["num_items_in_batch"] = self.accelerator.gather(items.reshape(1)).sum()
        counts = torch.tensor(
            [len(rounds), sum(f.numel() for f in found), sum(int(found[r][g]) for r, g in picks)],
            device=device,
            dtype=torch.float,
        )
        counts = self.accelerator.gather(counts.reshape(1, 3)).view(-1, 3)
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/rounds"].append(counts[:, 0].max().item())
        metrics["dynamic_sampling/groups_drawn"].append(counts[:, 1].sum().item())
        metrics["dynamic_sampling/groups_kept"].append(counts[:, 2].sum().item())
        metrics["dynamic_sampling/groups_wanted"].append(float(wanted * self.accelerator.num_processes))
        if counts[:, 2].sum().item() == 0:  # once per trainer: every step that follows would say the same
            say_once(
                "dynamic_sampling: %d generation rounds (max_sampling_rounds) drew %d groups and none had rewards that "
                "differ, so this step trains on nothing and every extra round was spent in vain; the model may never "
                "score on this task (all rewards 0?): check its prompts and answer format, or lower "
                "max_sampling_rounds",
                int(counts[:, 0].max().item()),
                int(counts[:, 1].sum().item()),
                key="nothing to learn",
                said=self._said,
                log=logger,
            )
        return output
