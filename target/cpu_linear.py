"""Linear layers with prepacked weights for CPU inference.

Speculative decoding on a CPU lives or dies by one ratio: what a verify forward over k + 1
positions costs against a plain one-position decode step. PyTorch's default float32 ``F.linear``
calls MKL's sgemm, which repacks the whole weight matrix on every call; for a single row MKL
takes a GEMV path that skips that, but for 2 to 8 rows it packs 540 MB of SmolLM2 weights per
forward. Measured on a 2-core AMD EPYC (``python -m bench.verify_width``): a 6-position forward of
the default target costs ~1.9 decode steps with plain ``nn.Linear``.

oneDNN can pack a weight once, at load time, into the layout its GEMM kernels read
(``torch.ops.mkldnn._reorder_linear_weight``, the same op Inductor's CPU freezing pass uses).
Packed for up to 8 rows, a forward over 1 to 8 positions then reads each weight once in its
native layout, and each output row is computed by the same kernel whatever the number of rows:
the logits of a position do not depend on how many positions share its forward (tested in
``tests/unit/test_cpu_linear.py``), which is what makes verification agree with plain decoding.

This is inference only (no autograd through the packed weight); it applies to float32 models on
the CPU. GPUs and other dtypes keep ``nn.Linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from router.errors import InvalidArgument

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
