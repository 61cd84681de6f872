"""The method without the services: one process samples a batch with HF `generate`, scores it with
the reward service's verifier, and takes one optimizer step with the trainer's own learner (same
advantages, loss and optimizer) — the simple synchronous trainer that the services must beat, and
a fast bench for comparing the method's defaults over seeds (its curves are in samples, so a busy
machine changes its speed, not its figures).

    python benchmarks/single_process.py [--dataset builtin:copy:2] [--samples 40960] [--seed 0]
        [--lag 0] [--lr LR] [--entropy-coef C] [--entropy-floor F] [--temperature T]
        [--learner '{"loss": {"kind": "ppo"}}']

Its defaults are `pipelinerl run`'s (group size, samples per step, temperature, lr, entropy bonus
and its floor); `--learner` overrides any field of the trainer's learner config.

`--lag 1` samples each batch with the weights of one optimizer step before the learner's, as a
pipeline whose inference trails the trainer by one version does. `--in-flight` moves the sampling
weights one step closer halfway through each completion (`--max-new-tokens` / 2), as an update
arriving in flight does: a completion longer than that has tokens of two versions, `lag` and
`lag` − 1 behind (what `learner.loss.max_token_lag` judges token by token).

Ends with one JSON line: samples_per_s, reward_mean (mean reward over every sample of the run: the
reward per sample that `benchmarks/lag_study.py` compares), reward_last_8192 (mean reward over the
last 8,192 samples), samples_to_target (samples trained when the mean reward over the last 1,024
first reached --target; null if never), zero_variance_fraction and entropy (means over the last
8,192 samples' steps), step_kl (the size of each optimizer step: KL(before || after) over the
vocabulary at the completion positions of --kl-samples of the step's samples, at the sampling
temperature, averaged over steps and positions), and the settings.
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import json
import statistics
import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipelinerl.common.log import configure_logging
from pipelinerl.common.model import build_preset
from pipelinerl.common.types import FinishReason, Sample, TokenSequence
from pipelinerl.coordinator.tasks import builtin_problems, parse_builtin
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import merge
from pipelinerl.reward.verifiers import VERIFIERS
from pipelinerl.trainer.config import LearnerConfig
from pipelinerl.trainer.learner import TorchLearner

WINDOW, FINAL = 1024, 8192


def sample_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    group: int,
    max_new: int,
    temperature: float,
    newer: PreTrainedModel | None = None,
) -> list[tuple[list[int], TokenSequence, FinishReason]]:
    """`group` completions of each prompt: (prompt ids, completion with logprobs, finish reason).
    With `newer`, a completion's tokens past the first half of `max_new` are sampled by `newer`
    (an update arrived in flight), and their versions are 1 where the first half's are 0."""
    rows = [tokenizer(p)["input_ids"] for p in prompts for _ in range(group)]
    first = generate(model, tokenizer, rows, max_new if newer is None else max_new // 2, temperature)
    results = []
    more: dict[int, tuple[list[int], list[float], bool]] = {}
    if newer is not None:
        going = [row for row, (_, _, ended) in enumerate(first) if not ended]
        rest = generate(newer, tokenizer, [rows[r] + first[r][0] for r in going], max_new - max_new // 2,
                        temperature)  # fmt: skip
        more = dict(zip(going, rest, strict=True))
    for row, (tokens, logprobs, ended) in enumerate(first):
        versions = [0] * len(tokens)
        if row in more:
            tokens, logprobs, ended = tokens + more[row][0], logprobs + more[row][1], more[row][2]
            versions += [1] * len(more[row][0])
        reason = FinishReason.STOP if ended else FinishReason.LENGTH
        results.append((rows[row], TokenSequence(tokens, logprobs, versions), reason))
    return results


def generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[list[int]], max_new: int,
    temperature: float,
) -> list[tuple[list[int], list[float], bool]]:  # fmt: skip
    """Each row's sampled tokens up to its end-of-sequence, their logprobs, and whether it ended."""
    if not rows:
        return []
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]  # its causal LMs are GenerationMixins
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_new, output_scores=True, return_dict_in_generate=True, pad_token_id=pad,
        )  # fmt: skip
        # logprobs of the sampled tokens under the tempered distribution, as the inference server reports
        logprobs = model.compute_transition_scores(  # pyright: ignore[reportCallIssue]
            out.sequences, out.scores, normalize_logits=True
        )
    results = []
    for row in range(len(rows)):
        tokens, lps, ended = [], [], False
        for token, lp in zip(out.sequences[row, width:].tolist(), logprobs[row].tolist(), strict=True):
            tokens.append(token)
            lps.append(lp)
            if token == tokenizer.eos_token_id:
                ended = True
                break
        results.append((tokens, lps, ended))
    return results


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="builtin:copy:2")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--samples", type=int, default=40960)
    run = RunSettings.model_fields  # `pipelinerl run`'s defaults
    parser.add_argument("--group-size", type=int, default=run["group_size"].default)
    parser.add_argument("--samples-per-step", type=int, default=run["samples_per_step"].default)
    parser.add_argument("--max-new-tokens", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=run["temperature"].default)
    parser.add_argument("--lr", type=float, default=run["lr"].default)
    parser.add_argument("--entropy-coef", type=float, default=run["entropy_coef"].default)
    parser.add_argument("--entropy-floor", type=float, default=run["entropy_floor"].default,
                        help="nats per token; unset or 0: the bonus acts at every entropy")  # fmt: skip
    parser.add_argument("--learner", default="{}", help="LearnerConfig fields over the run's, as JSON")
    parser.add_argument("--lag", type=int, default=0, help="optimizer steps the sampling weights trail by")
    parser.add_argument(
        "--in-flight", action="store_true",
        help="with --lag: the sampling weights move one step closer halfway through each completion",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--kl-samples", type=int, default=32, help="samples of each step the step's KL is measured on"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def completion_logprobs(
    model: PreTrainedModel, samples: list[Sample], temperature: float
) -> list[torch.Tensor]:
    """Each sample's log-distribution over the vocabulary at every completion position, [tokens, vocab],
    at the sampling temperature."""
    rows = [list(s.prompt_token_ids) + list(s.completion.token_ids) for s in samples]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    out = []
    for row, sample in enumerate(samples):
        start = len(sample.prompt_token_ids) - 1  # the position that predicts the first completion token
        out.append(
            (logits[row, start : start + len(sample.completion.token_ids)] / temperature).log_softmax(-1)
        )
    return out


