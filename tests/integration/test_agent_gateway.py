"""The agent gateway through a real uvicorn server on 127.0.0.1, called by the official `openai`
client and by plain HTTP: a tool-calling round trip (non-streaming and streaming) recorded into one
sample, and the refusals in OpenAI's error shape. The inference pool behind it is scripted (the
model's turns are given as text), so that the model calls a tool when the test needs it to."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence
from pipelinerl.coordinator.agent_episode import AgentRecorder
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.coordinator.gateway import AgentGateway
from pipelinerl.inference.types import Completion, GenerationRequest

TOKENIZER = build_tokenizer()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a+b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
QUESTION = {"role": "user", "content": "347+582"}
CALL = '<call>add{"a":347,"b":582}</call>'
CALL_TOKENS = len(TOKENIZER.encode(CALL, add_special_tokens=False)) + 1  # and <eos>


@dataclass
class ScriptedPool:
    """Answers each generation with the next text of `turns` (then `<eos>`), version 7."""

    turns: list[str]
    requests: list[GenerationRequest] = field(default_factory=list)

    async def generate(self, request: GenerationRequest, prefer: str = "") -> tuple[str, Completion]:
        self.requests.append(request)
        ids = [*TOKENIZER.encode(self.turns.pop(0), add_special_tokens=False), TOKENIZER.eos_token_id]
        tokens = TokenSequence(ids, [-0.5] * len(ids), [7] * len(ids))
        return "127.0.0.1:1", Completion(
            request.request_id, request.prompt_token_ids, tokens, "", FinishReason.STOP
        )


@pytest.fixture
async def gateway() -> AsyncIterator[AgentGateway]:
    gateway = AgentGateway(model="tiny")
    await gateway.start()
    yield gateway
    await gateway.close()


def recorder(pool: ScriptedPool, gateway: AgentGateway) -> AgentRecorder:
    """An episode on `pool` with the run's sampling: 40 tokens a turn at temperature 1."""
    sampling = SamplingParams(max_new_tokens=40)
    renderer = ChatRenderer(TOKENIZER)
    return AgentRecorder(
        "run-p0-a0.0",
        renderer,
        pool,
        sampling,
        max_context=512,
        model="tiny",
        counts=gateway.counts,  # type: ignore[arg-type]
    )


def assert_one_sample_of_two_turns(episode: AgentRecorder) -> None:
    assert episode.tokens is not None
    (sample,) = episode.tokens.samples()
    text = str(TOKENIZER.decode(list(sample.token_ids)))
    assert (
        text == '<bos>F:add(a,b) a+b\nU:347+582\nA:<call>add{"a":347,"b":582}</call><eos>\nT:929\nA:929<eos>'
    )
    spans = [str(TOKENIZER.decode(list(sample.token_ids[a:b]))) for a, b in sample.model_spans]
    assert spans == ['<call>add{"a":347,"b":582}</call><eos>', "929<eos>"]
    assert set(sample.versions) == {7} and len(sample.logprobs) == sample.model_tokens


async def test_the_openai_client_round_trips_a_tool_call(gateway: AgentGateway) -> None:
    pool = ScriptedPool([CALL, "929"])
    episode = recorder(pool, gateway)
    with gateway.episode(episode) as (base_url, key):
        async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
            messages: list = [QUESTION]
            first = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, logprobs=True, max_tokens=30, temperature=0.5
            )
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == ""
            (call,) = choice.message.tool_calls or []
            assert call.type == "function" and call.function.name == "add"
            assert json.loads(call.function.arguments) == {"a": 347, "b": 582}
            assert choice.logprobs is not None and choice.logprobs.content is not None
            assert [t.logprob for t in choice.logprobs.content] == [-0.5] * CALL_TOKENS
            assert first.usage is not None and first.usage.completion_tokens == CALL_TOKENS
            assert first.system_fingerprint == "pipelinerl-v7"
            messages += [
                choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "929"},
            ]
            second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
            assert second.choices[0].message.content == "929"
            assert second.choices[0].finish_reason == "stop" and second.choices[0].logprobs is None
    # each request's fields went to the engine, the run's where the request gave none
    assert [(r.sampling.max_new_tokens, r.sampling.temperature) for r in pool.requests] == [
        (30, 0.5),
        (40, 1.0),
    ]
    assert_one_sample_of_two_turns(episode)
    assert gateway.counts.continued == 1 and gateway.counts.new_samples == 0


