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

A drafter's layers may also run in **int8** (``FrozenOutput(precision="int8")``,
``set_draft_precision``): fbgemm's dynamically quantised linear, weights int8 per output row,
activations quantised per call. A draft step reads a few MB of weights for one row, so a quarter
of the bytes is most of its time: on a 2-core AMD EPYC (AVX2) the default head's 8,192 x 576 output
took 0.22 ms against 0.72 packed float32. Only drafters may: a draft's numbers change a little,
and verification makes the output the target's whatever the drafter computed. The target never.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
from torch import nn

from specpool.core.errors import InvalidArgument

CPU_LINEAR_MODES = ("auto", "packed", "plain")
PACK_ROWS = 8  # the row count oneDNN tunes the packed layout for: a verify forward's width
DRAFT_PRECISIONS = ("float32", "int8")  # what a drafter's FrozenOutput kernels compute in on a CPU


def packed_linear_available() -> bool:
    """True when this torch build has oneDNN's packed linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for (..., in) float32 CPU rows, ``packed`` being W in oneDNN's layout
    (``torch.ops.mkldnn._reorder_linear_weight``)."""
    rows = x.reshape(-1, x.shape[-1])  # (N, in)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # (N, out)
    return out.reshape(*x.shape[:-1], out_features)


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
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def int8_linear_available() -> bool:
    """True when this torch build has a dynamically quantised linear on an x86 engine (fbgemm).
    Other engines (qnnpack on ARM) take per-tensor weights only; there int8 drafters run float32."""
    quantized = getattr(torch.ops, "quantized", None)
    return (quantized is not None and hasattr(quantized, "linear_dynamic")
            and torch.backends.quantized.engine in ("fbgemm", "x86"))


def check_draft_precision(precision: str) -> None:
    if precision not in DRAFT_PRECISIONS:
        raise InvalidArgument(f"unknown draft precision {precision!r}; use one of {', '.join(DRAFT_PRECISIONS)}")


