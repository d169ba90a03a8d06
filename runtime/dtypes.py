"""The floating-point types a model may run in (`--dtype` of `decodespec serve` and `generate`).

The names are torch's own; float32 is the default. In half precision the weights, the KV cache
and the activations are that type; the decode loop around the model is the same (§4.3, §4.4).
Importing this module does not import torch (the CLI's `--help` reads DTYPES).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name`, one of DTYPES; any other name is a ValueError naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype
