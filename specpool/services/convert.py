"""Protobuf <-> dataclass conversion for the internal services (Target.Verify, Drafter.Propose):
protobuf types stop here (docs/ARCHITECTURE.md, "Layout"); ``specpool/services/api.py`` does the public SpecPool API.

The router's loop, the verifier and the drafters pass dataclasses (``VerifyRequest``,
``Proposal``, ``SparseDist``, ``SamplingParams``); the messages of ``protos/specpool/v1`` exist
only on the wire. Every ``*_from_proto`` checks what a well-typed message can still get wrong
(lengths that must agree, a oneof left empty) and raises ``InvalidArgument`` with a message for
the caller. Pure: no servers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from specpool.drafters.base import Proposal
from specpool.core.errors import FailedPrecondition, check
from specpool.router.hosted import HostedDraft
from specpool.router.session_store import TENANT_PATTERN
from specpool.services.api import decimal_float
from specpool.v1 import common_pb2, drafter_pb2, target_pb2
from specpool.target.features import FeatureGap, Features, decode_features, encode_features
from specpool.target.rejection import SparseDist
from specpool.target.sampling import MAX_DRAFT_LENGTH, SamplingParams
from specpool.target.tree import check_tree
from specpool.target.verifier import VerifyRequest, VerifyResult



# -- shared messages ----------------------------------------------------------------------------------
def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed)


def sampling_from_proto(
    msg: common_pb2.SamplingParams, max_new_tokens: int = 128, stop_token_ids: tuple[int, ...] = ()
) -> SamplingParams:
    """``top_p`` unset means 1.0; an explicit 0 stays 0 and fails validation (INVALID_ARGUMENT)."""
    top_p = decimal_float(msg.top_p) if msg.HasField("top_p") else 1.0
    return SamplingParams(
        temperature=decimal_float(msg.temperature), top_p=top_p, top_k=int(msg.top_k), seed=int(msg.seed),
        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
    )


def sparse_to_proto(dist: SparseDist) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.float().tolist())


def sparse_from_proto(msg: common_pb2.SparseDistribution, what: str = "a distribution") -> SparseDist:
    check(len(msg.token_ids) == len(msg.probs),
          f"{what} has {len(msg.token_ids)} token ids but {len(msg.probs)} probabilities")
    check(len(msg.token_ids) > 0, f"{what} is empty")
    return SparseDist(torch.tensor(list(msg.token_ids), dtype=torch.long), torch.tensor(list(msg.probs), dtype=torch.float32))


# -- features (white-box drafters) ---------------------------------------------------------------------
FEATURE_DTYPES = {"float16": common_pb2.FEATURE_DTYPE_FLOAT16, "bfloat16": common_pb2.FEATURE_DTYPE_BFLOAT16}
_FEATURE_DTYPE_NAMES = {v: k for k, v in FEATURE_DTYPES.items()}
# How a drafter server says which position to resend features from: a FeatureGap crosses Serve
# pickled and the direct route as a gRPC status, and on both only its message survives intact.
_FEATURES_NEEDED = re.compile(r"\(features_needed=(\d+)\)")


def features_to_proto(features: Features, dtype: str = "float16") -> common_pb2.Features:
    """``features`` as wire bytes: 2 bytes a value, (rows x width x 2) in all."""
    check(dtype in FEATURE_DTYPES, f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, got {dtype!r}")
    return common_pb2.Features(start=features.start, width=int(features.rows.shape[1]), dtype=FEATURE_DTYPES[dtype],
                               data=encode_features(features, dtype))


def features_from_proto(msg: common_pb2.Features) -> Features:
    """Rows as float32; a width of 0, an unset dtype or bytes that are not whole rows are INVALID_ARGUMENT."""
    dtype = _FEATURE_DTYPE_NAMES.get(msg.dtype)
    check(dtype is not None, f"features need a dtype, float16 or bfloat16 (got enum value {msg.dtype})")
    check(msg.width > 0, "features need a width > 0 (the target's hidden size)")
    return decode_features(int(msg.start), int(msg.width), msg.data, dtype)


def feature_bytes(msg) -> int:
    """Feature bytes a message carries (0 when it has none)."""
    return len(msg.features.data) if msg.HasField("features") else 0


def feature_gap_error(gap: FeatureGap) -> FailedPrecondition:
    """A drafter server's answer to features after a gap, with the position to resend from."""
    return FailedPrecondition(f"{gap} (features_needed={gap.needed})")


def features_needed(exc: BaseException) -> int | None:
    """The position a drafter server asked features to be resent from, if ``exc`` is its answer to a gap."""
    if isinstance(exc, FeatureGap):
        return exc.needed
    # Over Serve the FailedPrecondition itself; over a direct route whatever the status became.
    if getattr(exc, "code", None) != FailedPrecondition.code:
        return None
    found = _FEATURES_NEEDED.search(str(exc))
    return int(found.group(1)) if found else None