def consecutive_kl(before: list[torch.Tensor], after: list[torch.Tensor]) -> float:
    """Mean over completion positions of KL(before || after), exact over the vocabulary."""
    kl = [(b.exp() * (b - a)).sum(-1) for b, a in zip(before, after, strict=True)]
    return float(torch.cat(kl).mean())


def train(args: argparse.Namespace) -> dict:
    """One run; returns its figures (see the module's docstring)."""
    if args.in_flight and args.lag < 1:
        raise SystemExit("--in-flight needs --lag 1 or more: the update arrives from weights one step newer")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    loaded = build_preset(args.model, seed=args.seed)
    learner_config = {
        "lr": args.lr, "temperature": args.temperature,
        "loss": {"entropy_coef": args.entropy_coef, "entropy_floor": args.entropy_floor or None},
        "advantages": {"skip_zero_variance": False},
    }  # fmt: skip
    config = LearnerConfig.model_validate(merge(learner_config, json.loads(args.learner)))
    learner = TorchLearner(loaded.model, config, tokenizer=loaded.tokenizer)
    sampler = copy.deepcopy(loaded.model).eval()
    newer = copy.deepcopy(loaded.model).eval() if args.in_flight else None
    behind: collections.deque[dict[str, torch.Tensor]] = collections.deque()
    task, digits = parse_builtin(args.dataset)
    problems = builtin_problems(task, digits, args.seed)
    verifier = functools.cache(lambda name: VERIFIERS[name]())  # one instance per verifier name
    groups_per_step = args.samples_per_step // args.group_size

    rewards: list[float] = []
    steps: list[tuple[int, float, float | None]] = []  # (samples so far, zero-variance fraction, entropy)
    step_kls: list[float] = []
    reached: int | None = None
    started = time.perf_counter()
    for version in range(args.samples // (groups_per_step * args.group_size)):
        batch = [next(problems) for _ in range(groups_per_step)]
        prompts = [p.prompt for p in batch]
        rollouts = sample_batch(sampler, loaded.tokenizer, prompts, args.group_size, args.max_new_tokens,
                                args.temperature, newer)  # fmt: skip
        samples = []
        for i, (prompt_ids, tokens, reason) in enumerate(rollouts):
            problem = batch[i // args.group_size]
            # each token's version: the sampler's (the in-flight update's, one newer, past the half)
            versions = [max(version - args.lag + v, 0) for v in tokens.versions]
            tokens = TokenSequence(tokens.token_ids, tokens.logprobs, versions)
            text = str(loaded.tokenizer.decode(tokens.token_ids, skip_special_tokens=True))
            reward, _ = verifier(problem.verifier).score(problem.prompt, text, problem.answer)
            rewards.append(reward)
            samples.append(Sample(f"{version}-{i}", f"{version}-{i // args.group_size}", prompt_ids, tokens,
                                  reward, reason, args.group_size))  # fmt: skip
        measured = [s for s in samples[: args.kl_samples] if len(s.completion.token_ids)]
        before = completion_logprobs(learner.model, measured, args.temperature) if measured else []
        metrics = learner.step(samples, version)
        if measured:
            step_kls.append(
                consecutive_kl(before, completion_logprobs(learner.model, measured, args.temperature))
            )
        steps.append((len(rewards), metrics.zero_variance_groups / metrics.groups, metrics.entropy))
        if reached is None and len(rewards) >= WINDOW and statistics.fmean(rewards[-WINDOW:]) >= args.target:
            reached = len(rewards)
        # the sampler takes the learner's weights `lag` steps late
        behind.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
        if len(behind) > args.lag:
            sampler.load_state_dict(behind.popleft())
        if newer is not None and len(behind) == args.lag:  # the weights one step after the sampler's
            newer.load_state_dict(behind[0])
        if version % 20 == 0 and not args.quiet:
            print(f"{len(rewards):>7} samples  reward {statistics.fmean(rewards[-WINDOW:]):.3f}  "
                  f"zero-var {steps[-1][1]:.2f}  entropy {metrics.entropy or 0:.3f}  "
                  f"step KL {step_kls[-1] if step_kls else 0:.2e}", flush=True)  # fmt: skip
    elapsed = time.perf_counter() - started
    final = [s for s in steps if s[0] > len(rewards) - FINAL]
    entropies = [s[2] for s in final if s[2] is not None]
    return {
        "samples_per_s": round(len(rewards) / elapsed, 1),
        "reward_mean": round(statistics.fmean(rewards), 4),
        "reward_last_8192": round(statistics.fmean(rewards[-FINAL:]), 4),
        "samples_to_target": reached,
        "zero_variance_fraction": round(statistics.fmean(s[1] for s in final), 3),
        "entropy": round(statistics.fmean(entropies), 4) if entropies else None,
        "step_kl": statistics.fmean(step_kls) if step_kls else None,
        "target": args.target, "seed": args.seed, "lag": args.lag, "in_flight": args.in_flight,
        "dataset": args.dataset,
        "learner": config.model_dump(mode="json", exclude_defaults=True),
    }  # fmt: skip


def main() -> None:
    args = parser().parse_args()
    configure_logging("benchmark", level="warning")
    print(json.dumps(train(args)))


if __name__ == "__main__":
    main()
