"""GPU tests run on the GPU machine (`python -m pytest tests/gpu`), where flash-linear-attention is installed.

FLA emits warnings when it is imported; under this suite's warnings-as-errors they made transformers' guarded
import of FLA fail, so it silently bound the torch Gated-DeltaNet kernels and the kernel-selection test failed
on the H200 for that reason alone. Importing FLA once here, with warnings ignored, leaves transformers a cached
module to bind.
"""

import importlib.util
import warnings

if importlib.util.find_spec("fla") is not None and importlib.util.find_spec("triton") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import fla  # noqa: F401