def _session(session_id: str) -> str:
    check(bool(session_id), "session_id is empty")
    return session_id


# -- Target.Verify ------------------------------------------------------------------------------------
def verify_request_to_proto(request: VerifyRequest, hosted: HostedDraft | None = None) -> target_pb2.VerifyRequest:
    """``hosted``: what the round asks of a target that hosts drafters (specpool/router/hosted.py)."""
    return target_pb2.VerifyRequest(
        session_id=request.session_id, context_ids=request.context_ids, draft_tokens=request.draft_tokens,
        q=[sparse_to_proto(q) for q in request.q], sampling=sampling_to_proto(request.params),
        return_top_k=request.return_top_k, return_features=request.return_features,
        draft_tree=request.tree_parents is not None, tree_parents=request.tree_parents or (),
        hosted=None if hosted is None else target_pb2.HostedDraft(drafter=hosted.drafter or "", k=hosted.k if hosted.drafter else 0,
                                                                   tree=hosted.tree, feed=hosted.feed),
    )


def hosted_draft_from_proto(msg: target_pb2.VerifyRequest) -> HostedDraft | None:
    """A verify request's ``hosted`` part; None when it has none."""
    if not msg.HasField("hosted"):
        return None
    hosted = msg.hosted
    if hosted.drafter:
        check(1 <= hosted.k <= MAX_DRAFT_LENGTH, f"a hosted draft needs k in 1..{MAX_DRAFT_LENGTH}, got {hosted.k}")
        check(len(msg.draft_tokens) == 0, "a round drafted by a hosted drafter carries no draft tokens of its own")
    return HostedDraft(hosted.drafter or None, int(hosted.k), bool(hosted.tree), tuple(hosted.feed))


def verify_request_from_proto(msg: target_pb2.VerifyRequest) -> VerifyRequest:
    check(len(msg.q) == len(msg.draft_tokens),
          f"a verify request needs one q per draft token: {len(msg.draft_tokens)} tokens, {len(msg.q)} q")
    check(len(msg.draft_tokens) <= MAX_DRAFT_LENGTH, f"at most {MAX_DRAFT_LENGTH} draft tokens, got {len(msg.draft_tokens)}")
    return VerifyRequest(
        session_id=_session(msg.session_id), context_ids=list(msg.context_ids), draft_tokens=list(msg.draft_tokens),
        q=[sparse_from_proto(q, f"q of draft token {i + 1}") for i, q in enumerate(msg.q)],
        params=sampling_from_proto(msg.sampling), return_top_k=int(msg.return_top_k),
        return_features=bool(msg.return_features), tree_parents=_tree_parents(msg.draft_tree, msg.tree_parents, msg.draft_tokens),
    )


def _tree_parents(is_tree: bool, parents, tokens) -> tuple[int, ...] | None:
    """A message's draft tree (None: a chain), checked: one parent per token, parents first."""
    if not is_tree:
        check(len(parents) == 0, "tree parents were sent for drafts that are not a tree")
        return None
    check_tree(list(parents), len(tokens))
    return tuple(int(p) for p in parents)


def verify_result_to_proto(result: VerifyResult, feature_dtype: str = "float16",
                           drafted: Proposal | None = None) -> target_pb2.VerifyResponse:
    """``feature_dtype``: the wire encoding of ``result.features`` (when it has them); ``drafted``:
    the proposal a hosted drafter made for this round."""
    response = target_pb2.VerifyResponse(
        accepted=result.accepted, tokens=result.tokens, tv=result.tv,
        target_top_k=[sparse_to_proto(d) for d in (result.target_top_k or [])], forward_s=result.forward_s,
        drafted=None if drafted is None else proposal_to_proto(drafted),
    )
    if result.features is not None:
        response.features.CopyFrom(features_to_proto(result.features, feature_dtype))
    return response


def verify_result_from_proto(msg: target_pb2.VerifyResponse) -> VerifyResult:
    """``features`` None when the response carries none (not asked for, or a target too old to send them)."""
    return VerifyResult(
        accepted=int(msg.accepted), tokens=list(msg.tokens), tv=list(msg.tv),
        target_top_k=[sparse_from_proto(d) for d in msg.target_top_k] or None, forward_s=float(msg.forward_s),
        features=features_from_proto(msg.features) if msg.HasField("features") else None,
    )


# -- Drafter.Propose ----------------------------------------------------------------------------------
def propose_request_to_proto(session_id: str, context_ids: list[int], k: int, params: SamplingParams,
                             drafter: str = "", tenant: str = "", weight_version: int | None = None,
                             features: common_pb2.Features | None = None, tree: bool = False) -> drafter_pb2.ProposeRequest:
    """``weight_version`` None: the tenant's serving version (a request's first round); a number:
    exactly that version (its later rounds). ``features``: the rows the server has not been sent
    (white-box drafters), already encoded. ``tree``: ask for a draft tree."""
    return drafter_pb2.ProposeRequest(session_id=session_id, context_ids=context_ids, k=k,
                                      sampling=sampling_to_proto(params), drafter=drafter, tenant=tenant,
                                      features=features, tree=tree, **_version_fields(weight_version))


