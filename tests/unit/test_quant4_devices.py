"""quant4 encodes the same bytes on CPU and CUDA: emulated here, on the CPU, by a torch-function mode that
divides by a Python scalar the way ATen's CUDA kernel does (BinaryDivTrueKernel.cu: a * (1/b), the reciprocal
rounded to float32), so the check runs without a GPU. On the H200 the real comparison is
`pytest -m gpu tests/unit/test_quant4.py -k cuda_matches_cpu`. Before quant4._div, 9 of the 22 formats below
failed both ways (int4 with bf16 scales, every e4m3 format)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash.cache.quant4 import decode, encode, parse_quant4

from test_quant4 import ALL, D, ROTATED, features

_DIVS = {torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_, torch.Tensor.__itruediv__, torch.div,
         torch.true_divide, torch.Tensor.true_divide}


class CudaScalarDivision(TorchFunctionMode):
    """tensor / python number -> tensor * float32(1 / number), as CUDA computes it; counts the rewrites."""

    def __init__(self):
        super().__init__()
        self.rewritten = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _DIVS and len(args) == 2 and not kwargs and isinstance(args[1], (int, float))
                and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32):
            self.rewritten += 1
            inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(args[1]), dtype=torch.float32)
            out = args[0] * inv
            return args[0].copy_(out) if func in (torch.Tensor.div_, torch.Tensor.__itruediv__) else out
        return func(*args, **kwargs)


def test_the_emulation_rounds_like_cuda():
    """A reciprocal multiply is one ulp off a division for some inputs: the mode is live, not a no-op."""
    x = torch.arange(1, 4097, dtype=torch.float32) * 0.37
    with CudaScalarDivision() as mode:
        y = x / 7.0
    assert mode.rewritten == 1 and not torch.equal(y, torch.div(x, torch.tensor(7.0)))


@pytest.mark.parametrize("name", ALL + ROTATED)
def test_encode_does_not_depend_on_scalar_division(name):
    fmt = parse_quant4(name)
    x = features(T=300, K=3, D=D)
    ref = encode(x, fmt=fmt)
    with CudaScalarDivision():
        got = encode(x, fmt=fmt)
        out = decode(ref.codes, ref.group_scales, ref.row_scales, fmt=fmt, dtype=torch.float32)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.group_scales, ref.group_scales)
    assert (got.row_scales is None) == (ref.row_scales is None)
    if ref.row_scales is not None:
        assert torch.equal(got.row_scales, ref.row_scales)
    assert torch.equal(out, decode(ref.codes, ref.group_scales, ref.row_scales, fmt=fmt, dtype=torch.float32))
