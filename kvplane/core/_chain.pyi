from array import array

def chain(parent: int, data: bytes | array[int], block_size: int) -> list[int]:
    """The keys of data's full blocks (u32 little-endian tokens) after parent."""

def xxh3_64(data: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of data with the default secret and seed 0 (what chain() hashes with)."""
