"""Triton kernels with pure-PyTorch twins in `reference.py`.

Without CUDA, Triton kernels can only run under Triton's interpreter, and `@triton.jit` picks
the interpreter when TRITON_INTERPRET=1 is set at decoration time. Set it here, before any kernel
module is imported, so `--attention-backend triton` on CPU runs (slowly) instead of failing to
find a GPU. An explicit TRITON_INTERPRET value in the environment is left alone.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
