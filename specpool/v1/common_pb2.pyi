from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEATURE_DTYPE_UNSPECIFIED: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_FLOAT16: _ClassVar[FeatureDtype]
    FEATURE_DTYPE_BFLOAT16: _ClassVar[FeatureDtype]
FEATURE_DTYPE_UNSPECIFIED: FeatureDtype
FEATURE_DTYPE_FLOAT16: FeatureDtype
FEATURE_DTYPE_BFLOAT16: FeatureDtype

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "keep_caches")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_CACHES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_caches: bool
    def __init__(self, session_id: _Optional[str] = ..., keep_caches: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DirectRoute(_message.Message):
    __slots__ = ("node_id", "address", "token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    token: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "width", "dtype", "data")
    START_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start: int
    width: int
    dtype: FeatureDtype
    data: bytes
    def __init__(self, start: _Optional[int] = ..., width: _Optional[int] = ..., dtype: _Optional[_Union[FeatureDtype, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