def _version_fields(weight_version: int | None) -> dict:
    return {"weight_version": weight_version or 0, "exact_version": weight_version is not None}


@dataclass(frozen=True)
class ProposeArgs:
    """A ProposeRequest as the arguments of ``Drafter.propose``."""

    session_id: str
    context_ids: list[int]
    k: int
    params: SamplingParams
    drafter: str  # "" = the server's only drafter
    tenant: str = ""  # whose learned variant drafts ("" = the shipped weights)
    weight_version: int | None = None  # None: the tenant's serving version; a number: exactly it
    features: Features | None = None  # white-box drafters: rows to apply before drafting; None: none sent
    tree: bool = False  # propose a draft tree (drafters that draft trees, greedy rounds)


def _drafter_call_fields(msg: drafter_pb2.ProposeRequest | drafter_pb2.ReplayRequest, what: str) -> dict:
    """The checked fields a ProposeRequest and a ReplayRequest share, as ProposeArgs keywords."""
    check(1 <= msg.k <= MAX_DRAFT_LENGTH, f"k (draft length) must be in 1..{MAX_DRAFT_LENGTH}, got {msg.k}")
    check(len(msg.context_ids) > 0, f"a {what} request needs a non-empty context")
    if msg.tenant:
        check(TENANT_PATTERN.fullmatch(msg.tenant) is not None, f"invalid tenant {msg.tenant!r}")
    return {"session_id": _session(msg.session_id), "context_ids": list(msg.context_ids), "k": int(msg.k),
            "params": sampling_from_proto(msg.sampling), "drafter": msg.drafter, "tenant": msg.tenant,
            "weight_version": int(msg.weight_version) if msg.exact_version else None,
            "features": features_from_proto(msg.features) if msg.HasField("features") else None}


def propose_request_from_proto(msg: drafter_pb2.ProposeRequest) -> ProposeArgs:
    return ProposeArgs(**_drafter_call_fields(msg, "propose"), tree=bool(msg.tree))


def proposal_to_proto(proposal: Proposal, weight_version: int = 0) -> drafter_pb2.ProposeResponse:
    return drafter_pb2.ProposeResponse(tokens=proposal.tokens, q=[sparse_to_proto(q) for q in proposal.q],
                                       forward_s=proposal.forward_s, weight_version=weight_version,
                                       source=proposal.source or "", tree=proposal.parents is not None,
                                       parents=proposal.parents or ())


# -- Drafter.Replay -----------------------------------------------------------------------------------
def replay_request_to_proto(session_id: str, context_ids: list[int], continuation: list[int], k: int,
                            params: SamplingParams, drafter: str = "", tenant: str = "",
                            weight_version: int | None = None,
                            features: common_pb2.Features | None = None) -> drafter_pb2.ReplayRequest:
    """``weight_version`` and ``features`` as in ``propose_request_to_proto``."""
    return drafter_pb2.ReplayRequest(session_id=session_id, context_ids=context_ids, continuation=continuation, k=k,
                                     sampling=sampling_to_proto(params), drafter=drafter, tenant=tenant,
                                     features=features, **_version_fields(weight_version))


@dataclass(frozen=True)
class ReplayArgs(ProposeArgs):
    """A ReplayRequest: the arguments of ``Drafter.replay``, a propose's plus the target's tokens."""

    continuation: list[int] = field(default_factory=list)


def replay_request_from_proto(msg: drafter_pb2.ReplayRequest) -> ReplayArgs:
    fields = _drafter_call_fields(msg, "replay")
    check(1 <= len(msg.continuation) <= msg.k + 1,
          f"a replay needs 1..k+1 of the target's tokens, got {len(msg.continuation)} for k = {msg.k}")
    check(fields["params"].greedy, "replay needs greedy decoding (temperature 0): a sampled draft is not determined by the context")
    return ReplayArgs(**fields, continuation=list(msg.continuation))


def replay_to_proto(accepted: int | None, replay_s: float = 0.0) -> drafter_pb2.ReplayResponse:
    return drafter_pb2.ReplayResponse(accepted=accepted or 0, known=accepted is not None, replay_s=replay_s)


def replay_from_proto(msg: drafter_pb2.ReplayResponse) -> int | None:
    return int(msg.accepted) if msg.known else None


def proposal_from_proto(msg: drafter_pb2.ProposeResponse) -> Proposal:
    check(len(msg.q) == len(msg.tokens), f"a proposal needs one q per token: {len(msg.tokens)} tokens, {len(msg.q)} q")
    return Proposal(list(msg.tokens), [sparse_from_proto(q, f"q of draft token {i + 1}") for i, q in enumerate(msg.q)],
                    float(msg.forward_s), msg.source or None, _tree_parents(msg.tree, msg.parents, msg.tokens))
