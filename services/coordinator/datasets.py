"""Where a run's problems come from: a built-in task, or a local JSONL/parquet file.

    builtin:<task>[:<digits>]   generated problems (see `pipelinerl.coordinator.tasks`), endless
    path/to/file.jsonl|.parquet rows with `prompt`, `answer` and optionally `verifier` (default
                                `math`), loaded with HF `datasets`, shuffled by the run's seed, one pass

    (an environment run)        episode seeds drawn from the run's seed, endless: every attempt
                                of a group plays the episode of the same seed

A file's prompts are wrapped in the tokenizer's chat template when a tokenizer with one is given.
Problems are numbered, so a resumed run continues from the journal's cursor.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.tasks import Problem, builtin_problems, parse_builtin

DEFAULT_VERIFIER = "math"
ENVIRONMENT = "environment"
"""The verifier of an environment run's problems: the environment rewards the episode."""


def open_problems(
    dataset: str, seed: int, start: int = 0, tokenizer: str | None = None
) -> Iterator[tuple[int, Problem]]:
    """(index, problem) pairs from problem number `start` on; with no dataset, an environment
    run's episodes (their prompt is the seed)."""
    if not dataset:
        source: Iterator[Problem] = (Problem(str(s), "", ENVIRONMENT) for s in episode_seeds(seed))
    elif dataset.startswith("builtin:"):
        task, digits = parse_builtin(dataset)
        source = builtin_problems(task, digits, seed)
    else:
        source = iter(_file_problems(Path(dataset), seed, tokenizer))
    return itertools.islice(enumerate(source), start, None)


def episode_seeds(seed: int) -> Iterator[int]:
    """The run's episode seeds, the same for every restart of it."""
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(63)


def _file_problems(path: Path, seed: int, tokenizer: str | None) -> list[Problem]:
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise InvalidArgument.field(
            "spec.dataset", f"expected builtin:<task> or a .jsonl/.parquet file, got {path}"
        )
    if not path.is_file():
        raise InvalidArgument.field("spec.dataset", f"no such file: {path}")
    import datasets

    builder = "parquet" if path.suffix == ".parquet" else "json"
    try:
        rows = datasets.load_dataset(builder, data_files=str(path), split="train").shuffle(seed=seed)
    except Exception as exc:  # the library raises a dozen types for an unreadable file
        raise InvalidArgument.field("spec.dataset", f"{path} cannot be read as {builder}: {exc}") from exc
    missing = {"prompt", "answer"} - set(rows.column_names)
    if missing:
        raise InvalidArgument.field("spec.dataset", f"{path} lacks the field(s) {', '.join(sorted(missing))}")
    if (kind := getattr(rows.features["prompt"], "dtype", "nested")) not in ("string", "large_string"):
        raise InvalidArgument.field("spec.dataset", f"{path}: `prompt` must be text, not {kind}")
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
