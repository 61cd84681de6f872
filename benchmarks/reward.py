"""Throughput of the reward scorer on realistic math completions.

Scores a few thousand generated MATH-style items (integers, fractions, radicals, decimals, percents,
intervals, root sets, polynomials; right and wrong; boxed or stated answers after a page of
reasoning) with the `math` verifier on a worker pool, and the same verifier in-process on a sample,
so the pool's overhead and parallel gain show side by side. Ends with one JSON line on stdout:

    python benchmarks/reward.py [--items 3000] [--workers 2] [--batch 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from fractions import Fraction

import structlog

from pipelinerl.reward.scoring import Scorer
from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.verifiers import RewardFunction, RewardSpec

log = structlog.get_logger()

INLINE_ITEMS = 500


def make_problem(rng: random.Random) -> tuple[str, str, str]:
    """(gold answer, an equivalent answer in another form, a wrong answer), all LaTeX."""
    kind = rng.choices(
        ["integer", "fraction", "radical", "decimal", "percent", "interval", "roots", "polynomial"],
        weights=[40, 15, 10, 10, 5, 8, 7, 5],
    )[0]
    a, b = rng.randint(1, 40), rng.randint(2, 12)
    if kind == "integer":
        n = rng.randint(-500, 5000)
        return str(n), f"{n}.0", str(n + rng.choice([-1, 1, 10]))
    if kind == "fraction":
        value = Fraction(a * b + 1, b)
        return latex_fraction(value), f"{value.numerator}/{value.denominator}", latex_fraction(value + 1)
    if kind == "radical":
        m = rng.choice([2, 3, 5, 6, 7])
        return rf"{b}\sqrt{{{m}}}", rf"\sqrt{{{b * b * m}}}", rf"{b + 1}\sqrt{{{m}}}"
    if kind == "decimal":
        value = Fraction(a, 4)
        return f"{float(value)}", latex_fraction(value), f"{float(value) + 0.5}"
    if kind == "percent":
        return rf"{a}\%", f"{a / 100}", rf"{a + 1}\%"
    if kind == "interval":
        return f"(-{a}, {b}]", rf"\left(-{a}, {b}\right]", f"[-{a}, {b}]"
    if kind == "roots":
        return rf"\{{{a}, -{b}\}}", rf"\{{-{b}, {a}\}}", rf"\{{{a}, {b}\}}"
    # polynomial: (x + a)(x - b) expanded is the gold, the factored form is equivalent.
    return rf"x^2 + {a - b}x - {a * b}", f"(x+{a})(x-{b})", f"(x+{a})(x+{b})"


def latex_fraction(value: Fraction) -> str:
    return rf"\frac{{{value.numerator}}}{{{value.denominator}}}"


def reasoning(rng: random.Random) -> str:
    """A page of chain-of-thought filler with inline math, as a policy model writes it."""
    steps = []
    for step in range(rng.randint(4, 12)):
        p, q = rng.randint(2, 99), rng.randint(2, 99)
        steps.append(
            rng.choice(
                [
                    f"Step {step + 1}: we compute ${p} \\times {q} = {p * q}$, which we will need later.",
                    f"Next, substituting $x = {p}$ gives $x^2 - {q} = {p * p - q}$.",
                    f"Note that $\\frac{{{p}}}{{{q}}}$ cannot be simplified further, so we keep it.",
                    f"Let me double-check: {p} + {q} = {p + q}. Yes, that is consistent.",
                ]
            )
        )
    return "\n".join(steps)


def make_items(count: int, seed: int) -> tuple[list[ScoreItem], list[bool]]:
    rng = random.Random(seed)
    items, expected = [], []
    for index in range(count):
        gold, equivalent, wrong = make_problem(rng)
        correct = rng.random() < 0.5
        answer = equivalent if correct else wrong
        if rng.random() < 0.8:
            ending = f"Therefore, the final answer is $\\boxed{{{answer}}}$."
        else:
            ending = f"The final answer is ${answer}$."
        completion = f"{reasoning(rng)}\n{ending}"
        items.append(ScoreItem(f"bench-{index}", "Solve the problem.", completion, gold, "math"))
        expected.append(correct)
    return items, expected


async def score_in_pool(
    scorer: Scorer, items: list[ScoreItem], batch: int
) -> tuple[list[float | None], float]:
    """Sends all batches at once, as a coordinator with many finished groups does; (rewards, seconds)."""
    started = time.perf_counter()
    batches = [items[start : start + batch] for start in range(0, len(items), batch)]
    results = await asyncio.gather(*(scorer.score(chunk) for chunk in batches))
    elapsed = time.perf_counter() - started
    return [result.reward for chunk in results for result in chunk], elapsed


def score_inline(spec: RewardSpec, items: list[ScoreItem]) -> float:
    """Samples per second of the same reward function in this process, without workers."""
    reward = RewardFunction(spec)
    reward.score(items[0])  # math-verify's first call builds its parsers; keep that out of the timing
    started = time.perf_counter()
    for item in items:
        reward.score(item)
    return len(items) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--items", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # stdout carries only the final JSON line.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    # The inline run uses math-verify with its timeouts off, as the workers do; its warning is noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    items, expected = make_items(args.items, args.seed)
    spec = RewardSpec()
    started = time.perf_counter()
    scorer = Scorer(spec, workers=args.workers, timeout_s=10.0)
    startup_s = time.perf_counter() - started
    try:
        rewards, elapsed = asyncio.run(score_in_pool(scorer, items, args.batch))
        stats = scorer.stats
    finally:
        scorer.close()
    inline_per_s = score_inline(spec, items[:INLINE_ITEMS])

    agree = sum(reward == float(correct) for reward, correct in zip(rewards, expected, strict=True))
    samples_per_s = len(items) / elapsed
    log.info("reward benchmark done", items=len(items), seconds=round(elapsed, 2))
    report = {
        "samples_per_s": round(samples_per_s, 1),
        "items": len(items),
        "workers": args.workers,
        "batch": args.batch,
        "seconds": round(elapsed, 2),
        "startup_s": round(startup_s, 2),
        "inline_samples_per_s": round(inline_per_s, 1),
        "pool_vs_inline": round(samples_per_s / inline_per_s, 2),
        "agreement_with_labels": round(agree / len(items), 4),
        "timed_out": stats.timed_out,
        "failed": stats.failed + stats.invalid,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
