"""Tensor codec, weight chunking and the shared gRPC plumbing, including a real server on loopback."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.grpc_util import (
    MAX_MESSAGE_BYTES,
    add_standard_services,
    channel_options,
    create_server,
    wait_for_ready,
)
from tandem.transport import Insecure
from tandem.wire import common_pb2, target_pb2
from tandem.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    ShardOf,
    WeightAssembler,
    dtype_from_name,
    dtype_name,
    iter_weight_chunks,
    tensor_from_proto,
    tensor_to_proto,
)

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values that exercise every byte of the dtype: negatives, fractions, extremes of the range."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


def _assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    # Bitwise equality: NaNs and signed zeros must survive too, which torch.equal would not show.
    assert _bytes_of(actual) == _bytes_of(expected)


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (0,), (2, 0, 3)], ids=str)
def test_tensor_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = _sample(dtype, shape)
    message = tensor_to_proto(tensor)
    assert message.dtype == str(dtype).removeprefix("torch.")
    assert list(message.shape) == list(shape)
    assert len(message.data) == tensor.numel() * dtype.itemsize
    # The bytes go through serialization, as on the wire.
    decoded = tensor_from_proto(common_pb2.Tensor.FromString(message.SerializeToString()))
    _assert_identical(decoded, tensor)


def test_bfloat16_is_sent_raw_little_endian() -> None:
    # bf16 1.0 is 0x3F80; little-endian puts the low byte first.
    message = tensor_to_proto(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert message.data == bytes([0x80, 0x3F, 0x00, 0xC0])


def test_special_float_values_survive() -> None:
    tensor = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=torch.float32)
    _assert_identical(tensor_from_proto(tensor_to_proto(tensor)), tensor)


def test_non_contiguous_input_is_sent_row_major() -> None:
    base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    transposed = base.t()  # [6, 4], not contiguous
    strided = base[:, ::2]  # [4, 3], not contiguous
    for view in (transposed, strided):
        assert not view.is_contiguous()
        decoded = tensor_from_proto(tensor_to_proto(view))
        assert torch.equal(decoded, view)
        assert decoded.is_contiguous()


def test_offset_view_sends_only_its_own_bytes() -> None:
    # A contiguous slice starts inside a larger storage; the bytes before and after it must not leak.
    base = torch.arange(10, dtype=torch.int64)
    message = tensor_to_proto(base[3:5])
    assert torch.equal(tensor_from_proto(message), torch.tensor([3, 4]))


def test_decoded_tensor_is_writable_and_owns_its_memory() -> None:
    message = tensor_to_proto(torch.zeros(4, dtype=torch.float32))
    decoded = tensor_from_proto(message)
    decoded += 1
    # The message's bytes are untouched by the write.
    assert torch.equal(tensor_from_proto(message), torch.zeros(4))


def test_wrong_byte_count_names_dtype_and_shape() -> None:
    message = common_pb2.Tensor(dtype="float16", shape=[2, 3], data=b"\x00" * 11)
    with pytest.raises(ValueError, match=r"float16.*\[2, 3\].*12 bytes, got 11"):
        tensor_from_proto(message)


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="complex64"):
        tensor_from_proto(common_pb2.Tensor(dtype="complex64", shape=[1], data=b"\x00" * 8))
    with pytest.raises(ValueError, match="complex64"):
        tensor_to_proto(torch.zeros(1, dtype=torch.complex64))


def test_negative_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        tensor_from_proto(common_pb2.Tensor(dtype="int8", shape=[-1, -2], data=b"\x00\x00"))


def test_dtype_names_round_trip() -> None:
    for dtype in DTYPES:
        assert dtype_from_name(dtype_name(dtype)) == dtype


def test_default_chunk_fits_grpc_default_limit() -> None:
    tensor = torch.zeros(DEFAULT_CHUNK_BYTES // 2 + 5, dtype=torch.bfloat16)
    chunks = list(iter_weight_chunks("lm_head", tensor))
    assert len(chunks) == 2
    assert max(chunk.ByteSize() for chunk in chunks) < 4 * 1024 * 1024


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000])
def test_weight_chunks_round_trip(chunk_bytes: int) -> None:
    # A vocabulary that is not a multiple of 64, and a row size that chunks of 7 bytes cut mid-element.
    tensor = _sample(torch.bfloat16, (131, 6), seed=1)  # [vocab, hidden]
    total_bytes = tensor.numel() * 2
    chunks = list(iter_weight_chunks("embed_tokens", tensor, chunk_bytes=chunk_bytes))

    assert len(chunks) == -(-total_bytes // chunk_bytes)
    assert [chunk.offset for chunk in chunks] == list(range(0, total_bytes, chunk_bytes))
    for chunk in chunks:
        assert (chunk.name, chunk.dtype, list(chunk.shape), chunk.total_bytes) == (
            "embed_tokens",
            "bfloat16",
            [131, 6],
            total_bytes,
        )
        assert 0 < len(chunk.data) <= chunk_bytes
    assert all(chunk.sha256 == "" for chunk in chunks[:-1])
    assert chunks[-1].sha256 == hashlib.sha256(_bytes_of(tensor)).hexdigest()

    progress: list[tuple[str, int, int]] = []
    assembler = WeightAssembler(progress=lambda name, received, total: progress.append((name, received, total)))
    results = [assembler.add(target_pb2.WeightChunk.FromString(chunk.SerializeToString())) for chunk in chunks]
    assembler.finish()

    assert all(result is None for result in results[:-1])
    final = results[-1]
    assert final is not None
    assert (final.name, final.shard) == ("embed_tokens", ShardOf())
    _assert_identical(final.tensor, tensor)
    expected_received = [min(offset + chunk_bytes, total_bytes) for offset in range(0, total_bytes, chunk_bytes)]
    assert progress == [("embed_tokens", received, total_bytes) for received in expected_received]


def test_empty_tensor_is_one_chunk() -> None:
    tensor = torch.empty(0, 16, dtype=torch.float16)
    chunks = list(iter_weight_chunks("empty", tensor, chunk_bytes=7))
    assert len(chunks) == 1
    assert (chunks[0].offset, chunks[0].total_bytes, chunks[0].data) == (0, 0, b"")
    assert chunks[0].sha256 == hashlib.sha256(b"").hexdigest()
    result = WeightAssembler().add(chunks[0])
    assert result is not None
    _assert_identical(result.tensor, tensor)


def test_interleaved_tensors_assemble_independently() -> None:
    first = _sample(torch.float32, (5, 3), seed=2)
    second = _sample(torch.int64, (4,), seed=3)
    first_chunks = list(iter_weight_chunks("first", first, chunk_bytes=16))
    second_chunks = list(iter_weight_chunks("second", second, chunk_bytes=16))
    assembler = WeightAssembler()
    finished = {}
    for index in range(max(len(first_chunks), len(second_chunks))):
        for chunks in (first_chunks, second_chunks):
            if index < len(chunks) and (result := assembler.add(chunks[index])) is not None:
                finished[result.name] = result.tensor
    assembler.finish()
    _assert_identical(finished["first"], first)
    _assert_identical(finished["second"], second)


def _chunks(chunk_bytes: int = 7) -> list[target_pb2.WeightChunk]:
    return list(iter_weight_chunks("lm_head", _sample(torch.float16, (9, 3), seed=4), chunk_bytes=chunk_bytes))


def test_flipped_byte_is_a_sha256_mismatch() -> None:
    chunks = _chunks()
    corrupted = bytearray(chunks[1].data)
    corrupted[3] ^= 0x01
    chunks[1].data = bytes(corrupted)
    assembler = WeightAssembler()
    for chunk in chunks[:-1]:
        assert assembler.add(chunk) is None
    with pytest.raises(ValueError, match=r"'lm_head'.*sha256"):
        assembler.add(chunks[-1])


def test_missing_last_chunk_fails_finish() -> None:
    chunks = _chunks()
    assembler = WeightAssembler()
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    total_bytes = chunks[0].total_bytes
    with pytest.raises(ValueError, match=rf"'lm_head' \({total_bytes - len(chunks[-1].data)} of {total_bytes} bytes\)"):
        assembler.finish()


def test_missing_middle_chunk_is_a_gap() -> None:
    chunks = _chunks()
    assembler = WeightAssembler()
    assembler.add(chunks[0])
    with pytest.raises(ValueError, match=r"offset 14 but 7 bytes received \(gap\)"):
        assembler.add(chunks[2])


def test_repeated_chunk_is_an_overlap() -> None:
    chunks = _chunks()
    assembler = WeightAssembler()
    assembler.add(chunks[0])
    assembler.add(chunks[1])
    with pytest.raises(ValueError, match=r"offset 7 but 14 bytes received \(overlap\)"):
        assembler.add(chunks[1])


def test_first_chunk_must_start_at_zero() -> None:
    with pytest.raises(ValueError, match=r"offset 7 but 0 bytes received \(gap\)"):
        WeightAssembler().add(_chunks()[1])


def test_header_change_mid_tensor_is_refused() -> None:
    chunks = _chunks()
    assembler = WeightAssembler()
    assembler.add(chunks[0])
    changed = target_pb2.WeightChunk()
    changed.CopyFrom(chunks[1])
    changed.dtype = "bfloat16"
    with pytest.raises(ValueError, match=r"changed mid-stream.*float16.*bfloat16"):
        assembler.add(changed)
    changed.dtype = "float16"
    changed.shape[:] = [3, 9]
    with pytest.raises(ValueError, match=r"changed mid-stream.*\[9, 3\].*\[3, 9\]"):
        assembler.add(changed)


def test_more_bytes_than_total_is_refused() -> None:
    chunks = _chunks()
    assembler = WeightAssembler()
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    oversized = target_pb2.WeightChunk()
    oversized.CopyFrom(chunks[-1])
    oversized.data = chunks[-1].data + b"\x00"
    with pytest.raises(ValueError, match="overruns total_bytes 54"):
        assembler.add(oversized)


def test_total_bytes_must_match_dtype_and_shape() -> None:
    chunk = _chunks()[0]
    chunk.total_bytes = 50
    with pytest.raises(ValueError, match=r"float16 and shape \[9, 3\] need 54 bytes.*total_bytes 50"):
        WeightAssembler().add(chunk)


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        next(iter_weight_chunks("x", torch.zeros(3), chunk_bytes=0))


# --- gRPC plumbing on a real in-process server over loopback -------------------------------------------------

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
ECHO_METHOD = "/tandem.test.Echo/Echo"


def _echo_handler() -> grpc.GenericRpcHandler:
    """A raw-bytes echo method, to send messages larger than gRPC's 4 MiB default through the options."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    return grpc.method_handlers_generic_handler("tandem.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})


