"""Settings of the inference server (env `PIPELINERL_INFERENCE_*`, `--flags`, or a YAML/TOML file)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator.types import InferenceRole


class EngineSettings(BaseModel):
    """The engine's section: which model it serves and how much it runs at once. Both engines
    (`InferenceEngine`, `VllmBackend`) take it as it is."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    engine: Literal["builtin", "vllm"] = "builtin"
    """`builtin` (torch + transformers, CPU or GPU) or `vllm` (vLLM's AsyncLLM; run from the vLLM
    virtualenv that `make vllm-env` builds)."""
    model: str = "tiny"
    """A preset name (`tiny`) or a local HF model directory."""
    seed: int = 0
    """Seed of a preset's random initial weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight and compute dtype."""
    device: str = "cpu"
    """`cpu` or `cuda[:N]`."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads for decoding; unset keeps torch's default."""
    max_running: int = Field(default=64, ge=1)
    """Sequences decoded together."""
    queue_ahead: int = Field(default=32, ge=0)
    """Requests a client may send beyond `max_running` on a Generate stream (the window it is
    advertised is the sum): they wait at the server and the engine starts one at its next step
    after a row frees, instead of a round trip to the client and back later. Their tokens carry
    the version that decodes them, so waiting adds no lag. 32 keeps 16 rows of 20 ms generations
    busy through a 40 ms stall of the client on a busy host (`benchmarks/load.py`)."""
    max_queued: int = Field(default=1024, ge=0)
    """Built-in only: requests waiting for a free row, over every stream together; beyond this a
    request is refused."""
    max_new_tokens: int = Field(default=4096, ge=1)
    """Largest `max_new_tokens` a request may ask for."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context length (prompt + completion); unset means the model's own."""
    max_prefill_tokens: int = Field(default=8192, ge=1)
    """Built-in only: padded prompt tokens prefilled in one step, so newcomers stall the running
    batch only briefly; a single prompt is always admitted."""
    max_kept_caches: int | None = Field(default=None, ge=0)
    """Built-in only: KV caches kept after their request for the next turn of the same episode
    (`prompt_cache_key`), which then prefills only what the turn added. Each takes a row of the
    slot cache, as much memory as a running sequence, allocated at the first one kept; the least
    recently kept goes first. Unset: `max_running` (every running episode's next turn, while its
    environment steps); 0 keeps none."""
    kept_cache_max_lag: int = Field(default=0, ge=0)
    """Built-in only: how many weight versions behind the held one a kept cache's oldest keys and
    values may be. 0: only caches computed wholly by the held weights are reused (a turn's prompt
    is what a fresh prefill would compute); above 0 the next turn continues on older ones, as a
    sequence running across an update does, and reuse survives the updates between an episode's
    turns. Requests pinned to a version reuse only caches of that version."""
    kv_cache_gib: float = Field(default=1.0, gt=0)
    """vLLM only: size of its KV cache in GiB."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (fixed-length rollouts, benchmarks); explicit
    `stop_token_ids` still stop."""


class InferenceSettings(ServiceSettings, EngineSettings):
    """The inference server: an engine (its `EngineSettings`) that follows the trainer's weights."""

    # Annotated, as BaseSettings and BaseModel (of EngineSettings) declare it with different types.
    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(env_prefix="PIPELINERL_INFERENCE_")

    port: int = Field(default=50051, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    trainer_address: str | None = None
    """`host:port` of the trainer to follow for weight updates; unset serves the initial weights forever."""
    trainer_auth_token: str | None = None
    """Bearer token of the trainer, if it needs one."""
    trainer_tls_ca_file: Path | None = None
    """PEM CA bundle to verify the trainer with, if it speaks TLS; unset, calls are plaintext."""
    coordinator_address: str | None = None
    """`host:port` of a coordinator to join: once serving, the server registers itself there
    (RegisterInferenceServer) and renews its lease until it drains."""
    role: InferenceRole = InferenceRole.TRAINING
    """The coordinator's pool it joins: `training` (the attempts of runs, and evaluations when the
    coordinator has no evaluation server) or `evaluation` (held-out evaluations only)."""
    coordinator_auth_token: str | None = None
    """Bearer token of the coordinator, if it needs one."""
    coordinator_tls_ca_file: Path | None = None
    """PEM CA bundle to verify the coordinator with, if it speaks TLS; unset, calls are plaintext."""
    advertise_address: str | None = None
    """`host:port` at which the coordinator reaches this server (in Kubernetes, the pod IP and
    port); unset, the bound address, with this host's name when bound to every interface."""
    receiver_id: str = Field(default_factory=socket.gethostname)
    """This server's name in broadcast groups; must be unique among the trainer's receivers."""
    accepts_broadcast: bool = True
    """Join the trainer's broadcast groups (otherwise every version is fetched over gRPC)."""
    accepts_cuda_ipc: bool = True
    """Built-in engine on CUDA: take versions from a trainer on the same GPU by CUDA IPC (one
    device-to-device copy, no broadcast group); any other trainer is followed as usual."""
