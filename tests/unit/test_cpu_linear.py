"""oneDNN-packed linear layers (specpool/target/cpu_linear.py): same numbers as nn.Linear, rows that do
not depend on how many share a forward, the right models packed, bad modes refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specpool.core.errors import InvalidArgument
from specpool.target.cpu_linear import (FrozenOutput, InferenceLinear, PackedLinear, has_packed_linears, int8_linear_available,
                                        pack_linears, packed_linear_available, set_draft_precision, should_pack)
from specpool.target.kv_cache import PrefixCache
from specpool.target.models import ModelConfig, load_causal_lm
from specpool.target.verifier import CPU_FORWARD_WIDTHS, PACKED_CPU_FORWARD_WIDTHS, TargetVerifier

needs_onednn = pytest.mark.skipif(not packed_linear_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_nn_linear_for_any_leading_shape(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (3, 48), (2, 5, 48), (1, 1, 9, 48), (300, 48)]:
        x = torch.randn(shape)
        with torch.no_grad():
            assert packed(x).shape == linear(x).shape
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert "packed" in repr(packed)


@needs_onednn
def test_a_rows_output_does_not_depend_on_how_many_rows_share_the_forward():
    """What verification relies on: position i's output is bit-identical whether it is computed
    alone (a decode step) or among up to 8 positions (a verify forward)."""
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False))
    x = torch.randn(8, 576)
    with torch.no_grad():
        full = packed(x)  # (8, 1536)
        for rows in range(1, 9):
            assert torch.equal(packed(x[:rows]), full[:rows]), rows
        assert torch.equal(packed(x[5:6]), full[5:6])


@needs_onednn
def test_packed_linear_refuses_other_dtypes():
    packed = PackedLinear(nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="float32 CPU only"):
        packed(torch.randn(2, 8, dtype=torch.float64))


def test_packed_weights_stay_out_of_the_state_dict():
    if not packed_linear_available():
        pytest.skip("this torch build has no oneDNN")
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert pack_linears(model) == 2
    assert has_packed_linears(model)
    assert model.state_dict() == {}


@pytest.mark.parametrize(
    "mode, device, dtype, expected",
    [
        ("auto", "cpu", torch.float32, packed_linear_available()),
        ("auto", "cpu", torch.bfloat16, False),
        ("auto", "cuda", torch.float32, False),
        ("auto", "cuda:1", torch.bfloat16, False),
        ("plain", "cpu", torch.float32, False),
        ("plain", "cuda", torch.bfloat16, False),
    ],
)
def test_which_models_are_packed(mode, device, dtype, expected):
    assert should_pack(mode, device, dtype) is expected


@pytest.mark.parametrize(
    "mode, device, dtype, message",
    [
        ("fast", "cpu", torch.float32, "unknown cpu linear mode 'fast'"),
        ("packed", "cuda", torch.float32, "applies to float32 models on the CPU"),
        ("packed", "cpu", torch.float16, "applies to float32 models on the CPU"),
    ],
)
def test_bad_modes_are_refused(mode, device, dtype, message):
    with pytest.raises(InvalidArgument, match=message):
        should_pack(mode, device, dtype)


def test_bad_mode_fails_before_the_model_loads(home, tmp_path):
    with pytest.raises(InvalidArgument, match="unknown cpu linear mode"):
        load_causal_lm(ModelConfig(str(tmp_path / "no-such-model"), cpu_linear="fast"), home)


@needs_onednn
def test_loaded_target_is_packed_by_default_and_agrees_with_the_plain_one(model_dirs, home, prompts):
    packed, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target)), home)
    plain, _ = load_causal_lm(ModelConfig(str(model_dirs.target), cpu_linear="plain"), home)
    assert has_packed_linears(packed) and not has_packed_linears(plain)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    # The verifier pads by the packed kernels' costs, not MKL's.
    assert TargetVerifier(packed, tokenizer).forward_widths == PACKED_CPU_FORWARD_WIDTHS
    assert TargetVerifier(plain, tokenizer).forward_widths == CPU_FORWARD_WIDTHS
    for ids in prompts[:6]:
        a = PrefixCache(packed).logits(ids, n_last=len(ids))
        b = PrefixCache(plain).logits(ids, n_last=len(ids))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_onednn
def test_verify_logits_equal_decode_logits_on_a_packed_target(target_lm, prompts):
    """A position's logits in a k+1-wide verify forward equal the plain decode step's there."""
    model, _ = target_lm
    for ids in prompts[:4]:
        context, drafts = ids[:-6], ids[-6:]
        wide = PrefixCache(model)
        wide.logits(context, n_last=1)
        verify_rows = wide.logits(context + drafts, n_last=len(drafts) + 1)  # (7, V)
        step = PrefixCache(model)
        step.logits(context, n_last=1)
        for i, token in enumerate(drafts):
            row = step.logits(context + drafts[: i + 1], n_last=1)[0]
            torch.testing.assert_close(row, verify_rows[i + 1], rtol=1e-5, atol=1e-5)


def test_cli_bad_cpu_linear_is_one_line(cli):
    from cli_helpers import assert_one_line_error

    code, _, err = cli("generate", "the cat", "--cpu-linear", "fast")
    assert_one_line_error(code, err, "cpu-linear", "fast")


def test_cli_plain_and_packed_targets_say_the_same(cli):
    import json

    outputs = {}
    for mode in ("plain", "auto"):
        code, out, err = cli("generate", "the cat sat on the mat the cat", "--cpu-linear", mode,
                             "--max-new-tokens", "8", "--json", "--drafter", "ngram")
        assert code == 0, err
        outputs[mode] = json.loads(out.strip().splitlines()[-1])["token_ids"]
    assert outputs["plain"] == outputs["auto"] and len(outputs["auto"]) == 8


@needs_onednn
def test_the_packed_vs_plain_benchmark_pairs_the_same_verifications(model_dirs, home, prompts):
    """bench/cpu_linear.py's measurement on the tiny target: every draft count timed for both
    systems, and the two agree on every outcome (what its report's mismatch count states)."""
    from bench.cpu_linear import target_only_decoding
    from bench.verify_width import MAX_DRAFTS, alternate_verifications

    verifiers = {}
    for system, mode in (("P", "packed"), ("U", "plain")):
        model, tokenizer = load_causal_lm(ModelConfig(str(model_dirs.target), cpu_linear=mode), home)
        verifiers[system] = TargetVerifier(model, tokenizer)
    per_draft_count, mismatches = alternate_verifications(verifiers, prompts[:3], 3, "test")
    assert len(per_draft_count) == MAX_DRAFTS + 1
    assert all(len(times["P"]) == len(times["U"]) == 3 for times in per_draft_count)
    assert mismatches == 0
    decode = target_only_decoding(verifiers, prompts[:3], 6)
    assert decode["identical"] == 3 and all(1 <= row["new_tokens"] <= 6 for row in decode["rows"])


# -- a drafter's output head (FrozenOutput) --------------------------------------------------------------


@needs_onednn
def test_frozen_output_packs_in_inference_and_keeps_autograd_in_training():
    import copy
    import pickle

    torch.manual_seed(0)
    weight, bias = torch.randn(300, 24), nn.Parameter(torch.randn(300))
    output = FrozenOutput()
    hidden = torch.randn(2, 3, 24)
    with torch.inference_mode():
        packed = output(hidden, weight, bias)
    assert output._packing.source is weight and packed.shape == (2, 3, 300)
    torch.testing.assert_close(packed, nn.functional.linear(hidden, weight, bias), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the bias is read at every call: a trained bias counts at once
        bias.add_(1.0)
        torch.testing.assert_close(output(hidden, weight, bias), packed + 1.0, atol=1e-4, rtol=1e-4)
    trained = output(hidden, weight, bias)  # gradients wanted: plain F.linear, differentiable
    trained.sum().backward()
    assert bias.grad is not None and torch.equal(bias.grad, torch.full((300,), 6.0))
    other = torch.randn(300, 24)  # a new gathered weight (another vocabulary): packed again
    with torch.no_grad():
        torch.testing.assert_close(output(hidden, other, None), hidden @ other.T, atol=1e-4, rtol=1e-4)
    assert output._packing.source is other
    for clone in (copy.deepcopy(output), pickle.loads(pickle.dumps(output))):  # copies start unpacked
        assert clone._packing is None
    with torch.no_grad():  # other dtypes keep F.linear
        half = output(hidden.double(), weight.double(), None)
    assert half.dtype == torch.float64


# -- a drafter's own layers (InferenceLinear) --------------------------------------------------------------


@needs_onednn
def test_inference_linear_packs_for_drafting_and_follows_every_kind_of_weight_change():
    """Drafting reads the packed kernel; training keeps autograd; whatever changes the weight (an
    optimiser step, load_state_dict, a write through .data, a state_dict view written under
    inference mode) is what the next draft reads."""
    import copy
    import pickle

    torch.manual_seed(0)
    layer = InferenceLinear(24, 40, bias=False)
    plain = nn.Linear(24, 40, bias=False)
    x = torch.randn(3, 5, 24)

    def check() -> None:
        plain.load_state_dict(layer.state_dict())
        with torch.inference_mode():
            got = layer(x)
            assert layer._kernel._packing is not None  # the packed path ran
            torch.testing.assert_close(got, plain(x), atol=1e-4, rtol=1e-4)

    check()
    packed = layer._kernel._packing.packed
    with torch.inference_mode():
        layer(x)
    assert layer._kernel._packing.packed is packed  # unchanged weight: not packed again
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    loss = layer(x).square().sum()  # gradients wanted: F.linear, differentiable
    loss.backward()
    assert layer.weight.grad is not None
    optimizer.step()
    check()
    layer.load_state_dict({"weight": torch.randn(40, 24)})
    check()
    layer.weight.data.mul_(0.5)  # no version bump
    check()
    with torch.inference_mode():
        layer.state_dict()["weight"].add_(1.0)  # an inference-mode view: no version bump either
    check()
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):  # copies start unpacked and agree
        assert clone._kernel._packing is None
        with torch.inference_mode():
            torch.testing.assert_close(clone(x), layer(x), atol=1e-5, rtol=1e-5)
    assert set(layer.state_dict()) == {"weight"}  # nothing of the kernel in checkpoints


@needs_onednn
def test_inference_linear_drafts_from_several_threads_while_its_weight_changes():
    """A hot swap under concurrent requests: threads draft with one layer while its weight is
    rewritten, each call repacking. Every call runs: the packed copy, its source and its sample are
    read as one (CI once caught a call that saw a new source beside no sample yet); and once the
    writes stop, a call reads the last weight."""
    import threading

    torch.manual_seed(0)
    layer = InferenceLinear(64, 96, bias=False)
    x = torch.randn(2, 64)
    weights = [torch.randn(96, 64) for _ in range(2)]
    expected = [x @ w.T for w in weights]
    stop, errors = threading.Event(), []

    def draft() -> None:
        try:
            while not stop.is_set():
                with torch.inference_mode():
                    layer(x)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=draft) for _ in range(4)]
    for thread in threads:
        thread.start()
    for i in range(400):
        layer.weight.data.copy_(weights[i % 2])  # no version bump: the sample sees it
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    # A call racing a copy_ may read a half-written weight; calls between writes must be exact.
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected[1], atol=1e-4, rtol=1e-4)


