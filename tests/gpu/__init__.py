"""Tests that need a CUDA GPU (marker `gpu`); each module skips without one. `scripts/gpu_check.sh`
runs them on a GPU machine."""

import pytest
import torch

needs_cuda = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
