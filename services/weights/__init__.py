"""Weight transport: a version from the optimizer step to the inference engine.

layout of tensors in flat buckets (`buckets`), the wire types (`types`), the NCCL/gloo broadcast
group (`broadcast`), the trainer-side `publisher` and the inference-side `receiver`. See
docs/weight-transport.md.
"""