async def test_the_openai_client_round_trips_a_tool_call_streaming(gateway: AgentGateway) -> None:
    episode = recorder(ScriptedPool([CALL, "929"]), gateway)
    with gateway.episode(episode) as (base_url, key):
        async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
            messages: list = [QUESTION]
            content, calls, finish, usage = "", {}, None, None
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    finish = choice.finish_reason or finish
                    for delta in choice.delta.tool_calls or []:
                        call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                        call["id"] += delta.id or ""
                        call["name"] += delta.function.name or "" if delta.function else ""
                        call["arguments"] += delta.function.arguments or "" if delta.function else ""
            assert finish == "tool_calls" and content == "" and usage is not None
            assert usage.completion_tokens == CALL_TOKENS
            assert usage.prompt_tokens == usage.total_tokens - CALL_TOKENS
            (call,) = calls.values()
            assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 347, "b": 582}
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": "add", "arguments": call["arguments"]},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call["id"], "content": "929"},
            ]
            stream = await client.chat.completions.create(
                model="tiny", messages=messages, tools=TOOLS, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "929"
    assert_one_sample_of_two_turns(episode)


async def test_refusals_are_in_openais_shape(gateway: AgentGateway) -> None:
    episode = recorder(ScriptedPool(["4"]), gateway)
    with gateway.episode(episode) as (base_url, key):
        async with httpx.AsyncClient(timeout=10) as http:

            async def post(url: str, body: object, key: str | None = None) -> tuple[int, dict]:
                headers = {"authorization": f"Bearer {key}"} if key else {}
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                response = await http.post(url, content=content, headers=headers)
                return response.status_code, response.json()

            good = {"model": "tiny", "messages": [QUESTION]}
            root = f"{gateway.url}/v1"
            episode_url = f"{base_url}/chat/completions"
            malformed = [  # (body, the field named, code): each refused 400 at the episode's URL
                (b"{not json", None, "invalid_json"),
                ([], None, "invalid_body"),
                ({"model": "tiny"}, "messages", "invalid_type"),
                ({**good, "n": 2}, "n", "unsupported_value"),
                ({**good, "max_tokens": 0}, "max_tokens", "invalid_value"),
                ({**good, "temperature": 3}, "temperature", "invalid_value"),
                ({**good, "top_logprobs": 2}, "top_logprobs", "unsupported_value"),
                ({**good, "tool_choice": "required"}, "tool_choice", "unsupported_value"),
                ({**good, "messages": [{"role": "robot"}]}, "messages[0].role", "invalid_value"),
                ({**good, "tools": [{"type": "function", "function": {"name": "a b"}}]},
                 "tools[0].function.name", "invalid_value"),
            ]  # fmt: skip
            cases = [
                (f"{root}/episodes/nope/chat/completions", good, None, 404, None, "episode_not_found"),
                (f"{root}/chat/completions", good, None, 401, None, "invalid_api_key"),
                (f"{root}/chat/completions", good, "not-a-key", 401, None, "invalid_api_key"),
                *((episode_url, body, None, 400, param, code) for body, param, code in malformed),
            ]
            for url, body, bearer, status, param, code in cases:
                got, answer = await post(url, body, bearer)
                assert got == status, (url, body, answer)
                error = answer["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], answer
                assert (error["param"], error["code"], error["type"]) == (
                    param,
                    code,
                    "invalid_request_error",
                )
            # the episode's key as the API key, on the shared path, is the episode too
            status, answer = await post(f"{root}/chat/completions", good, key)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "4", answer
    # closed with its episode: the key names nothing any more
    async with AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as error:
            await client.chat.completions.create(model="tiny", messages=[QUESTION])
    assert error.value.code == "episode_not_found"
    assert gateway.counts.answered == 1 and gateway.counts.refused == len(cases) + 1
