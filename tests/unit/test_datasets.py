"""Problems from the built-in tasks and from local JSONL/parquet files."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.coordinator.datasets import open_problems

FIXTURE = Path(__file__).parents[1] / "fixtures" / "math_problems.jsonl"


def test_builtin_tasks_are_reproducible_and_resume_from_a_cursor() -> None:
    first = list(itertools.islice(open_problems("builtin:reverse:4", seed=3), 10))
    again = list(itertools.islice(open_problems("builtin:reverse:4", seed=3, start=5), 5))
    assert again == first[5:]
    for _, problem in first:
        digits = problem.prompt.removesuffix("=")
        assert len(digits) == 4 and problem.answer == digits[::-1] and problem.verifier == "digits"
    _, sort = next(open_problems("builtin:sort", seed=0))
    assert sort.answer == "".join(sorted(sort.prompt.removesuffix("=")))


@pytest.mark.parametrize("dataset", ["builtin:nope", "builtin:copy:0", "builtin:copy:x", "data.csv"])
def test_bad_dataset_names_the_field(dataset: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        next(open_problems(dataset, seed=0))
    assert exc.value.violations[0].field == "spec.dataset"


def test_jsonl_file_shuffled_by_seed_with_default_verifier() -> None:
    problems = [p for _, p in open_problems(str(FIXTURE), seed=1)]
    assert sorted(p.answer for p in problems) == sorted(["72", "10", "\\frac{5}{6}", "\\{-2, 2\\}"])
    assert {p.answer: p.verifier for p in problems}["\\frac{5}{6}"] == "math"
    assert {p.answer: p.verifier for p in problems}["10"] == "numeric"
    assert [p.answer for _, p in open_problems(str(FIXTURE), seed=1)] == [p.answer for p in problems]


def test_a_file_without_the_datasets_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as in the coordinator image's default venv
    with pytest.raises(FailedPrecondition, match=r"pipelinerl\[datasets\]"):
        next(open_problems(str(FIXTURE), seed=0))


def test_parquet_file_and_missing_fields(tmp_path: Path) -> None:
    import datasets

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    parquet = tmp_path / "math.parquet"
    datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]).to_parquet(
        parquet
    )
    assert len(list(open_problems(str(parquet), seed=0))) == 4
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    with pytest.raises(InvalidArgument, match="prompt"):
        next(open_problems(str(broken), seed=0))


def test_chat_template_wraps_file_prompts(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<assistant>"
    tokenizer.save_pretrained(tmp_path / "tok")
    _, problem = next(open_problems(str(FIXTURE), seed=0, tokenizer=str(tmp_path / "tok")))
    assert problem.prompt.startswith("<user>") and problem.prompt.endswith("</user><assistant>")
