"""Deeper white-box heads and int8 storage (specpool/drafters/weight_storage.py,
``HeadOptions.num_layers`` / ``storage``): a two-block head stored in int8 loads as the rounded
weights, drafts exactly what a cache-free recomputation drafts, batches as it drafts alone and
decodes losslessly; a head grown from a one-block head drafts as its source before training; int8
rounding stays within half a step of each row's scale. (Training a grown head in int8:
tests/unit/test_eagle_train.py, beside the runs it grows from.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from specpool.drafters.base import DraftRequest
from specpool.drafters.eagle import load_eagle_head
from specpool.drafters.eagle_model import EagleHead
from specpool.drafters.weight_storage import SCALE_SUFFIX, pack, unpack
from specpool.learning.eagle_train import _init_from_head
from specpool.router.loop import FixedChooser
from specpool.target.verifier import TargetVerifier
from test_eagle_drafter import (
    GREEDY, drafter_of, final_hidden, fit_head, generate, reference_draft, tell, tiny_head_config, write_head,
)


# -- storage ----------------------------------------------------------------------------------------------


def test_int8_rounds_each_row_within_half_a_step_and_leaves_the_rest_as_float16():
    torch.manual_seed(0)
    state = {"blocks.0.q_proj.weight": torch.randn(24, 16) * torch.logspace(-3, 1, 24)[:, None],  # rows of any scale
             "blocks.0.attn_norm.weight": torch.randn(16), "fuse.weight": torch.randn(16, 32),
             "head_bias": torch.randn(48), "vocab_ids": torch.arange(48)}
    packed = pack(state, "int8")
    assert packed["blocks.0.q_proj.weight"].dtype == packed["fuse.weight"].dtype == torch.int8
    assert packed["blocks.0.attn_norm.weight"].dtype == packed["head_bias"].dtype == torch.float16  # vectors stay
    assert packed["vocab_ids"].dtype == torch.int32
    restored = unpack(packed)
    assert restored.keys() == state.keys() and restored["vocab_ids"].dtype == torch.long
    for name in ("blocks.0.q_proj.weight", "fuse.weight"):
        step = packed[name + SCALE_SUFFIX].float()[:, None]  # (rows, 1)
        error = (restored[name] - state[name]).abs()
        assert bool((error <= step * (0.5 + 1e-5)).all()), name  # half a step, rounded with the stored scale
        assert float(error.max()) > 0  # really quantised
    torch.testing.assert_close(restored["head_bias"], state["head_bias"].half().float())
    assert unpack(pack(state))["fuse.weight"].equal(state["fuse.weight"].half().float())
    with pytest.raises(ValueError, match="unknown weight storage"):
        pack(state, "int4")
    lost = dict(packed)
    del lost["fuse.weight" + SCALE_SUFFIX]
    with pytest.raises(ValueError, match="no :int8_row_scale"):
        unpack(lost)


# -- a two-block head stored in int8 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep(tmp_path_factory, target_lm, prompts, model_dirs, home):
    """A two-block head fitted as the one-block test head is, written in int8, loaded back."""
    model, tokenizer = target_lm
    fitted = fit_head(model, model_dirs.target, prompts, num_layers=2)
    folder = write_head(tmp_path_factory.mktemp("deep") / "deep", fitted, model_dirs.target, tokenizer, storage="int8")
    loaded, _ = load_eagle_head(folder, home, str(model_dirs.target))
    return fitted, loaded, folder


def test_a_two_block_int8_head_loads_as_its_rounded_weights(deep):
    fitted, loaded, folder = deep
    assert loaded.config.num_layers == 2 and len(loaded.blocks) == 2
    stored = load_file(str(folder / "model.safetensors"))
    assert stored["blocks.1.down_proj.weight"].dtype == torch.int8
    want = unpack(pack(fitted.state_dict(), "int8"))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_a_two_block_head_drafts_what_a_cache_free_recomputation_drafts(deep, target_lm, prompts):
    _, head, _ = deep
    model, _ = target_lm
    drafter = drafter_of(head, confidence_threshold=0.0)
    sequence = prompts[20]
    n = len(sequence) - 24 + 1
    for start, length in ((0, n), (n - 1, n + 4), (n + 3, n + 5)):  # cold, after 4 accepted, after 1
        context = sequence[:length]
        tell(drafter, "s", model, context, start=start)
        want, _ = reference_draft(head, context, final_hidden(model, context), 5)
        assert drafter.propose("s", context, 5, GREEDY).tokens == want, length


def test_a_two_block_head_batches_as_it_drafts_alone_and_decodes_losslessly(deep, target_lm, prompts, greedy_reference):
    _, head, _ = deep
    model, tokenizer = target_lm
    alone, batched = drafter_of(head), drafter_of(head)
    requests = []
    for i, sequence in enumerate(prompts[:4]):
        context = sequence[:len(sequence) - 20 + i]
        for drafter in (alone, batched):
            tell(drafter, f"s{i}", model, context)
        requests.append(DraftRequest(f"s{i}", context, 5, GREEDY))
    together = batched.propose_batch(requests)
    assert [p.tokens for p in together] == [alone.propose(r.session_id, r.context_ids, 5, GREEDY).tokens for r in requests]
    verifier = TargetVerifier(model, tokenizer)
    accepted = 0
    for i, sequence in enumerate(prompts[::6]):
        prompt = sequence[:-24]
        result = generate(verifier, {"deep": drafter_of(head)}, FixedChooser("deep"), prompt, session=f"g{i}")
        assert result.token_ids == greedy_reference(model, prompt, GREEDY.max_new_tokens), i
        accepted += sum(r.accepted for r in result.rounds)
    assert accepted > 0  # it really drafted


# -- growing a head ---------------------------------------------------------------------------------------------


def test_a_head_grown_a_block_drafts_as_its_source_until_it_trains():
    torch.manual_seed(0)
    embedding, vocab_ids = torch.randn(64, 32), torch.arange(0, 64, 2)
    source = EagleHead(tiny_head_config(1), embedding, vocab_ids)
    for p in source.parameters():
        torch.nn.init.normal_(p, std=0.2)
    grown = EagleHead(tiny_head_config(2), embedding, vocab_ids)
    _init_from_head(grown, source)
    ids, feats = torch.randint(0, 64, (2, 7)), torch.randn(2, 7, 32)
    assert torch.equal(grown(ids, feats), source(ids, feats))
    assert float(grown.blocks[1].q_proj.weight.detach().abs().sum()) > 0  # only the residual outputs are zero
    with pytest.raises(Exception, match="cannot drop blocks"):
        _init_from_head(EagleHead(tiny_head_config(1), embedding, vocab_ids), grown)

def test_an_int8_head_missing_a_scale_is_refused_in_one_line(deep, tmp_path, home, model_dirs):
    import shutil

    from safetensors.torch import save_file

    from specpool.core.errors import ModelUnavailable

    _, _, folder = deep
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["blocks.0.q_proj.weight" + SCALE_SUFFIX]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelUnavailable, match="unreadable.*no :int8_row_scale") as caught:
        load_eagle_head(broken, home, str(model_dirs.target))
    assert "\n" not in str(caught.value)
