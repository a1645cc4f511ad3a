from tandem.wire import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("replica_id", "architecture", "num_steps", "capture_indices", "running_requests", "kv_blocks_total", "kv_blocks_free", "kind", "drafted_ahead")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_INDICES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    architecture: str
    num_steps: int
    capture_indices: _containers.RepeatedScalarFieldContainer[int]
    running_requests: int
    kv_blocks_total: int
    kv_blocks_free: int
    kind: str
    drafted_ahead: int
    def __init__(self, replica_id: _Optional[str] = ..., architecture: _Optional[str] = ..., num_steps: _Optional[int] = ..., capture_indices: _Optional[_Iterable[int]] = ..., running_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kind: _Optional[str] = ..., drafted_ahead: _Optional[int] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "round", "num_steps", "rows_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    num_steps: int
    rows_end: int
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., num_steps: _Optional[int] = ..., rows_end: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("request_id", "drafts", "error", "prefix_queried_tokens", "prefix_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    drafts: _common_pb2.DraftTree
    error: _common_pb2.CallError
    prefix_queried_tokens: int
    prefix_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., drafts: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_cached_tokens: _Optional[int] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "compute_seconds", "error", "ahead_seconds")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    compute_seconds: float
    error: _common_pb2.CallError
    ahead_seconds: float
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ..., ahead_seconds: _Optional[float] = ...) -> None: ...

class DraftReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DraftReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
