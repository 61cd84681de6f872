"""Weight transport: a version from the optimizer step to the inference engine.

The layout of tensors in flat buckets (`buckets`), the domain types (`types`) and their messages
(`convert`), the NCCL/gloo broadcast group (`broadcast`), CUDA IPC on one GPU (`cuda_ipc`), the
trainer-side `publisher` and its `settings`, the inference-side `receiver`. See
docs/weight-transport.md.
"""
