"""Linear layers with prepacked weights for CPU inference.

Speculative decoding on a CPU lives or dies by one ratio: what a verify forward over k + 1
positions costs against a plain one-position decode step. PyTorch's default float32 ``F.linear``
(MKL sgemm) is quick for one row but slow for the 2 to 8 rows of a verify forward: on a 2-core AMD
EPYC a verify forward of the default target costs 1.7 to 1.9 decode steps with plain
``nn.Linear`` (``python -m bench.cpu_linear``, ``bench/results/cpu-linear/``).

oneDNN can pack a weight once, at load time, into the layout its GEMM kernels read
(``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU freezing pass uses). Packed
for 8 rows, a verify forward of 2 to 8 positions costs 1.1 to 1.4 decode steps in the same
benchmark, a decode step takes 0.88x as long as plain, and outcomes are identical. Each output row
comes out bit-identical whatever the number of rows in the call (``tests/unit/test_cpu_linear.py``),
so a linear layer gives a position the same numbers in a verify forward as in a decode step.

This is inference only (no autograd through the packed weight); it applies to float32 models on
the CPU. GPUs and other dtypes keep ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from specpool.core.errors import InvalidArgument

CPU_LINEAR_MODES = ("auto", "packed", "plain")
PACK_ROWS = 8  # the row count oneDNN tunes the packed layout for: a verify forward's width


def packed_linear_available() -> bool:
    """True when this torch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``nn.Linear`` (inference) whose weight is packed once for oneDNN's CPU GEMM."""

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # The packed tensor has oneDNN's opaque layout: keep it out of state_dict (a buffer that
        # is not persistent), so saving or comparing the model never sees it.
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, rows), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise RuntimeError(f"PackedLinear is float32 CPU only, got {x.dtype} on {x.device}")
        rows = x.reshape(-1, self.in_features)  # (N, in)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # (N, out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def has_packed_linears(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def should_pack(mode: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``mode`` packs a model that runs on ``device`` in ``dtype``.

    ``auto`` packs float32 CPU models when oneDNN is there; ``packed`` insists (and fails clearly
    where it cannot apply); ``plain`` never packs.
    """
    if mode not in CPU_LINEAR_MODES:
        raise InvalidArgument(f"unknown cpu linear mode {mode!r}; use one of {', '.join(CPU_LINEAR_MODES)}")
    applies = torch.device(device).type == "cpu" and dtype == torch.float32
    if mode == "plain":
        return False
    if mode == "packed":
        if not applies:
            raise InvalidArgument(f"--cpu-linear packed applies to float32 models on the CPU, not {dtype} on {device}")
        if not packed_linear_available():
            raise InvalidArgument("--cpu-linear packed needs a torch build with oneDNN (torch.backends.mkldnn)")
        return True
    return applies and packed_linear_available()


def pack_linears(module: nn.Module, rows: int = PACK_ROWS) -> int:
    """Replace every ``nn.Linear`` under ``module`` by a ``PackedLinear``, in place. Returns how
    many were replaced. Tied weights (an LM head sharing the embedding) are copied into the
    packed layout; the embedding itself is untouched."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, rows))
            replaced += 1
        else:
            replaced += pack_linears(child, rows)
    return replaced
