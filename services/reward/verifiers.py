"""Verifiers, and the reward function that combines them.

    ScoreItem ──► correctness verifier (item.verifier) ── score × correctness_weight ──┐
              └─► each extra term in RewardSpec       ── score × term.weight ─────────┴─► reward = Σ

A verifier is a name, a description and `score(prompt, completion, answer) -> (score, message)`.
It raises `BadAnswer` when the gold answer itself is unusable (the scorer reports that as
INVALID_ARGUMENT on the item's answer); any other exception is a verifier failure (INTERNAL).
Verifiers run inside the scorer's worker processes, which enforce the deadline, so nothing here
needs a timeout of its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipelinerl.reward.types import ScoreItem, VerifierDetail, VerifierInfo


class BadAnswer(ValueError):
    """The gold answer cannot be used by this verifier (empty, not a number, unparseable)."""


class RewardTerm(BaseModel):
    """A reward term added to every item on top of its correctness verifier."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verifier: str = Field(description="Name of the verifier, for example `format`.")
    weight: float = Field(description="Its weight in the reward sum; may be negative for a penalty.")


class RewardSpec(BaseModel):
    """How the reward of an item is computed: `correctness_weight * score(item.verifier) + Σ extra terms`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    correctness_weight: float = Field(
        default=1.0, description="Weight of the item's own verifier (its `verifier` field) in the reward."
    )
    extra_terms: list[RewardTerm] = Field(
        default_factory=list,
        description="Terms added to every item, e.g. `[{verifier: format, weight: 0.1}]` for a boxed answer.",
    )
    rel_tol: float = Field(default=1e-6, ge=0, description="`numeric`: relative tolerance (math.isclose).")
    abs_tol: float = Field(default=1e-9, ge=0, description="`numeric`: absolute tolerance (math.isclose).")
    format_pattern: str = Field(
        default=r"\\boxed\{.+\}",
        description="`format`: a regex searched in the completion (DOTALL); a match scores 1.0.",
    )
    python_function: str | None = Field(
        default=None,
        description=(
            "`python`: `package.module:function` or `path/to/file.py:function`, a function "
            "`score(prompt, completion, answer) -> float`. Unset means no `python` verifier."
        ),
    )
    max_completion_chars: int = Field(
        default=64 * 1024, gt=0, description="Longer completions are rejected as INVALID_ARGUMENT unscored."
    )

    @field_validator("format_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return pattern

    @field_validator("python_function")
    @classmethod
    def _names_a_function(cls, path: str | None) -> str | None:
        if path is not None and not all(path.rpartition(":")[::2]):
            raise ValueError(f"expected `module:function` or `file.py:function`, got {path!r}")
        return path

    @model_validator(mode="after")
    def _terms_exist(self) -> RewardSpec:
        names = available_verifiers(self)
        for term in self.extra_terms:
            if term.verifier not in names:
                raise ValueError(
                    f"extra term names unknown verifier {term.verifier!r}; known: {sorted(names)}"
                )
        return self


class Verifier(ABC):
    """Scores one completion. Subclasses set `name` and `description` (and `needs_answer = False`
    when they ignore the gold answer), and override `from_spec` when they take settings from the spec."""

    name: ClassVar[str]
    description: ClassVar[str]
    needs_answer: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> Verifier:
        return cls()

    @abstractmethod
    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        """Returns the score (usually in [0, 1]) and a short human-readable reason."""


class MathVerifier(Verifier):
    name = "math"
    description = (
        "Mathematical equivalence with math-verify: the last \\boxed{} or stated final answer of the "
        "completion against the gold answer (fractions, decimals, sets, intervals, expressions)."
    )

    def __init__(self) -> None:
        # Imported here so that listing verifiers or checking items never loads sympy.
        import math_verify

        self._parse = math_verify.parse
        self._verify = math_verify.verify

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        # math-verify's own timeouts are off (a timeout of 0 or None): they use SIGALRM and, on
        # expiry, silently score 0. The scorer's deadline turns a hang into DEADLINE_EXCEEDED instead.
        gold = self._parse(_as_latex(answer), parsing_timeout=0)
        if not gold:
            raise BadAnswer(f"math-verify cannot parse the gold answer {_clip(answer)!r}")
        # Only the last \boxed{} counts: math-verify would join every boxed answer of a completion
        # that corrects itself ("\boxed{3}, no: \boxed{4}") into the set {3, 4}.
        boxed = last_boxed(completion)
        target = completion if boxed is None else f"\\boxed{{{boxed}}}"
        predicted = self._parse(target, parsing_timeout=0)
        if not predicted:
            return 0.0, "no answer found in the completion"
        correct = self._verify(gold, predicted, timeout_seconds=None)
        return float(correct), f"expected {_clip(str(gold[-1]))}, got {_clip(str(predicted[-1]))}"


class ExactVerifier(Verifier):
    name = "exact"
    description = (
        "The final answer equals the gold answer after normalising case, spaces, `$` and a final period."
    )

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        predicted = final_answer(completion)
        return float(_normalise(predicted) == _normalise(answer)), f"got {_clip(predicted)!r}"


class NumericVerifier(Verifier):
    name = "numeric"
    description = "The last number of the final answer is within rel_tol/abs_tol of the numeric gold answer."

    def __init__(self, rel_tol: float, abs_tol: float) -> None:
        self._rel_tol = rel_tol
        self._abs_tol = abs_tol

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> Verifier:
        return cls(spec.rel_tol, spec.abs_tol)

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        try:
            gold = float(answer.strip().replace(",", ""))
        except ValueError:
            raise BadAnswer(f"the gold answer {_clip(answer)!r} is not a number") from None
        predicted = _last_number(final_answer(completion))
        if predicted is None:
            return 0.0, "no number in the final answer"
        close = math.isclose(predicted, gold, rel_tol=self._rel_tol, abs_tol=self._abs_tol)
        return float(close), f"expected {gold:g}, got {predicted:g}"


class DigitsVerifier(Verifier):
    name = "digits"
    description = (
        "Partial credit for the built-in digit task: the fraction of positions where the digits of the "
        "final answer match the gold digits, over the longer of the two (1.0 only for an exact match)."
    )

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        gold, predicted, _, matches = _digit_matches(completion, answer)
        # Per-position credit is dense even for a random model (about 0.1 per digit); dividing by
        # the longer length means padding the answer with extra digits earns nothing.
        return matches / max(len(gold), len(predicted)), f"{matches}/{len(gold)} digits match"


class StrictDigitsVerifier(Verifier):
    name = "digits_strict"
    description = (
        "As `digits`, but every character of the final answer counts toward its length: the matching "
        "digits over the longer of the gold digits and the whole final answer (1.0 only for an exact match)."
    )

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        # The digits align as in `digits`, so a policy that writes the right digits among others
        # still earns credit, but the others lengthen the answer: filler costs as much as a wrong
        # digit, and a completion is only as long as its answer once the credit is all earned.
        gold, _, stated, matches = _digit_matches(completion, answer)
        return matches / max(
            len(gold), len(stated)
        ), f"{matches}/{len(gold)} digits match, {len(stated)} characters"


def _digit_matches(completion: str, answer: str) -> tuple[str, str, str, int]:
    """(gold digits, the digits of the completion's final answer, that final answer, positions
    where the two strings of digits match)."""
    gold = answer.strip()
    if not gold.isdecimal():
        raise BadAnswer(f"the gold answer {_clip(answer)!r} is not a string of digits")
    stated = final_answer(completion)
    predicted = re.sub(r"\D", "", stated)
    return gold, predicted, stated, sum(a == b for a, b in zip(gold, predicted, strict=False))


class FormatVerifier(Verifier):
    name = "format"
    description = "1.0 when the completion matches the configured regex (by default a \\boxed{} answer)."
    needs_answer = False

    def __init__(self, pattern: str) -> None:
        self._pattern = re.compile(pattern, re.DOTALL)

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> Verifier:
        return cls(spec.format_pattern)

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        if self._pattern.search(completion):
            return 1.0, "format matches"
        return 0.0, f"does not match {self._pattern.pattern}"


class PythonVerifier(Verifier):
    name = "python"
    description = (
        "A user function `score(prompt, completion, answer) -> float` named by RewardSpec.python_function."
    )
    # The user's function decides what an empty answer means (a length or style reward needs none).
    needs_answer = False

    def __init__(self, function: Callable[[str, str, str], float]) -> None:
        self._function = function

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> Verifier:
        assert spec.python_function is not None, "available_verifiers() offers python only when it is set"
        return cls(load_function(spec.python_function))

    def score(self, prompt: str, completion: str, answer: str) -> tuple[float, str]:
        return float(self._function(prompt, completion, answer)), ""


VERIFIERS: dict[str, type[Verifier]] = {
    cls.name: cls
    for cls in (
        MathVerifier,
        ExactVerifier,
        NumericVerifier,
        DigitsVerifier,
        StrictDigitsVerifier,
        FormatVerifier,
        PythonVerifier,
    )
}


def available_verifiers(spec: RewardSpec) -> dict[str, type[Verifier]]:
    """The verifiers items may name under this spec: all built-ins, plus `python` when configured."""
    return {name: cls for name, cls in VERIFIERS.items() if name != "python" or spec.python_function}


def describe_verifiers(spec: RewardSpec) -> list[VerifierInfo]:
    """Names and descriptions of the available verifiers, sorted by name."""
    return [VerifierInfo(name, cls.description) for name, cls in sorted(available_verifiers(spec).items())]


class RewardFunction:
    """Builds every available verifier once, then scores items by the spec's weighted sum."""

    def __init__(self, spec: RewardSpec) -> None:
        self._spec = spec
        self._verifiers = {name: cls.from_spec(spec) for name, cls in available_verifiers(spec).items()}

    def score(self, item: ScoreItem) -> tuple[float, list[VerifierDetail]]:
        terms = [(item.verifier, self._spec.correctness_weight)]
        terms += [(term.verifier, term.weight) for term in self._spec.extra_terms]
        details = []
        for name, weight in terms:
            score, message = self._verifiers[name].score(item.prompt, item.completion, item.answer)
            if not math.isfinite(score):
                raise ValueError(f"verifier {name!r} returned a non-finite score {score}")
            details.append(VerifierDetail(name, score, weight, message))
        return sum(detail.weight * detail.score for detail in details), details


def load_function(path: str) -> Callable[[str, str, str], float]:
    """Loads `package.module:function` or `path/to/file.py:function`."""
    target, _, name = path.rpartition(":")
    if target.endswith(".py"):
        module_name = f"pipelinerl_user_reward_{Path(target).stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, target)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"cannot load {target!r} as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        # Registered so that dataclasses and pickling inside the user's module work.
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{target!r} has no function {name!r}")
    # a user's function: its signature is their promise, not something this can check
    return cast("Callable[[str, str, str], float]", function)


def final_answer(completion: str) -> str:
    """The answer a completion ends on: its last \\boxed{}, else what follows its last "answer is" or
    "answer:", else its last non-empty line."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    stated = _STATED_ANSWER.findall(completion)
    if stated:
        return stated[-1].strip()
    lines = completion.strip().splitlines()
    return lines[-1].strip() if lines else ""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None if there is none or it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for position in range(content_start - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[content_start:position]
    return None


_STATED_ANSWER = re.compile(r"answer\s*(?:is\s*:?|:)\s*(.+)", re.IGNORECASE)
# Digits with optional thousands separators, decimals and exponent: 1,234.5e-3.
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+(?:[eE][-+]?\d+)?")


def _last_number(text: str) -> float | None:
    numbers = _NUMBER.findall(text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def _normalise(answer: str) -> str:
    return " ".join(answer.strip().strip("$").strip().rstrip(".").split()).casefold()


def _as_latex(answer: str) -> str:
    # math-verify extracts only delimited LaTeX; a bare gold answer such as `\frac{1}{2}` parses to nothing.
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
