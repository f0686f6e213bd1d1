"""The chain's own XXH3-64 (kvplane/core/_xxh3.h): xxHash's published test vectors, and
the xxhash package (the reference library) at every length through three blocks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvplane.core._chain import chain, xxh3_64

# xxHash's sanity buffer: byte i is the top byte of PRIME32 * PRIME64**i (mod 2**64).
_PRIME32 = 2654435761
_PRIME64 = 11400714785074694797


def _sanity_buffer(length: int) -> bytes:
    out = bytearray()
    generator = _PRIME32
    for _ in range(length):
        out.append(generator >> 56)
        generator = (generator * _PRIME64) % 2**64
    return bytes(out)


# xxHash's own test vectors for XXH3_64bits with seed 0 (cli/xsum_sanity_check.c): one
# length in every path of the algorithm, and the block boundaries of the long one.
PUBLISHED = {
    0: 0x2D06800538D394C2,
    1: 0xC44BDFF4074EECDB,
    6: 0x27B56A84CD2D7325,
    12: 0xA713DAF0DFBB77E7,
    24: 0xA3FE70BF9D3510EB,
    48: 0x397DA259ECBA1F11,
    80: 0xBCDEFBBB2C47C90A,
    195: 0xCD94217EE362EC3A,
    403: 0xCDEB804D65C6DEA4,
    512: 0x617E49599013CB6B,
    2048: 0xDD59E2C3A5F038E0,
    2099: 0xC6B9D9B3FC9AC765,
    2240: 0x6E73A90539CF2948,
    2367: 0xCB37AEB9E5D361ED,
}
SANITY = _sanity_buffer(max(PUBLISHED) + 1024)


@pytest.mark.parametrize(("length", "expected"), PUBLISHED.items())
def test_published_vectors(length: int, expected: int) -> None:
    assert xxh3_64(SANITY[:length]) == expected


def test_every_length_through_three_blocks_agrees_with_the_reference_library() -> None:
    for length in range(len(SANITY) + 1):
        assert xxh3_64(SANITY[:length]) == xxh3_64_intdigest(SANITY[:length]), length


@settings(max_examples=300)
@given(st.binary(max_size=5000))
def test_any_bytes_agree_with_the_reference_library(data: bytes) -> None:
    assert xxh3_64(data) == xxh3_64_intdigest(data)


@given(
    parent=st.integers(0, 2**64 - 1),
    block_size=st.integers(1, 300),
    data=st.binary(max_size=4 * 300 * 3),
)
def test_the_chain_hashes_its_parent_and_each_block_as_the_reference_would(
    parent: int, block_size: int, data: bytes
) -> None:
    stride = 4 * block_size
    expected, previous = [], parent
    for start in range(0, len(data) - stride + 1, stride):
        previous = xxh3_64_intdigest(previous.to_bytes(8, "little") + data[start : start + stride])
        expected.append(previous)
    assert chain(parent, data, block_size) == expected


def test_any_buffer_is_read() -> None:
    data = SANITY[:100]
    assert xxh3_64(bytearray(data)) == xxh3_64(memoryview(data)) == xxh3_64(data)
    with pytest.raises(TypeError):
        xxh3_64("text")  # type: ignore[arg-type]