@needs_onednn
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_a_weight_written_away_and_back_while_it_packs_is_packed_as_it_ends(monkeypatch, precision):
    """The race the threaded test above once lost in CI, made deterministic: while a call packs, a
    hot swap writes the other weight and then the first one back (A -> B -> A, through ``.data``, so
    no version counts it). A sample cannot tell A from A; the packed copy must still be A's, and a
    write that does not come back must be packed again on the next call."""
    import specpool.target.cpu_linear as cpu_linear

    if precision == "int8" and not int8_linear_available():
        pytest.skip("no x86 int8 linear (fbgemm) in this torch")
    torch.manual_seed(0)
    layer = InferenceLinear(64, 96, bias=False)
    layer._kernel.set_precision(precision)
    x = torch.randn(2, 64)
    a, b = torch.randn(96, 64), torch.randn(96, 64)
    layer.weight.data.copy_(a)
    real_pack, writes = cpu_linear._pack, []

    def pack_during_writes(weight, int8):
        if writes:
            layer.weight.data.copy_(writes.pop(0))
            packed = real_pack(layer.weight.detach(), int8)  # what packing the live weight would read now
            if writes:
                layer.weight.data.copy_(writes.pop(0))
            live = weight.data_ptr() == layer.weight.data_ptr()  # the live weight, or a copy of it
            return packed if live else real_pack(weight, int8)
        return real_pack(weight, int8)

    monkeypatch.setattr(cpu_linear, "_pack", pack_during_writes)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if precision == "float32" else {"atol": 0.5, "rtol": 0.1}
    with torch.inference_mode():
        writes[:] = [b, a]  # A -> B -> A during the first pack
        layer(x)
        torch.testing.assert_close(layer(x), x @ a.T, **tolerance)
        assert not layer._kernel._changed(layer._kernel._packing, layer.weight)  # settled: no repack
        layer.weight.data.copy_(b)
        writes[:] = [a]  # B -> A during the repack, and it stays A
        layer(x)
        assert layer._kernel._packing.settled is False  # the weight moved off the snapshot it packed
        torch.testing.assert_close(layer(x), x @ a.T, **tolerance)
        assert layer._kernel._packing.settled


