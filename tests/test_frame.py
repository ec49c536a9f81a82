"""The wire format: frames round-trip, anything damaged is a FrameError, bodies are packed as documented."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fast.codecs import CODECS, build_codec
from fast.codecs.frame import (
    CODEC_IDS,
    DTYPE_CODES,
    MAGIC,
    MAX_NDIM,
    frame_size,
    header_size,
    pack_frame,
    unpack_frame,
)
from fast.codecs.packing import (
    index_width,
    pack_bits,
    pack_codes,
    pack_indices,
    packed_size,
    unpack_codes,
    unpack_indices,
)
from fast.errors import FrameError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = list(DTYPE_CODES)


def valid_frame(codec_id: int = 0, shape: tuple[int, ...] = (3, 2), body: bytes = b"abcdefghij") -> torch.Tensor:
    return pack_frame(codec_id, torch.float32, shape, torch.tensor(list(body), dtype=torch.uint8))


def reframe(frame: torch.Tensor, edit) -> torch.Tensor:
    """`frame` with `edit` applied to its bytes and the checksum recomputed, so only the edit is wrong."""
    data = bytearray(frame.numpy().tobytes())
    edit(data)
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return torch.tensor(list(data), dtype=torch.uint8)


@settings(max_examples=40, deadline=None)
@given(
    codec_id=st.sampled_from(sorted(CODEC_IDS.values())),
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 2**40), max_size=MAX_NDIM).map(tuple),
    body=st.binary(max_size=300),
)
def test_frame_round_trips(codec_id, dtype, shape, body):
    frame = pack_frame(codec_id, dtype, shape, torch.tensor(list(body), dtype=torch.uint8))
    assert frame.dtype == torch.uint8 and frame.numel() == frame_size(len(shape), len(body))
    assert header_size(len(shape)) % 8 == 0
    for wire in (frame, frame.numpy().tobytes()):
        parts = unpack_frame(wire)
        assert (parts.codec_id, parts.dtype, parts.shape) == (codec_id, dtype, shape)
        assert parts.body.numpy().tobytes() == body


def test_header_layout_is_as_documented():
    frame = valid_frame(codec_id=8, shape=(3, 2), body=b"xyz")
    data = frame.numpy().tobytes()
    assert data[:4] == MAGIC
    assert struct.unpack_from("<BBBB", data, 4) == (1, 8, DTYPE_CODES[torch.float32], 2)
    assert struct.unpack_from("<QQQ", data, 8) == (3, 2, 3)
    assert data[32:35] == b"xyz"
    assert struct.unpack_from("<I", data, 35)[0] == zlib.crc32(data[:35])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.__setitem__(slice(0, 4), b"EVIL"), "bad magic"),
        (lambda d: d.__setitem__(4, 9), "unknown frame version"),
        (lambda d: d.__setitem__(5, 200), "unknown codec id"),
        (lambda d: d.__setitem__(6, 0), "unknown dtype code"),
        (lambda d: d.__setitem__(7, MAX_NDIM + 1), "dimensions"),
        (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 11)), "truncated"),
        (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 9)), "overlong"),
        (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 2**63)), "oversized"),
        (lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 2**63)), "impossible shape"),
    ],
)
def test_inconsistent_header_is_rejected_with_its_reason(edit, message):
    with pytest.raises(FrameError, match=message):
        unpack_frame(reframe(valid_frame(), edit))


def test_checksum_mismatch_oversize_and_wrong_container_are_rejected():
    frame = valid_frame()
    corrupted = frame.clone()
    corrupted[33] ^= 0x10
    with pytest.raises(FrameError, match="checksum"):
        unpack_frame(corrupted)
    with pytest.raises(FrameError, match="oversized"):
        unpack_frame(frame, max_bytes=frame.numel() - 1)
    assert unpack_frame(frame, max_bytes=frame.numel()).shape == (3, 2)
    with pytest.raises(FrameError, match="uint8"):
        unpack_frame(frame.to(torch.int32))
    with pytest.raises(FrameError, match="uint8 tensor or bytes"):
        unpack_frame([1, 2, 3])


@FUZZ
@given(junk=st.binary(max_size=200), keep_magic=st.booleans())
def test_random_bytes_are_rejected(junk, keep_magic):
    if keep_magic:  # get past the magic and version so the rest of the header is exercised
        junk = MAGIC + bytes([1]) + junk
    with pytest.raises(FrameError):
        unpack_frame(junk)


@FUZZ
@given(cut=st.integers(0, 10_000), data=st.data())
def test_truncated_frames_are_rejected(cut, data):
    frame = sample_codec_frame(data)
    with pytest.raises(FrameError):
        unpack_frame(frame[: cut % frame.numel()])


@FUZZ
@given(data=st.data())
def test_bit_flips_are_rejected(data):
    """CRC-32 catches every flip of up to 3 bits in frames this small (under 11 KB): no silent change."""
    frame = sample_codec_frame(data)
    flips = data.draw(st.lists(st.integers(0, frame.numel() * 8 - 1), min_size=1, max_size=3, unique=True))
    damaged = frame.clone()
    for bit in flips:
        damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        build_codec(data.draw(st.sampled_from(CODECS))).decode(damaged)


@FUZZ
@given(extra=st.binary(min_size=1, max_size=20), data=st.data())
def test_trailing_bytes_are_rejected(extra, data):
    frame = sample_codec_frame(data)
    with pytest.raises(FrameError):
        unpack_frame(torch.cat([frame, torch.tensor(list(extra), dtype=torch.uint8)]))


def sample_codec_frame(data) -> torch.Tensor:
    name = data.draw(st.sampled_from(CODECS))
    numel = data.draw(st.integers(1, 600))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    return build_codec(name).encode(x, key="fuzz")


@pytest.mark.parametrize("name", [n for n in CODECS if n != "none"])
def test_a_frame_of_another_codec_is_rejected(name):
    x = torch.randn(40, 10)
    other = "topk" if name != "topk" else "sign"
    with pytest.raises(FrameError, match="configure the same codec"):
        build_codec(name).decode(build_codec(other).encode(x))


@pytest.mark.parametrize("name", CODECS)
def test_a_valid_frame_with_a_wrong_body_length_is_rejected(name):
    """The checksum is right, but the body does not have the length this codec needs for the shape."""
    codec = build_codec(name, **({"value": 0.5} if name == "threshold" else {}))
    frame = codec.encode(torch.randn(40, 10), key="t")
    parts = unpack_frame(frame)
    for body in (parts.body[:-1], torch.cat([parts.body, torch.zeros(8, dtype=torch.uint8)])):
        with pytest.raises(FrameError):
            codec.decode(pack_frame(parts.codec_id, parts.dtype, parts.shape, body))


def test_bodies_with_impossible_contents_are_rejected():
    shape = (300,)
    ones = torch.ones(2, dtype=torch.float32).view(torch.uint8)
    count = torch.tensor([2], dtype=torch.int64).view(torch.uint8)
    out_of_range = torch.tensor([5, 300], dtype=torch.int64).view(torch.uint8).view(-1, 8)[:, :2].reshape(-1)
    sparse = torch.cat([count, ones, out_of_range])
    with pytest.raises(FrameError, match="index beyond"):
        build_codec("threshold").decode(pack_frame(CODEC_IDS["threshold"], torch.float32, shape, sparse))
    with pytest.raises(FrameError, match="elements where 3 were expected"):
        build_codec("topk").decode(pack_frame(CODEC_IDS["topk"], torch.float32, shape, sparse))
    repeated = torch.tensor([7, 7], dtype=torch.int64).view(torch.uint8).view(-1, 8)[:, :2].reshape(-1)
    with pytest.raises(FrameError, match="strictly ascending"):
        build_codec("threshold").decode(
            pack_frame(CODEC_IDS["threshold"], torch.float32, shape, torch.cat([count, ones, repeated]))
        )
    terngrad_body = torch.cat([ones[:4], torch.full((75,), 0b10101010, dtype=torch.uint8)])
    with pytest.raises(FrameError, match="code 2"):
        build_codec("terngrad").decode(pack_frame(CODEC_IDS["terngrad"], torch.float32, shape, terngrad_body))
    qsgd = build_codec("qsgd", levels=5, bucket_size=0)  # 3 level bits hold 6 and 7, which are not levels
    qsgd_body = torch.cat([ones[:4], torch.full((packed_size(300, 4),), 0x77, dtype=torch.uint8)])
    with pytest.raises(FrameError, match="level above"):
        qsgd.decode(pack_frame(CODEC_IDS["qsgd"], torch.float32, shape, qsgd_body))
    with pytest.raises(FrameError, match="never encodes"):
        build_codec("sign").decode(pack_frame(CODEC_IDS["sign"], torch.int32, (8,), torch.zeros(5, dtype=torch.uint8)))


def test_bits_are_packed_lsb_first_eight_to_a_byte():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1, 1], dtype=torch.bool)
    assert pack_bits(bits).tolist() == [0b10000001, 0b00000011]


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 16), data=st.data())
def test_codes_round_trip_in_the_documented_number_of_bytes(width, data):
    codes = data.draw(st.lists(st.integers(0, 2**width - 1), max_size=70))
    packed = pack_codes(torch.tensor(codes, dtype=torch.int64), width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(len(codes), width)
    assert unpack_codes(packed, width, len(codes)).tolist() == codes


def test_packed_size_is_the_bit_planes_formula():
    assert packed_size(10, 1) == 2 and packed_size(10, 2) == 3 and packed_size(10, 8) == 10
    assert packed_size(10, 5) == 5 + 2  # a 4-bit plane and a 1-bit plane
    assert packed_size(10, 9) == 10 + 2
    assert packed_size(8, 3) == 2 + 1


@pytest.mark.parametrize(("numel", "width"), [(1, 1), (256, 1), (257, 2), (65536, 2), (65537, 4), (2**32 + 1, 8)])
def test_indices_use_the_narrowest_integer_that_fits(numel, width):
    assert index_width(numel) == width
    indices = torch.tensor([0, numel - 1, numel // 2], dtype=torch.int64)
    packed = pack_indices(indices, numel)
    assert packed.numel() == 3 * width
    assert torch.equal(unpack_indices(packed, numel, 3), indices)
