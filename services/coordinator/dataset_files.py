"""A file dataset's rows: read once per run, split into held-out and training rows by the run's
seed, and trained on for a number of passes (epochs), each in an order of its own.

The held-out rows are the first round(eval_split × rows) of one shuffle of the file drawn from the
seed, so a larger split only moves rows from training to held out. Each pass orders the training
rows by a shuffle drawn from the seed and the pass number alone, so a run resumed at problem
`pass × training rows + position` draws the rest of that pass as the first run would have, without
replaying the passes before it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.coordinator.tasks import Problem

DEFAULT_VERIFIER = "math"


@dataclass(frozen=True)
class Split:
    """A file's rows, held out or trained on."""

    held_out: list[Problem]
    """In the order of the seed's shuffle: an evaluation of the first N takes a random N."""
    training: list[Problem]
    """In file order; each pass shuffles them."""


def split_rows(rows: list[Problem], seed: int, eval_split: float) -> Split:
    """Rows, not prompts, are split: a prompt the file holds twice may land on both sides."""
    order = list(range(len(rows)))
    random.Random(f"{seed}:eval_split").shuffle(order)
    held = order[: round(eval_split * len(rows))]
    chosen = set(held)
    return Split([rows[i] for i in held], [row for i, row in enumerate(rows) if i not in chosen])


def epoch_problems(
    training: list[Problem], seed: int, epochs: int, start: int
) -> Iterator[tuple[int, Problem]]:
    """(index, problem) over `epochs` passes from problem `start` on: index = pass × rows + position."""
    rows = len(training)
    if rows == 0:
        return
    for epoch in range(start // rows, epochs):
        order = list(training)
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
        for position in range(max(start - epoch * rows, 0), rows):
            yield epoch * rows + position, order[position]


def read_rows(path: Path, tokenizer: str | None, field: str) -> list[Problem]:
    """Every row of a JSONL/parquet file in file order; InvalidArgument on `field` when the file
    cannot serve as a dataset."""
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InvalidArgument.field(field, f"expected builtin:<task> or a .jsonl/.parquet file, got {path}")
    if not path.is_file():
        raise InvalidArgument.field(field, f"no such file: {path}")
    try:
        import datasets
    except ImportError as exc:
        raise FailedPrecondition(
            f"reading {path} needs the `datasets` package: install pipelinerl[datasets] "
            "(in the coordinator image: build it with COORDINATOR_EXTRAS=coordinator,datasets)"
        ) from exc

    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # the library raises a dozen types for an unreadable file
        raise InvalidArgument.field(field, f"{path} cannot be read as {builder}: {exc}") from exc
    missing = {"prompt", "answer"} - set(rows.column_names)
    if missing:
        raise InvalidArgument.field(field, f"{path} lacks the field(s) {', '.join(sorted(missing))}")
    if (kind := getattr(rows.features["prompt"], "dtype", "nested")) not in ("string", "large_string"):
        raise InvalidArgument.field(field, f"{path}: `prompt` must be text, not {kind}")
    template = _chat_template(tokenizer)
    # a Dataset with no format set yields each row as a dict of column name to value
    return [
        Problem(template(row["prompt"]), str(row["answer"]), row.get("verifier") or DEFAULT_VERIFIER)
        for row in cast("Iterable[dict[str, Any]]", rows)
    ]


def _chat_template(tokenizer: str | None) -> Callable[[str], str]:
    """The prompt wrapper: the tokenizer's chat template if it has one, else the prompt unchanged."""
    if tokenizer is None:
        return lambda prompt: prompt
    from pipelinerl.common.tokenizer import load_tokenizer

    loaded = load_tokenizer(tokenizer)
    if not getattr(loaded, "chat_template", None):
        return lambda prompt: prompt

    def wrap(prompt: str) -> str:
        text = loaded.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)  # untokenized, one conversation
        return text

    return wrap