async def _list_services(channel: grpc.aio.Channel) -> list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [response async for response in stub.ServerReflectionInfo(iter([request]))]
    assert len(responses) == 1
    return [service.name for service in responses[0].list_services_response.service]


def test_server_health_reflection_and_large_messages() -> None:
    async def scenario() -> None:
        server = create_server()
        server.add_generic_rpc_handlers([_echo_handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        health_servicer = await add_standard_services(server, [SERVICE_NAME])
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            await wait_for_ready(address, timeout_s=10, open_channel=Insecure().aio_channel, service=SERVICE_NAME)
            async with grpc.aio.insecure_channel(address, options=channel_options()) as channel:
                health_stub = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    response = await health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    assert response.status == health_pb2.HealthCheckResponse.SERVING

                services = await _list_services(channel)
                assert SERVICE_NAME in services
                assert "grpc.health.v1.Health" in services
                assert "grpc.reflection.v1alpha.ServerReflection" in services

                payload = bytes(range(256)) * (6 * 1024 * 1024 // 256)  # 6 MiB, over the 4 MiB default
                assert len(payload) < MAX_MESSAGE_BYTES
                assert await channel.unary_unary(ECHO_METHOD)(payload, timeout=10) == payload

            await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            with pytest.raises(TimeoutError, match=rf"127\.0\.0\.1:{port}.*{SERVICE_NAME}.*NOT_SERVING"):
                await wait_for_ready(address, timeout_s=0.3, open_channel=Insecure().aio_channel, service=SERVICE_NAME)
        finally:
            await server.stop(grace=None)

    asyncio.run(scenario())


def test_wait_for_ready_waits_for_a_late_server() -> None:
    async def scenario() -> None:
        # Reserve a free port, then start the real server on it only after the wait has begun.
        probe = create_server()
        port = probe.add_insecure_port("127.0.0.1:0")
        await probe.start()
        await probe.stop(grace=None)
        address = f"127.0.0.1:{port}"

        server = create_server()
        assert server.add_insecure_port(address) == port
        await add_standard_services(server, [SERVICE_NAME])

        async def start_later() -> None:
            await asyncio.sleep(0.3)
            await server.start()

        starter = asyncio.create_task(start_later())
        try:
            await wait_for_ready(address, timeout_s=10, open_channel=Insecure().aio_channel, service=SERVICE_NAME)
            assert starter.done()
        finally:
            await starter
            await server.stop(grace=None)

    asyncio.run(scenario())


def test_wait_for_ready_times_out_naming_the_address() -> None:
    async def scenario() -> None:
        probe = create_server()
        port = probe.add_insecure_port("127.0.0.1:0")
        await probe.start()
        await probe.stop(grace=None)
        with pytest.raises(TimeoutError, match=rf"127\.0\.0\.1:{port}"):
            await wait_for_ready(f"127.0.0.1:{port}", timeout_s=0.3, open_channel=Insecure().aio_channel)

    asyncio.run(scenario())


def test_shards_of_one_table_assemble_independently() -> None:
    shards = [_sample(torch.bfloat16, (3, 4), seed=rank) for rank in range(2)]
    streams = [
        list(iter_weight_chunks("lm_head", shard, chunk_bytes=10, shard=ShardOf(rank, 2, 5)))
        for rank, shard in enumerate(shards)
    ]
    assembler = WeightAssembler()
    finished = []
    for first, second in zip(*streams, strict=True):  # interleaved chunk by chunk
        finished += [result for chunk in (first, second) if (result := assembler.add(chunk)) is not None]
    assembler.finish()
    assert [(result.name, result.shard) for result in finished] == [
        ("lm_head", ShardOf(0, 2, 5)),
        ("lm_head", ShardOf(1, 2, 5)),
    ]
    for result, shard in zip(finished, shards, strict=True):
        _assert_identical(result.tensor, shard)


def test_corrupted_shard_is_named_with_its_rank() -> None:
    chunks = list(iter_weight_chunks("embed_tokens", _sample(torch.float32, (3, 2), seed=5), 8, ShardOf(1, 2, 5)))
    chunks[0].data = bytes(len(chunks[0].data))
    assembler = WeightAssembler()
    for chunk in chunks[:-1]:
        assembler.add(chunk)
    with pytest.raises(ValueError, match=r"'embed_tokens shard 1 of 2'.*sha256"):
        assembler.add(chunks[-1])
