from tandem.wire import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TargetInfo(_message.Message):
    __slots__ = ("architecture", "hidden_size", "vocab_size", "num_layers", "max_context", "dtype", "eos_token_ids", "tp_size", "running_requests", "kv_blocks_total", "kv_blocks_free", "kv_block_size", "max_draft_tokens", "tokenizer_digest", "instance", "images", "kept_kv")
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    KEPT_KV_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_context: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    running_requests: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int
    max_draft_tokens: int
    tokenizer_digest: str
    instance: str
    images: ImageLayout
    kept_kv: _containers.RepeatedCompositeFieldContainer[KeptKV]
    def __init__(self, architecture: _Optional[str] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., tokenizer_digest: _Optional[str] = ..., instance: _Optional[str] = ..., images: _Optional[_Union[ImageLayout, _Mapping]] = ..., kept_kv: _Optional[_Iterable[_Union[KeptKV, _Mapping]]] = ...) -> None: ...

class KeptKV(_message.Message):
    __slots__ = ("layer", "sliding", "num_kv_heads", "head_dim")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SLIDING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    sliding: bool
    num_kv_heads: int
    head_dim: int
    def __init__(self, layer: _Optional[int] = ..., sliding: _Optional[bool] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class ImageLayout(_message.Message):
    __slots__ = ("limit", "tokens_per_image", "soft_token_budget", "patch_budget", "begin_token_id", "image_token_id", "end_token_id", "mark_token_id", "around", "pan_and_scan")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_IMAGE_FIELD_NUMBER: _ClassVar[int]
    SOFT_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PATCH_BUDGET_FIELD_NUMBER: _ClassVar[int]
    BEGIN_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MARK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    AROUND_FIELD_NUMBER: _ClassVar[int]
    PAN_AND_SCAN_FIELD_NUMBER: _ClassVar[int]
    limit: int
    tokens_per_image: int
    soft_token_budget: SoftTokenBudget
    patch_budget: PatchBudget
    begin_token_id: int
    image_token_id: int
    end_token_id: int
    mark_token_id: int
    around: str
    pan_and_scan: PanAndScan
    def __init__(self, limit: _Optional[int] = ..., tokens_per_image: _Optional[int] = ..., soft_token_budget: _Optional[_Union[SoftTokenBudget, _Mapping]] = ..., patch_budget: _Optional[_Union[PatchBudget, _Mapping]] = ..., begin_token_id: _Optional[int] = ..., image_token_id: _Optional[int] = ..., end_token_id: _Optional[int] = ..., mark_token_id: _Optional[int] = ..., around: _Optional[str] = ..., pan_and_scan: _Optional[_Union[PanAndScan, _Mapping]] = ...) -> None: ...

class PanAndScan(_message.Message):
    __slots__ = ("min_crop_size", "max_num_crops", "min_ratio_to_activate")
    MIN_CROP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_CROPS_FIELD_NUMBER: _ClassVar[int]
    MIN_RATIO_TO_ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    min_crop_size: int
    max_num_crops: int
    min_ratio_to_activate: float
    def __init__(self, min_crop_size: _Optional[int] = ..., max_num_crops: _Optional[int] = ..., min_ratio_to_activate: _Optional[float] = ...) -> None: ...

class SoftTokenBudget(_message.Message):
    __slots__ = ("patch_size", "pooling_kernel_size", "max_soft_tokens")
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    POOLING_KERNEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SOFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    def __init__(self, patch_size: _Optional[int] = ..., pooling_kernel_size: _Optional[int] = ..., max_soft_tokens: _Optional[int] = ...) -> None: ...

class PatchBudget(_message.Message):
    __slots__ = ("patch_size", "merge_size", "max_patches", "max_side")
    PATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MERGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_PATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_SIDE_FIELD_NUMBER: _ClassVar[int]
    patch_size: int
    merge_size: int
    max_patches: int
    max_side: int
    def __init__(self, patch_size: _Optional[int] = ..., merge_size: _Optional[int] = ..., max_patches: _Optional[int] = ..., max_side: _Optional[int] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("prompt", "sampling", "end_token_ids", "generated", "cache_salt", "images")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generated: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    images: _containers.RepeatedCompositeFieldContainer[PromptImage]
    def __init__(self, prompt: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., generated: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[PromptImage, _Mapping]]] = ...) -> None: ...

class PromptImage(_message.Message):
    __slots__ = ("data", "start", "crop")
    DATA_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CROP_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    start: int
    crop: int
    def __init__(self, data: _Optional[bytes] = ..., start: _Optional[int] = ..., crop: _Optional[int] = ...) -> None: ...