def int8_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in) as fbgemm's packed int8 linear: symmetric, one scale per output row
    (a row's error then scales with that row, not with the matrix's largest value)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).double()  # (out,)
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; the kernel is still its fastest here
        warnings.simplefilter("ignore")
        qweight = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qweight, None)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` for (..., in) float32 CPU rows, ``packed`` from ``int8_pack``. The rows
    of one call share one activation scale, so a row's result depends a little on the others in
    its call (a drafter's batched propose may draft what its single propose would not: exact all
    the same, since each draft carries the q it was drawn from)."""
    rows = x.reshape(-1, x.shape[-1])  # (N, in)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    # reduce_range: 7-bit activations, so AVX2's 16-bit pairwise sums cannot saturate
    out = torch.ops.quantized.linear_dynamic(rows, packed, True)  # (N, out)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


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


class FrozenOutput:
    """A drafter's reduced-vocabulary output head in inference: ``hidden @ weight.T + bias`` with
    ``weight`` (V_r, d) frozen rows of the target's output matrix and ``bias`` the drafter's own
    (trained, so read at every call).

    The output head is most of a small drafter's draft step, and float32 ``F.linear`` is slow there:
    on a 2-core AMD EPYC, the shipped general head's (8192 x 576) took 1.35 ms for one row and 3.0 ms
    for four, packed for oneDNN 0.59 ms and 0.67 ms (``python -m bench.output_head``).
    So a drafter packs its gathered weight on its first call in inference (again only if the weight
    changes: ``InferenceLinear`` uses this for trained layers too), and calls the packed kernel
    when nothing needs gradients; training (autograd) keeps ``F.linear``. Which one
    ran never changes what a request outputs: drafts are verified, and each is drawn from the
    q it reports.

    ``precision`` "int8" packs for fbgemm's int8 linear instead (module docstring), where this
    torch has it; elsewhere, and on a GPU, the call runs as "float32"."""

    def __init__(self, precision: str = "float32"):
        check_draft_precision(precision)
        self.precision = precision
        # Decided here, not per call: the availability check reads torch's engine, and a call is
        # a draft step's hot path.
        self._int8 = precision == "int8" and int8_linear_available()
        # Replaced whole, never edited: threads drafting with one drafter (a hot swap under
        # concurrent requests) each read it once, so none sees one weight's source beside
        # another's sample.
        self._packing: _Packing | None = None

    # A copy (a drafter's deepcopy, a pickle to another process) starts unpacked, in the same
    # precision: the packed tensor is opaque to both, and it is made again on the copy's first call.
    def __deepcopy__(self, memo) -> "FrozenOutput":
        return FrozenOutput(self.precision)

    def __getstate__(self) -> dict:
        return {"precision": self.precision}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.get("precision", "float32"))

    def set_precision(self, precision: str) -> None:
        """Compute in ``precision`` from the next call on (packed again then)."""
        self.__init__(precision)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (torch.is_grad_enabled() or hidden.dtype != torch.float32 or hidden.device.type != "cpu"
                or weight.dtype != torch.float32):
            return nn.functional.linear(hidden, weight, bias)
        int8 = self._int8
        if not int8 and not packed_linear_available():
            return nn.functional.linear(hidden, weight, bias)
        packing = self._packing
        # a new weight, this one trained in place, or the other precision (set while this call ran)
        if packing is None or packing.int8 != int8 or self._changed(packing, weight):
            # Packed from a snapshot, which the sample describes, and trusted (``settled``) only if
            # the weight still equals it afterwards. Packing the live weight, a write racing the
            # pack could leave a copy of half of each weight beside a sample of one of them: a
            # weight written A -> B -> A meanwhile, which no sample can tell from A (CI caught
            # it). An unsettled copy serves this call, which raced a write, and the next call
            # packs again. The version is read first, so a counted write during the pack shows.
            version = 0 if weight.is_inference() else weight._version
            snapshot = weight.detach().clone()
            packed = _pack(snapshot, int8)
            settled = torch.equal(weight.detach(), snapshot)
            packing = _Packing(weight, version, self._values(snapshot).clone(), packed, int8, settled)  # not a view: the snapshot goes
            self._packing = packing
        kernel = int8_linear if int8 else packed_linear
        return kernel(hidden, packing.packed, None if bias is None else bias.detach(), weight.shape[0])

    @staticmethod
    def _values(weight: torch.Tensor) -> torch.Tensor:
        """About 64 of the weight's values, evenly strided (a view: ``clone`` it to keep it)."""
        flat = weight.detach().reshape(-1)
        return flat[:: max(1, flat.numel() // 64)]

    @classmethod
    def _changed(cls, packing: "_Packing", weight: torch.Tensor) -> bool:
        """Whether ``packing`` is not ``weight``'s current values. Its version counter catches
        optimiser steps and ``load_state_dict``; writes it does not count (through ``.data``, or
        a state_dict view taken under inference mode; inference tensors keep no counter at all)
        still change the sampled values: any training update or weight swap changes nearly all."""
        if packing.source is not weight or not packing.settled:
            return True
        if not weight.is_inference() and weight._version != packing.version:
            return True
        return not torch.equal(cls._values(weight), packing.sample)


class _Packing(NamedTuple):
    """What a ``FrozenOutput`` packed, and from what."""

    source: torch.Tensor  # the weight the packed copy was made from
    version: int  # its version counter then: a trained weight changes in place
    sample: torch.Tensor  # some of its values then (``FrozenOutput._changed``)
    packed: torch.Tensor  # oneDNN's packed copy, or fbgemm's int8 one
    int8: bool  # which of the two (``FrozenOutput.precision``)
    settled: bool  # the weight equalled the packed snapshot once packing ended (``FrozenOutput.__call__``)


def _pack(weight: torch.Tensor, int8: bool) -> torch.Tensor:
    """``weight`` packed for fbgemm's int8 linear or oneDNN's float32 one (``FrozenOutput``)."""
    return int8_pack(weight) if int8 else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


class InferenceLinear(nn.Linear):
    """``nn.Linear`` whose inference calls run oneDNN's packed kernel (``FrozenOutput``) on a CPU.

    For a drafter's own layers, which keep training while they serve (the online learner, a hot
    swap): the parameters, state_dict and autograd are ``nn.Linear``'s; a call without gradients
    packs the weight on first use and again whenever it has changed (``FrozenOutput._changed``), so
    a draft always reads the current weights. Unlike ``PackedLinear`` (the frozen target) nothing
    is replaced at load time. A drafter's catch-up forward feeds 2 to 8 positions, where plain
    float32 ``F.linear`` is slowest (the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kernel = FrozenOutput()  # not a module: copies and pickles start unpacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self.weight, self.bias)


def set_draft_precision(module: nn.Module, precision: str) -> int:
    """Every ``FrozenOutput`` kernel under ``module`` (an ``InferenceLinear``'s, a drafter's output
    head) computes in ``precision`` from its next call. Returns how many kernels were set."""
    check_draft_precision(precision)
    kernels = [value for m in module.modules() for value in vars(m).values() if isinstance(value, FrozenOutput)]
    for kernel in kernels:
        kernel.set_precision(precision)
    return len(kernels)
