"""Caches kept between the turns of an episode (`prompt_cache_key`): the next turn prefills only
what it added, and draws the same tokens with the same logprobs as a full prefill would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6, seed=7)
SETTINGS = EngineSettings(ignore_eos=True, max_running=8)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_preset("tiny", seed=0)


def encode(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def play(
    engine: InferenceEngine, openings: list[list[int]], replies: list[list[int]], *, keyed: bool = True
) -> dict[str, GenerationUpdate]:
    """Episodes of len(replies) + 1 turns, episode i joining at step i: each turn is submitted the
    step its last one ended, its prompt the last prompt + completion + the turn's reply, so that
    turns that take a kept cache share steps with decodes and with first turns. The final update
    of every turn, by request id."""
    prompts = {i: opening for i, opening in enumerate(openings)}
    turn = dict.fromkeys(prompts, 0)
    finals: dict[str, GenerationUpdate] = {}

    def submit(episode: int) -> None:
        key = f"episode-{episode}" if keyed else ""
        engine.add_request(
            GenerationRequest(f"{episode}-t{turn[episode]}", prompts[episode], SAMPLED, prompt_cache_key=key)
        )

    step = 0
    while step < len(openings) or engine.has_work:
        if step < len(openings):
            submit(step)
        for update in engine.step():
            if update.finish_reason is None:
                continue
            finals[update.request_id] = update
            episode = int(update.request_id.split("-")[0])
            if turn[episode] < len(replies):
                prompts[episode] = prompts[episode] + update.tokens.token_ids + replies[turn[episode]]
                turn[episode] += 1
                submit(episode)
        step += 1
    return finals


def test_later_turns_take_the_kept_cache_and_draw_what_a_full_prefill_draws(tiny: LoadedModel) -> None:
    openings = [encode(tiny, text) for text in ("guess 1 to 16", "12+34=", "a", "the quick brown fox")]
    replies = [encode(tiny, " higher "), encode(tiny, " lower, again: "), encode(tiny, " x")]
    kept = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS)
    fresh = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS.model_copy(update={"max_kept_caches": 0}))
    with_cache, without = play(kept, openings, replies), play(fresh, openings, replies)
    assert with_cache.keys() == without.keys() and len(with_cache) == 16
    for request_id, update in with_cache.items():
        assert update.tokens.token_ids == without[request_id].tokens.token_ids, request_id
        assert update.tokens.logprobs == pytest.approx(without[request_id].tokens.logprobs, abs=1e-4)
    stats, baseline = kept.stats(), fresh.stats()
    # Turns 2 to 4 of each episode reuse everything but their reply and the last completion token.
    prompt_lengths = [len(u.tokens.token_ids) for u in with_cache.values()]
    assert sum(prompt_lengths) == 16 * SAMPLED.max_new_tokens
    reusable = sum(
        len(openings[e]) + sum(len(r) for r in replies[: t - 1]) + t * SAMPLED.max_new_tokens - 1
        for e in range(4)
        for t in range(1, 4)
    )
    assert stats.reused_prompt_tokens == reusable
    assert baseline.reused_prompt_tokens == 0
    assert stats.prefill_tokens + stats.reused_prompt_tokens == baseline.prefill_tokens
    assert stats.kept_caches == 4  # the last turns' caches, until a swap or their rows are needed


def test_a_weight_swap_between_turns_leaves_nothing_to_reuse(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS)
    prompt = encode(tiny, "guess 1 to 16")
    engine.add_request(GenerationRequest("t0", prompt, SAMPLED, prompt_cache_key="e"))
    first = _run(engine)["t0"]
    assert engine.stats().kept_caches == 1
    weights = {name: p.detach().clone() for name, p in tiny.model.named_parameters()}
    engine.stage_weights(weights, version=1)
    second_prompt = prompt + first.tokens.token_ids + encode(tiny, " lower")
    engine.add_request(GenerationRequest("t1", second_prompt, SAMPLED, prompt_cache_key="e"))
    second = _run(engine)["t1"]
    assert set(second.tokens.versions) == {1}
    assert engine.stats().reused_prompt_tokens == 0


def test_a_turn_that_ran_across_a_swap_is_not_kept(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS)
    engine.add_request(GenerationRequest("t0", encode(tiny, "12+34="), SAMPLED, prompt_cache_key="e"))
    engine.step()
    engine.stage_weights({name: p.detach().clone() for name, p in tiny.model.named_parameters()}, version=1)
    final = _run(engine)["t0"]
    assert set(final.tokens.versions) == {0, 1}
    assert engine.stats().kept_caches == 0


def test_a_lag_allowance_keeps_caches_across_swaps_up_to_their_oldest_keys(tiny: LoadedModel) -> None:
    engine = InferenceEngine(
        tiny.model, tiny.tokenizer, SETTINGS.model_copy(update={"kept_cache_max_lag": 1})
    )
    same = {
        name: p.detach().clone() for name, p in tiny.model.named_parameters()
    }  # new versions, same weights
    prompt, reply = encode(tiny, "guess 1 to 16"), encode(tiny, " lower")
    reused = []

    def turn(request_id: str, **pinned: int) -> list[int]:
        nonlocal prompt
        engine.add_request(GenerationRequest(request_id, prompt, SAMPLED, prompt_cache_key="e", **pinned))
        drawn = _run(engine)[request_id].tokens.token_ids
        prompt = prompt + drawn + reply
        reused.append(engine.stats().reused_prompt_tokens - sum(reused))
        return drawn

    turn("t0")
    engine.stage_weights(same, version=1)
    turn("t1")  # its cache holds version 0's keys: one version behind, reused
    engine.stage_weights(same, version=2)
    turn("t2")  # the cache it would take still holds version 0's: two behind, prefilled whole
    engine.stage_weights(same, version=3)
    turn("t3", weight_version=3)  # pinned: only a cache of version 3 would do, and t2's is of 2
    turn("t4", weight_version=3)  # t3's is of 3
    assert [n > 0 for n in reused] == [False, True, False, False, True]


def test_a_prompt_that_does_not_extend_the_kept_cache_is_prefilled_whole(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS)
    reference = InferenceEngine(
        tiny.model, tiny.tokenizer, SETTINGS.model_copy(update={"max_kept_caches": 0})
    )
    prompt = encode(tiny, "guess 1 to 16")
    engine.add_request(GenerationRequest("t0", prompt, SAMPLED, prompt_cache_key="e"))
    first = _run(engine)["t0"]
    # A fork: the history rendered again, one token of the completion changed.
    tokens = first.tokens.token_ids
    forked = [*prompt, (tokens[0] + 1) % 50, *tokens[1:], *encode(tiny, " higher")]
    for target in (engine, reference):
        target.add_request(GenerationRequest("t1", forked, SAMPLED, prompt_cache_key="e"))
    got, expected = _run(engine)["t1"], _run(reference)["t1"]
    assert got.tokens.token_ids == expected.tokens.token_ids
    assert engine.stats().reused_prompt_tokens == 0
    assert engine.stats().kept_caches == 1  # t1's own


def test_the_least_recently_kept_cache_gives_its_row_up_first(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS.model_copy(update={"max_kept_caches": 2}))
    prompts = {key: encode(tiny, text) for key, text in (("a", "guess"), ("b", "12+34="), ("c", "the fox"))}
    finals = {}
    for key, prompt in prompts.items():  # one after another: a, then b, then c is kept
        engine.add_request(GenerationRequest(key, prompt, SAMPLED, prompt_cache_key=key))
        finals.update(_run(engine))
    assert engine.stats().kept_caches == 2
    for key, prompt in prompts.items():
        follow = prompt + finals[key].tokens.token_ids + encode(tiny, " x")
        engine.add_request(GenerationRequest(f"{key}2", follow, SAMPLED, prompt_cache_key=key))
    _run(engine)
    kept_b_c = sum(len(prompts[k]) + SAMPLED.max_new_tokens - 1 for k in ("b", "c"))
    assert engine.stats().reused_prompt_tokens == kept_b_c


def test_an_aborted_request_keeps_nothing_and_a_cache_key_is_bounded(tiny: LoadedModel) -> None:
    engine = InferenceEngine(tiny.model, tiny.tokenizer, SETTINGS)
    engine.add_request(GenerationRequest("t0", encode(tiny, "12+34="), SAMPLED, prompt_cache_key="e"))
    engine.step()
    engine.abort("t0")
    assert _run(engine)["t0"].finish_reason is FinishReason.ABORT
    assert engine.stats().kept_caches == 0
    with pytest.raises(InvalidArgument) as raised:
        engine.add_request(GenerationRequest("t1", [1, 2], SAMPLED, prompt_cache_key="k" * 129))
    assert raised.value.violations[0].field == "prompt_cache_key"


def _run(engine: InferenceEngine) -> dict[str, GenerationUpdate]:
    finals: dict[str, GenerationUpdate] = {}
    while engine.has_work:
        finals.update((u.request_id, u) for u in engine.step() if u.finish_reason is not None)
    return finals


def test_the_benchmark_draws_the_same_tokens_both_ways_and_prefills_less_with_kept_caches() -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "turn_cache.py"
    args = [
        "--episodes",
        "3",
        "--turns",
        "3",
        "--opening",
        "8",
        "--new",
        "4",
        "--reply",
        "2",
        "--repeats",
        "1",
    ]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    # 3 turns: prompts of 8, 8 + 4 + 2, 14 + 4 + 2; kept: the first whole, then the reply and one token
    assert figures["prefill_tokens_per_episode_whole"] == 8 + 14 + 20
    assert figures["prefill_tokens_per_episode_kept"] == 8 + 3 + 3
    assert figures["reused_share"] == round(28 / 42, 3)
