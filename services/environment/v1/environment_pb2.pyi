import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_TOOL: Role

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: Role
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class DescribeEnvironmentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeEnvironmentResponse(_message.Message):
    __slots__ = ("name", "version", "description", "tools", "max_turns", "max_episodes", "lease", "max_observation_bytes", "agent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    MAX_OBSERVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    description: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    max_turns: int
    max_episodes: int
    lease: _duration_pb2.Duration
    max_observation_bytes: int
    agent: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., description: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., max_turns: _Optional[int] = ..., max_episodes: _Optional[int] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., max_observation_bytes: _Optional[int] = ..., agent: _Optional[bool] = ...) -> None: ...

class StartEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "seed", "task")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    seed: int
    task: str
    def __init__(self, episode_id: _Optional[str] = ..., seed: _Optional[int] = ..., task: _Optional[str] = ...) -> None: ...

class StartEpisodeResponse(_message.Message):
    __slots__ = ("messages", "tools", "max_turns")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    max_turns: int
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., max_turns: _Optional[int] = ...) -> None: ...

class StepEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "turn", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    turn: int
    action: Message
    def __init__(self, episode_id: _Optional[str] = ..., turn: _Optional[int] = ..., action: _Optional[_Union[Message, _Mapping]] = ...) -> None: ...

class StepEpisodeResponse(_message.Message):
    __slots__ = ("messages", "rewards", "terminated", "truncated", "turn")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    terminated: bool
    truncated: bool
    turn: int
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., rewards: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., turn: _Optional[int] = ...) -> None: ...

class RunEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "seed", "task", "base_url", "api_key", "model")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    seed: int
    task: str
    base_url: str
    api_key: str
    model: str
    def __init__(self, episode_id: _Optional[str] = ..., seed: _Optional[int] = ..., task: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class RunEpisodeResponse(_message.Message):
    __slots__ = ("rewards", "truncated")
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    truncated: bool
    def __init__(self, rewards: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class EndEpisodeRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class EndEpisodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("active_episodes", "max_episodes", "episodes_started", "steps", "episodes_reaped", "failures")
    ACTIVE_EPISODES_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_STARTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_REAPED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    active_episodes: int
    max_episodes: int
    episodes_started: int
    steps: int
    episodes_reaped: int
    failures: int
    def __init__(self, active_episodes: _Optional[int] = ..., max_episodes: _Optional[int] = ..., episodes_started: _Optional[int] = ..., steps: _Optional[int] = ..., episodes_reaped: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...
