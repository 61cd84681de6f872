"""Settings of the weight publisher (torch-free): the trainer's settings include them field by field
(`TrainerSettings` inherits them), and `WeightPublisher` takes them as they are."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


class PublisherSettings(BaseModel):
    """How each weight version is packed and offered to the inference servers."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    broadcast_backend: Literal["gloo", "nccl", "none"] = "gloo"
    """How versions reach inference servers besides FetchWeights: gloo (CPU), nccl (GPU), none."""
    bucket_bytes: int = Field(default=DEFAULT_BUCKET_BYTES, ge=1024)
    """Size of the flat buckets weights move in."""
    store_port: int = Field(default=0, ge=0, le=65535)
    """Port of the broadcast rendezvous store; 0 picks a free one."""
    advertise_host: str = "127.0.0.1"
    """Host inference servers use to reach the rendezvous store."""
    broadcast_timeout_s: float = Field(default=60.0, gt=0)
    """A rendezvous or broadcast slower than this fails; receivers then fetch."""
    keep_versions: int = Field(default=2, ge=1)
    """Packed versions kept for FetchWeights (a receiver mid-fetch keeps its version)."""
    cuda_ipc: bool = True
    """Hand each version by CUDA IPC to receivers on the trainer's own GPU (trainer on CUDA only)."""
    cuda_ipc_release_s: float = Field(default=60.0, gt=0)
    """A version's device buffers are freed once every receiver released them, or after this long."""
