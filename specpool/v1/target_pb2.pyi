from specpool.v1 import common_pb2 as _common_pb2
from specpool.v1 import drafter_pb2 as _drafter_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "context_ids", "draft_tokens", "q", "sampling", "return_top_k", "return_features", "draft_tree", "tree_parents", "hosted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    RETURN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREE_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    HOSTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    return_top_k: int
    return_features: bool
    draft_tree: bool
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    hosted: HostedDraft
    def __init__(self, session_id: _Optional[str] = ..., context_ids: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_top_k: _Optional[int] = ..., return_features: _Optional[bool] = ..., draft_tree: _Optional[bool] = ..., tree_parents: _Optional[_Iterable[int]] = ..., hosted: _Optional[_Union[HostedDraft, _Mapping]] = ...) -> None: ...

class HostedDraft(_message.Message):
    __slots__ = ("drafter", "k", "tree", "feed")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    FEED_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    tree: bool
    feed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ..., tree: _Optional[bool] = ..., feed: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "tokens", "tv", "target_top_k", "forward_s", "direct", "features", "drafted")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TV_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOP_K_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    tv: _containers.RepeatedScalarFieldContainer[float]
    target_top_k: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    forward_s: float
    direct: _common_pb2.DirectRoute
    features: _common_pb2.Features
    drafted: _drafter_pb2.ProposeResponse
    def __init__(self, accepted: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., tv: _Optional[_Iterable[float]] = ..., target_top_k: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., forward_s: _Optional[float] = ..., direct: _Optional[_Union[_common_pb2.DirectRoute, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., drafted: _Optional[_Union[_drafter_pb2.ProposeResponse, _Mapping]] = ...) -> None: ...
