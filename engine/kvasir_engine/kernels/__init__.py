"""Triton kernels with pure-PyTorch twins in `reference.py`.

Without CUDA, Triton kernels can only run under Triton's interpreter, which `@triton.jit` picks
when TRITON_INTERPRET=1 is set at decoration time. It is set here (through `choice.py`, the one
reader of the kernel switches), before any kernel module is imported, so `--attention-backend
triton` on CPU runs (slowly) instead of failing to find a GPU. An explicit value is left alone.
"""

import torch

from kvasir_engine.kernels.choice import default_to_triton_interpreter

default_to_triton_interpreter(torch.cuda.is_available())
