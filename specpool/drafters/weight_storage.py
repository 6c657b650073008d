"""How a drafter's weights are stored on disk: float16, or int8 matrices with a float16 scale per row.

A shipped head may take 10 MB (docs/ARCHITECTURE.md, "White-box drafters"). In float16 that is one
decoder block at the default target's width; int8 storage halves the matrices so a head can have
two. Only the storage is quantised: loading dequantises to float32 (``unpack``), so drafting,
verification and training run exactly as for a float16 head whose weights happen to be these
rounded values, and losslessness is untouched (the target verifies whatever the head drafts).

Quantisation is symmetric per output row: ``w[i, :] ~ q[i, :] * scale[i]`` with ``q`` in [-127,
127] and ``scale[i] = max |w[i, :]| / 127``; the scale is kept under ``NAME + SCALE_SUFFIX``.
Vectors (norms, biases) and integer tensors (vocabulary ids) stay as they were.
"""

from __future__ import annotations

import torch

STORAGES = ("float16", "int8")
SCALE_SUFFIX = ":int8_row_scale"
FLOAT16_TINY = 2.0 ** -24  # the smallest float16 above 0: an all-zero row still gets a usable scale


def pack(state: dict[str, torch.Tensor], storage: str = "float16",
         quantise: tuple[str, ...] = ("blocks.", "fuse.")) -> dict[str, torch.Tensor]:
    """The tensors to write for ``state``: integers as int32, floating tensors as float16, except,
    with ``storage="int8"``, the 2-D weights whose names start with one of ``quantise``."""
    if storage not in STORAGES:
        raise ValueError(f"unknown weight storage {storage!r}; known: {', '.join(STORAGES)}")
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = value.detach().cpu()
        if not value.is_floating_point():
            out[name] = value.to(torch.int32).contiguous()
        elif storage == "int8" and value.dim() == 2 and name.startswith(quantise):
            # Rounded with the float16 scale that is stored, so loading undoes exactly this rounding.
            scale = (value.float().abs().amax(dim=1) / 127.0).to(torch.float16).clamp_min(FLOAT16_TINY)  # (rows,)
            out[name] = torch.round(value.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE_SUFFIX] = scale.contiguous()
        else:
            out[name] = value.to(torch.float16).contiguous()
    return out


def unpack(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 state (integers as int64) that ``pack`` wrote, whatever its storage."""
    out: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if value.dtype == torch.int8:
            scale = weights.get(name + SCALE_SUFFIX)
            if scale is None:
                raise ValueError(f"int8 weight {name!r} has no {SCALE_SUFFIX} beside it")
            out[name] = value.float() * scale.float()[:, None]
        else:
            out[name] = value.float() if value.is_floating_point() else value.long()
    return out

