"""The token stream of one multi-turn episode: the prompt rendered once, the tokens each turn
sampled, and only the tokens of each environment reply appended after them.

    episode = EpisodeTokens(renderer, opening.messages, opening.tools, max_context=limits.max_context)
    while True:
        budget = episode.max_new_tokens(run_max_new_tokens)
        if budget == 0: end the episode as truncated (context exhausted)
        completion = generate(episode.token_ids, max_new_tokens=budget)
        turn = episode.add_turn(completion.tokens, completion.finish_reason)
        if turn.truncated: end the episode as truncated (cut by max_new_tokens; never bridged)
        reply = step(turn.message)
        if reply ended: break
        append = episode.add_reply(reply.messages)   # append.fork: count it
    samples = episode.samples()     # one per fork, each a SegmentedTokens

What the model sampled is never re-tokenized. After a reply, the whole history (reply and next
assistant opener included) is rendered, and the current sample's tokens must be that render's
first tokens, id for id: then the render's remaining tokens are the append, and the sample equals
a full render by construction. The tokens the loop adds that the model did not sample (Qwen's `\\n`
after `<|im_end|>`, an end-of-turn token the engine never produced, the reply, the opener) are
context tokens: no loss, no logprobs. When the check fails (a template that rewrites earlier turns,
such as one that strips `<think>`; tokens the model sampled that the tokenizer would split
otherwise; JSON the template re-serializes differently; an end token other than the template's),
the episode forks: the sample ends after the model's turn, and a new one starts from the full
render. A turn cut by `max_new_tokens` has no end to bridge from: the episode ends truncated.

An agent that runs its own loop sends its whole history with each call (`add_history` instead of
`add_reply`): the same check decides whether the call continues the sample (`continued`) or starts
a new one (`forks`: the agent rewrote, summarized or truncated its history, or its last turn was
cut by `max_new_tokens`, which is never bridged).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.environment.types import Message, Role, Tool


@dataclass(frozen=True)
class SegmentedTokens:
    """One sample of an episode: a single token list in which `model_spans` ([start, end) pairs, in
    order, context between any two) hold the tokens the model sampled, with their logprobs and
    weight versions (loss); every other token is context (prompt, environment replies, template
    scaffolding: no loss, no logprobs).

    A single-turn sample is the case of one span running to the end: `token_ids[:start]` is the
    prompt and the span is the completion."""

    token_ids: tuple[int, ...]
    model_spans: tuple[tuple[int, int], ...]
    logprobs: tuple[float, ...]
    """One per model token, span after span."""
    versions: tuple[int, ...]
    """The weight version of each model token, span after span."""

    @property
    def prompt_length(self) -> int:
        """Tokens before the first model token."""
        return self.model_spans[0][0] if self.model_spans else len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        return sum(end - start for start, end in self.model_spans)

    def loss_mask(self) -> list[bool]:
        """Per token: sampled by the model."""
        mask = [False] * len(self.token_ids)
        for start, end in self.model_spans:
            mask[start:end] = [True] * (end - start)
        return mask

    def segments(self) -> Iterator[tuple[int, int, bool]]:
        """(start, end, is_model) of the alternating context and model runs, covering every token."""
        position = 0
        for start, end in self.model_spans:
            if start > position:
                yield position, start, False
            yield start, end, True
            position = end
        if position < len(self.token_ids):
            yield position, len(self.token_ids), False


@dataclass(frozen=True)
class Fork:
    """Why the sample could not go on: the full render differs from it at token `at`."""

    at: int
    where: str
    """"earlier turns" (the template rewrote history the model already saw), "the model's turn"
    (the turn does not render back as sampled), "nothing added" (the render adds no token), or "a
    cut turn" (an agent's call after a turn cut by `max_new_tokens`)."""


@dataclass(frozen=True)
class AssistantTurn:
    message: Message
    """The turn as the environment receives it."""
    truncated: bool
    """Cut by `max_new_tokens` (or the context): end the episode as truncated."""
    closed: bool
    """The model sampled an end-of-turn token."""


@dataclass(frozen=True)
class Append:
    """What one reply added to the episode."""

    context_ids: tuple[int, ...]
    """Tokens after the model's turn, none sampled (no loss): the end of the turn the template writes,
    the reply, the next opener. After a fork: the new sample's whole prompt."""
    fork: Fork | None = None


@dataclass
class _Sample:
    token_ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def frozen(self) -> SegmentedTokens:
        return SegmentedTokens(
            tuple(self.token_ids), tuple(self.spans), tuple(self.logprobs), tuple(self.versions)
        )


class EpisodeTokens:
    """The samples of one episode, built turn by turn (`add_turn`, then `add_reply`, alternately)."""

    def __init__(
        self,
        renderer: ChatRenderer,
        opening: Sequence[Message],
        tools: Sequence[Tool] = (),
        *,
        max_context: int,
    ) -> None:
        if not opening:
            raise ValueError("an episode opens with at least one message")
        self._renderer = renderer
        self._tools = tuple(tools)
        self._messages: list[Message] = list(opening)
        self._max_context = max_context
        self._samples = [_Sample(renderer.render(self._messages, self._tools, add_generation_prompt=True))]
        self._awaiting_turn = True
        self._turn_start = 0
        self._truncated = False
        self.forks = 0
        """Samples started after the first: renders the sample could not be proven a prefix of."""
        self.continued = 0
        """Appends that continued the sample."""
        self.turns = 0

    @property
    def token_ids(self) -> list[int]:
        """The current sample's tokens: what the next turn is generated from."""
        return list(self._samples[-1].token_ids)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    def max_new_tokens(self, requested: int, *, at_least: int = 1) -> int:
        """`requested`, capped by what is left of the context; 0 when fewer than `at_least` tokens
        are left, and the episode must end as truncated."""
        left = self._max_context - len(self._samples[-1].token_ids)
        return min(requested, left) if left >= at_least else 0

    def add_turn(self, completion: TokenSequence, finish_reason: FinishReason) -> AssistantTurn:
        """Record a turn the model sampled (ids, logprobs, versions from the same engine output) and
        read it as a message."""
        if not self._awaiting_turn:
            raise ValueError("add_turn twice without a reply between")
        if finish_reason is FinishReason.ABORT:
            raise ValueError("an aborted turn is an infrastructure failure: restart the episode")
        ids = completion.token_ids
        if not (len(ids) == len(completion.logprobs) == len(completion.versions)):
            raise ValueError("a turn needs one logprob and one version per token")
        sample = self._samples[-1]
        self._turn_start = len(sample.token_ids)
        if ids:
            sample.spans.append((self._turn_start, self._turn_start + len(ids)))
        sample.token_ids += ids
        sample.logprobs += completion.logprobs
        sample.versions += completion.versions
        self.turns += 1
        message = self._renderer.parse(ids, turn=self.turns)
        self._messages.append(message)
        self._awaiting_turn = False
        self._truncated = finish_reason is FinishReason.LENGTH
        closed = self._renderer.end_of_turn(ids) is not None
        return AssistantTurn(message, self._truncated, closed)

    def add_reply(self, reply: Sequence[Message]) -> Append:
        """Append the environment's reply (and the next assistant opener) after the last turn, or
        fork when the sample is not a prefix of the full render."""
        if self._awaiting_turn:
            raise ValueError("add_reply without a turn before it")
        if self._truncated:
            raise ValueError("a turn cut by max_new_tokens ends the episode: it is never bridged")
        if any(m.role is Role.ASSISTANT for m in reply):
            raise ValueError("an environment's reply has no assistant message")
        return self._extend([*self._messages, *reply])

    def add_history(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> Append:
        """An agent's next call: the whole history it sends, and its tools. Continues the sample
        when the sample is the render's prefix, else forks; a turn cut by `max_new_tokens` always
        forks. Also after a call that generated no turn (it was refused): the history then
        extends the context appended for it."""
        if not messages:
            raise ValueError("a call holds at least one message")
        self._tools = tuple(tools)
        if self._awaiting_turn:  # the last call generated nothing: this one may repeat it
            return self._extend(list(messages), repeat=True)
        at = len(self._samples[-1].token_ids)
        return self._extend(list(messages), Fork(at, "a cut turn") if self._truncated else None)

    def _extend(self, messages: list[Message], fork: Fork | None = None, *, repeat: bool = False) -> Append:
        """Render `messages` (and the next opener) and append what the render adds after the sample,
        or start a new sample from the render (`fork`, or where the sample is not its prefix). With
        `repeat`, a render equal to the sample continues it, adding nothing."""
        self._messages = messages
        self._awaiting_turn = True
        full = self._renderer.render(self._messages, self._tools, add_generation_prompt=True)
        sample = self._samples[-1]
        if fork is None and not (repeat and full == sample.token_ids):
            fork = self._divergence(sample.token_ids, full)
        if fork is None:
            added = full[len(sample.token_ids) :]
            sample.token_ids += added
            self.continued += 1
            return Append(tuple(added), None)
        self.forks += 1
        self._samples.append(_Sample(full))
        return Append(tuple(full), fork)

    def _divergence(self, sample: list[int], full: list[int]) -> Fork | None:
        """None when `sample` is `full`'s prefix (a proper one: the reply adds tokens); else where
        they part."""
        common = min(len(sample), len(full))
        at = next((i for i in range(common) if sample[i] != full[i]), common)
        if at == len(sample) and len(full) > len(sample):
            return None
        if at < self._turn_start:
            return Fork(at, "earlier turns")
        if at < len(sample):
            return Fork(at, "the model's turn")
        return Fork(at, "nothing added")

    def samples(self) -> list[SegmentedTokens]:
        """Every sample of the episode so far, the first from the opening, one more per fork."""
        return [s.frozen() for s in self._samples]
