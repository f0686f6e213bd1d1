from array import array

def chain(parent: int, data: bytes | array[int], block_size: int) -> list[int]:
    """The keys of data's full blocks (u32 little-endian tokens) after parent."""