# -- int8 drafting kernels (FrozenOutput(precision="int8")) -------------------------------------------------

needs_int8 = pytest.mark.skipif(not int8_linear_available(), reason="no x86 int8 linear (fbgemm) in this torch")


@needs_int8
def test_int8_kernel_is_close_to_float_follows_changes_and_survives_copies():
    """int8: per-row weight scales, so every output row is within a few percent of float32; a
    changed weight is packed again; copies and pickles keep the precision; training keeps F.linear."""
    import copy
    import pickle

    torch.manual_seed(0)
    weight, bias = torch.randn(300, 64) * torch.logspace(-2, 0, 300)[:, None], nn.Parameter(torch.randn(300))
    hidden = torch.randn(2, 3, 64)
    output = FrozenOutput("int8")
    with torch.inference_mode():
        got = output(hidden, weight, bias)
        exact = nn.functional.linear(hidden, weight, bias)
    assert got.shape == (2, 3, 300) and not torch.equal(got, exact)  # the int8 kernel ran
    # per-row scales: a small row's error is small too (one scale per matrix would swamp it)
    error = (got - exact).abs().amax(dim=(0, 1)) / (hidden.abs().amax() * weight.abs().sum(dim=1))  # (300,)
    assert float(error.max()) < 0.02
    other = weight * 2
    with torch.inference_mode():
        torch.testing.assert_close(output(hidden, other, None), hidden @ other.T, atol=0.05 * float((hidden @ other.T).abs().max()), rtol=0)
    assert output._packing.source is other
    for clone in (copy.deepcopy(output), pickle.loads(pickle.dumps(output))):
        assert clone.precision == "int8" and clone._packing is None
    trained = output(hidden, weight, bias)  # gradients wanted: float32 F.linear, exact
    torch.testing.assert_close(trained, exact)
    output.set_precision("float32")
    assert output.precision == "float32" and output._packing is None
    with pytest.raises(InvalidArgument, match="draft precision"):
        FrozenOutput("int4")


@needs_int8
def test_set_draft_precision_reaches_every_kernel_and_an_eagle_head_keeps_its_fusion_float():
    from specpool.drafters.eagle_model import EagleConfig, EagleHead

    torch.manual_seed(0)
    config = EagleConfig(hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48, reduced_vocab=40)
    head = EagleHead(config, torch.randn(100, 32) * 0.1, torch.arange(40))
    head.eval()
    ids, feats = torch.randint(0, 100, (1, 6)), torch.randn(1, 6, 32)
    with torch.inference_mode():
        before = head.reduced_logits(head(ids, feats))
    head.set_draft_precision("int8")
    kernels = {name: m._kernel.precision for name, m in head.named_modules() if isinstance(m, InferenceLinear)}
    assert kernels.pop("fuse") == "float32" and set(kernels.values()) == {"int8"} and len(kernels) == 7
    assert head._output.precision == "int8"
    with torch.inference_mode():
        after = head.reduced_logits(head(ids, feats))
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, before, atol=0.1 * float(before.abs().max()), rtol=0)
    assert set_draft_precision(head, "float32") == 9  # eight layers' kernels and the output head
    with pytest.raises(InvalidArgument, match="draft precision"):
        set_draft_precision(head, "fp8")
