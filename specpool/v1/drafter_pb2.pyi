from specpool.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProposeRequest(_message.Message):
    __slots__ = ("session_id", "context_ids", "k", "sampling", "weight_version", "drafter", "tenant", "exact_version", "features", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EXACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingParams
    weight_version: int
    drafter: str
    tenant: str
    exact_version: bool
    features: _common_pb2.Features
    tree: bool
    def __init__(self, session_id: _Optional[str] = ..., context_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., weight_version: _Optional[int] = ..., drafter: _Optional[str] = ..., tenant: _Optional[str] = ..., exact_version: _Optional[bool] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ..., tree: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("tokens", "q", "forward_s", "weight_version", "direct", "source", "tree", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    forward_s: float
    weight_version: int
    direct: _common_pb2.DirectRoute
    source: str
    tree: bool
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., forward_s: _Optional[float] = ..., weight_version: _Optional[int] = ..., direct: _Optional[_Union[_common_pb2.DirectRoute, _Mapping]] = ..., source: _Optional[str] = ..., tree: _Optional[bool] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplayRequest(_message.Message):
    __slots__ = ("session_id", "context_ids", "continuation", "k", "sampling", "drafter", "tenant", "weight_version", "exact_version", "features")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXACT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    continuation: _containers.RepeatedScalarFieldContainer[int]
    k: int
    sampling: _common_pb2.SamplingParams
    drafter: str
    tenant: str
    weight_version: int
    exact_version: bool
    features: _common_pb2.Features
    def __init__(self, session_id: _Optional[str] = ..., context_ids: _Optional[_Iterable[int]] = ..., continuation: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., drafter: _Optional[str] = ..., tenant: _Optional[str] = ..., weight_version: _Optional[int] = ..., exact_version: _Optional[bool] = ..., features: _Optional[_Union[_common_pb2.Features, _Mapping]] = ...) -> None: ...

class ReplayResponse(_message.Message):
    __slots__ = ("accepted", "known", "replay_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    REPLAY_S_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    known: bool
    replay_s: float
    def __init__(self, accepted: _Optional[int] = ..., known: _Optional[bool] = ..., replay_s: _Optional[float] = ...) -> None: ...
