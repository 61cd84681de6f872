"""Where a run's problems come from: a built-in task, or a local JSONL/parquet file; and the
held-out problems an evaluation set names.

    builtin:<task>[:<digits>]   generated problems (see `pipelinerl.coordinator.tasks`), endless;
                                an eighth of each task's prompts (by hash) is held out
    path/to/file.jsonl|.parquet rows with `prompt`, `answer` and optionally `verifier` (default
                                `math`), loaded with HF `datasets`; `eval_split` of them held out
                                by the run's seed, the rest trained on for `epochs` passes, each
                                shuffled in an order of its own (`dataset_files`)

    (an environment run)        episode seeds drawn from the run's seed, endless: every attempt
                                of a group plays the episode of the same seed; an eighth of all
                                seeds (by the hash of their decimal text) is held out

A file's prompts are wrapped in the tokenizer's chat template when a tokenizer with one is given.
Problems are numbered, so a resumed run continues from the journal's cursor: a file's problem
`pass × training rows + position` resumes that pass at that position.

Training never draws a held-out problem, and every run holds out the same built-in prompts and
episode seeds, so evaluations of `builtin:` and `environment:` sets compare across runs. A file's
held-out rows depend on the run's seed: only an evaluation of the run's own file sees them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.dataset_files import epoch_problems, read_rows, split_rows
from pipelinerl.coordinator.tasks import Problem, builtin_problems, held_out, held_out_problems, parse_builtin

ENVIRONMENT = "environment"
"""The verifier of an environment run's problems: the environment rewards the episode."""
ENDLESS_LIMIT = 256
"""Problems of an endless set (a built-in task, an environment) evaluated when `limit` is 0."""


def open_problems(
    dataset: str,
    seed: int,
    start: int = 0,
    tokenizer: str | None = None,
    *,
    epochs: int = 1,
    eval_split: float = 0.0,
) -> Iterator[tuple[int, Problem]]:
    """(index, problem) pairs from problem number `start` on; with no dataset, an environment
    run's episodes (their prompt is the seed). `epochs` and `eval_split` shape a file's only."""
    if not dataset:
        source: Iterator[Problem] = (Problem(str(s), "", ENVIRONMENT) for s in episode_seeds(seed))
    elif dataset.startswith("builtin:"):
        task, digits = parse_builtin(dataset)
        source = builtin_problems(task, digits, seed)
    else:
        rows = read_rows(Path(dataset), tokenizer, "spec.dataset")
        return epoch_problems(split_rows(rows, seed, eval_split).training, seed, epochs, start)
    return itertools.islice(enumerate(source), start, None)


def episode_seeds(seed: int) -> Iterator[int]:
    """The run's episode seeds, none held out, the same for every restart of it."""
    rng = random.Random(seed)
    while True:
        if not held_out(str(episode := rng.getrandbits(63))):
            yield episode


def held_out_episode_seeds(limit: int) -> list[int]:
    """The first `limit` held-out episode seeds, the same for every run."""
    rng = random.Random("held-out")  # not the run's seed: every run evaluates the same episodes
    seeds: list[int] = []
    while len(seeds) < limit:
        if held_out(str(episode := rng.getrandbits(63))):
            seeds.append(episode)
    return seeds


def evaluation_problems(
    name: str,
    *,
    run_dataset: str,
    seed: int,
    eval_split: float,
    tokenizer: str | None,
    limit: int,
    field: str = "spec.evaluations",
) -> list[Problem]:
    """The problems of the evaluation set `name` (`EvaluationSpec.dataset`), the first `limit` of
    them (0: every row of a file, ENDLESS_LIMIT of an endless set); InvalidArgument on `field`
    when the name does not resolve or the set is empty."""
    if name.startswith("builtin:"):
        task, size = parse_builtin(name, field)
        return held_out_problems(task, size, limit or ENDLESS_LIMIT)
    if name.startswith("environment:"):
        if not name.removeprefix("environment:"):
            raise InvalidArgument.field(field, f"expected environment:<name>, got {name!r}")
        return [Problem(str(s), "", ENVIRONMENT) for s in held_out_episode_seeds(limit or ENDLESS_LIMIT)]
    own = bool(run_dataset) and not run_dataset.startswith("builtin:")
    own = own and Path(name).resolve() == Path(run_dataset).resolve()
    if own and eval_split == 0:
        raise InvalidArgument.field(
            field, f"{name} is the run's dataset and eval_split is 0: every row of it is trained on"
        )
    rows = read_rows(Path(name), tokenizer, field)
    if own:
        rows = split_rows(rows, seed, eval_split).held_out
        if not rows:
            raise InvalidArgument.field(field, f"{name}: eval_split {eval_split} holds out no row of it")
    return rows[:limit] if limit else rows
