"""The verifiers and their weighted combination, run in-process (the scorer's pool is tested apart)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.verifiers import (
    BadAnswer,
    DigitsVerifier,
    ExactVerifier,
    FormatVerifier,
    MathVerifier,
    NumericVerifier,
    PythonVerifier,
    RewardFunction,
    RewardSpec,
    describe_verifiers,
    final_answer,
)


@pytest.fixture(scope="module")
def math_verifier() -> MathVerifier:
    return MathVerifier()


@pytest.mark.parametrize(
    ("gold", "completion"),
    [
        (r"\frac{1}{2}", r"Half of it remains, so the answer is $\boxed{0.5}$."),
        ("0.5", r"We get \boxed{\frac{1}{2}}"),
        (r"\{1, 2, 3\}", r"The roots form the set \boxed{\{3, 2, 1\}}"),
        ("(0, 1]", r"So $x \in \boxed{(0,1]}$"),
        ("5 cm", r"The side is \boxed{5}"),
        ("5", "The final answer is 5 cm."),
        (r"\sqrt{2}", r"\boxed{\frac{2}{\sqrt{2}}}"),
        (r"10\%", r"\boxed{0.1}"),
        ("x^2+2x+1", r"Expanding nothing: \boxed{(x+1)^2}"),
        ("4", r"First \boxed{3}, but I made an error; corrected: \boxed{4}"),
    ],
)
def test_math_accepts_equivalent_answers(math_verifier: MathVerifier, gold: str, completion: str) -> None:
    score, message = math_verifier.score("", completion, gold)
    assert score == 1.0, message


@pytest.mark.parametrize(
    ("gold", "completion"),
    [
        (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}"),
        ("(0, 1]", r"\boxed{[0,1]}"),
        ("42", "I cannot solve this."),
        ("4", r"\boxed{4}... no wait, it is \boxed{5}"),
    ],
)
def test_math_rejects_wrong_answers(math_verifier: MathVerifier, gold: str, completion: str) -> None:
    assert math_verifier.score("", completion, gold)[0] == 0.0


def test_math_says_what_it_extracted(math_verifier: MathVerifier) -> None:
    assert math_verifier.score("", "no digits here", "3") == (0.0, "no answer found in the completion")
    assert "got" in math_verifier.score("", r"\boxed{7}", "3")[1]


def test_math_rejects_an_unparseable_gold_answer(math_verifier: MathVerifier) -> None:
    with pytest.raises(BadAnswer):
        math_verifier.score("", r"\boxed{1}", "$$")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (r"so \boxed{\frac{1}{2}} it is", r"\frac{1}{2}"),
        ("Let me think.\nThe final answer is: Paris.\nDone? yes", "Paris."),
        ("thinking\n\n  12 \n", "12"),
        ("", ""),
    ],
)
def test_final_answer(completion: str, expected: str) -> None:
    assert final_answer(completion) == expected


def test_exact_normalises_case_spaces_and_punctuation() -> None:
    verifier = ExactVerifier()
    assert verifier.score("", "The answer is  New   York.", "new york")[0] == 1.0
    assert verifier.score("", r"\boxed{$B$}", "b")[0] == 1.0
    assert verifier.score("", "The answer is Boston.", "new york")[0] == 0.0


def test_numeric_respects_its_tolerance() -> None:
    loose = NumericVerifier.from_spec(RewardSpec(rel_tol=1e-4))
    strict = NumericVerifier.from_spec(RewardSpec())
    assert loose.score("", "pi is about 3.1416", "3.14159")[0] == 1.0
    assert strict.score("", "pi is about 3.1416", "3.14159")[0] == 0.0
    assert strict.score("", r"\boxed{1,000}", "1000")[0] == 1.0
    assert strict.score("", "The answer is -2.5e-3", "-0.0025")[0] == 1.0
    assert strict.score("", "no idea", "1")[0] == 0.0


def test_numeric_rejects_a_non_numeric_gold_answer() -> None:
    with pytest.raises(BadAnswer):
        NumericVerifier(1e-6, 0.0).score("", "3", "three")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("12345", 1.0),
        ("12395", 0.8),
        ("The answer is 1 2 3 4 5", 1.0),
        ("123450", 5 / 6),
        ("54321", 0.2),
        ("no digits", 0.0),
    ],
)
def test_digits_gives_partial_credit_per_position(completion: str, expected: float) -> None:
    assert DigitsVerifier().score("", completion, "12345")[0] == pytest.approx(expected)


def test_digits_rejects_a_non_digit_gold_answer() -> None:
    with pytest.raises(BadAnswer):
        DigitsVerifier().score("", "12", "1a")


def test_format_checks_the_configured_pattern() -> None:
    boxed = FormatVerifier.from_spec(RewardSpec())
    assert boxed.score("", r"so \boxed{3}", "")[0] == 1.0
    assert boxed.score("", "so 3", "")[0] == 0.0
    thinking = FormatVerifier.from_spec(RewardSpec(format_pattern=r"^<think>.*</think>"))
    assert thinking.score("", "<think>a\nb</think> 3", "")[0] == 1.0
    assert thinking.score("", "3 <think></think>", "")[0] == 0.0


def test_python_verifier_loads_a_function_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text("def score(prompt, completion, answer):\n    return len(completion) / len(answer)\n")
    verifier = PythonVerifier.from_spec(RewardSpec(python_function=f"{path}:score"))
    assert verifier.score("", "ab", "abcd") == (0.5, "")


def test_python_verifier_loads_a_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "team_rewards.py").write_text("def length(prompt, completion, answer):\n    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    verifier = PythonVerifier.from_spec(RewardSpec(python_function="team_rewards:length"))
    assert verifier.score("", "", "") == (2.0, "")


def test_python_verifier_reports_a_missing_function(tmp_path: Path) -> None:
    path = tmp_path / "empty.py"
    path.write_text("")
    with pytest.raises(ValueError, match="no function 'score'"):
        PythonVerifier.from_spec(RewardSpec(python_function=f"{path}:score"))


def test_reward_is_the_weighted_sum_of_terms() -> None:
    spec = RewardSpec(correctness_weight=1.0, extra_terms=[{"verifier": "format", "weight": 0.1}])
    reward = RewardFunction(spec)

    def item(completion: str) -> ScoreItem:
        return ScoreItem("s", "What is 2+2?", completion, "4", "math")

    value, details = reward.score(item(r"\boxed{4}"))
    assert value == pytest.approx(1.1)
    assert [(d.verifier, d.score, d.weight) for d in details] == [("math", 1.0, 1.0), ("format", 1.0, 0.1)]
    assert reward.score(item(r"\boxed{5}"))[0] == pytest.approx(0.1)
    assert reward.score(item("it is 5"))[0] == 0.0


def test_a_non_finite_score_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "nan_reward.py"
    path.write_text("def score(prompt, completion, answer):\n    return float('nan')\n")
    reward = RewardFunction(RewardSpec(python_function=f"{path}:score"))
    with pytest.raises(ValueError, match="non-finite"):
        reward.score(ScoreItem("s", "", "", "1", "python"))


@pytest.mark.parametrize(
    "settings",
    [
        {"extra_terms": [{"verifier": "nonexistent", "weight": 1.0}]},
        {"extra_terms": [{"verifier": "python", "weight": 1.0}]},
        {"format_pattern": "(unclosed"},
        {"python_function": "no_colon_here"},
        {"max_completion_chars": 0},
    ],
)
def test_spec_rejects_bad_settings(settings: dict) -> None:
    with pytest.raises(ValidationError):
        RewardSpec(**settings)


def test_python_is_listed_only_when_configured() -> None:
    assert [info.name for info in describe_verifiers(RewardSpec())] == [
        "digits",
        "digits_strict",
        "exact",
        "format",
        "math",
        "numeric",
    ]
    configured = describe_verifiers(RewardSpec(python_function="pkg.mod:fn"))
    assert "python" in [info.name for info in configured]
    assert all(info.description for info in configured)