class StepItem(_message.Message):
    __slots__ = ("request_id", "round", "open", "num_tokens", "drafts", "draft_replica", "set_replica", "replay", "logprobs", "top_logprobs", "decode_steps", "draft_ahead")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPLICA_FIELD_NUMBER: _ClassVar[int]
    SET_REPLICA_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    open: OpenRequest
    num_tokens: int
    drafts: _common_pb2.DraftTree
    draft_replica: str
    set_replica: bool
    replay: bool
    logprobs: bool
    top_logprobs: int
    decode_steps: int
    draft_ahead: int
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., open: _Optional[_Union[OpenRequest, _Mapping]] = ..., num_tokens: _Optional[int] = ..., drafts: _Optional[_Union[_common_pb2.DraftTree, _Mapping]] = ..., draft_replica: _Optional[str] = ..., set_replica: _Optional[bool] = ..., replay: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., decode_steps: _Optional[int] = ..., draft_ahead: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("items", "preempt", "target_instance")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_FIELD_NUMBER: _ClassVar[int]
    TARGET_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[StepItem]
    preempt: _containers.RepeatedScalarFieldContainer[str]
    target_instance: str
    def __init__(self, items: _Optional[_Iterable[_Union[StepItem, _Mapping]]] = ..., preempt: _Optional[_Iterable[str]] = ..., target_instance: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("request_id", "error", "accepted", "new_tokens", "streaming", "logprobs", "cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: _common_pb2.CallError
    accepted: int
    new_tokens: _containers.RepeatedScalarFieldContainer[int]
    streaming: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ..., accepted: _Optional[int] = ..., new_tokens: _Optional[_Iterable[int]] = ..., streaming: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "compute_seconds", "kv_blocks_free", "error")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    compute_seconds: float
    kv_blocks_free: int
    error: _common_pb2.CallError
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., compute_seconds: _Optional[float] = ..., kv_blocks_free: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.CallError, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id", "capture_indices", "tokens_only", "prefix_caching", "prefix_shift", "image_embeddings")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_INDICES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ONLY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHIFT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    capture_indices: _containers.RepeatedScalarFieldContainer[int]
    tokens_only: bool
    prefix_caching: bool
    prefix_shift: int
    image_embeddings: bool
    def __init__(self, replica_id: _Optional[str] = ..., capture_indices: _Optional[_Iterable[int]] = ..., tokens_only: _Optional[bool] = ..., prefix_caching: _Optional[bool] = ..., prefix_shift: _Optional[int] = ..., image_embeddings: _Optional[bool] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("request_id", "round", "start_position", "next_tokens", "features", "draft_ahead", "step_end", "released", "shaping", "prefix_tokens", "cache_salt", "image_starts", "image_digests", "image_rows", "image_embeddings")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_FIELD_NUMBER: _ClassVar[int]
    STEP_END_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SHAPING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_STARTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ROWS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    round: int
    start_position: int
    next_tokens: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    draft_ahead: int
    step_end: bool
    released: bool
    shaping: DraftShaping
    prefix_tokens: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    image_starts: _containers.RepeatedScalarFieldContainer[int]
    image_digests: _containers.RepeatedScalarFieldContainer[str]
    image_rows: _containers.RepeatedScalarFieldContainer[int]
    image_embeddings: _common_pb2.Tensor
    def __init__(self, request_id: _Optional[str] = ..., round: _Optional[int] = ..., start_position: _Optional[int] = ..., next_tokens: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_ahead: _Optional[int] = ..., step_end: _Optional[bool] = ..., released: _Optional[bool] = ..., shaping: _Optional[_Union[DraftShaping, _Mapping]] = ..., prefix_tokens: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., image_starts: _Optional[_Iterable[int]] = ..., image_digests: _Optional[_Iterable[str]] = ..., image_rows: _Optional[_Iterable[int]] = ..., image_embeddings: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DraftShaping(_message.Message):
    __slots__ = ("sampling", "prompt_length", "first_token")
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sampling: _common_pb2.SamplingParams
    prompt_length: int
    first_token: int
    def __init__(self, sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_length: _Optional[int] = ..., first_token: _Optional[int] = ...) -> None: ...

class HiddenBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[HiddenStates]
    def __init__(self, rows: _Optional[_Iterable[_Union[HiddenStates, _Mapping]]] = ...) -> None: ...

class WeightsRequest(_message.Message):
    __slots__ = ("names", "chunk_bytes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "total_bytes", "data", "sha256", "shard_rank", "num_shards", "vocab_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    sha256: str
    shard_rank: int
    num_shards: int
    vocab_size: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., shard_rank: _Optional[int] = ..., num_shards: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...
