"""Where a run's problems come from: a built-in task, or a local JSONL/parquet file.

    builtin:<task>[:<digits>]   generated problems (see `pipelinerl.coordinator.tasks`), endless
    path/to/file.jsonl|.parquet rows with `prompt`, `answer` and optionally `verifier` (default
                                `math`), loaded with HF `datasets`, shuffled by the run's seed, one pass

A file's prompts are wrapped in the tokenizer's chat template when a tokenizer with one is given.
Problems are numbered, so a resumed run continues from the journal's cursor.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.tasks import Problem, builtin_problems, parse_builtin

DEFAULT_VERIFIER = "math"


def open_problems(
    dataset: str, seed: int, start: int = 0, tokenizer: str | None = None
) -> Iterator[tuple[int, Problem]]:
    """(index, problem) pairs from problem number `start` on."""
    if dataset.startswith("builtin:"):
        task, digits = parse_builtin(dataset)
        source: Iterator[Problem] = builtin_problems(task, digits, seed)
    else:
        source = iter(_file_problems(Path(dataset), seed, tokenizer))
    return itertools.islice(enumerate(source), start, None)


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
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    if not getattr(loaded, "chat_template", None):
        return lambda prompt: prompt
    return lambda prompt: loaded.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
