"""Device layer and device-dispatched ops, each with a plain-PyTorch reference.

Modules: `device` (the one place that knows the accelerator), `registry` (backend choice per op
and device, `MESHLINE_KERNELS` override), `attention`, `norm`, `rotary`, `activation`,
`cross_entropy`, `optim`, `quantization`; vendor backends in `cuda/` and `npu/`. See
docs/kernels.md.
"""

from kernels.torch_support import check_torch_version

check_torch_version()
