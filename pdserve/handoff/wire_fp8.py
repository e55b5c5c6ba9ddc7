"""The FP8 wire format of a hand-off block (`--handoff-wire fp8`): half the bytes of a bf16
pool's block, a quarter of an fp32 one's, for slow links. The sender (the prefill worker's
node, at offer) encodes; any receiver decodes a block whose length is not the raw block's.

One encoded block, little endian:

    offset      bytes   field
    0           4       magic b"PDF8"
    4           1       the pool's dtype (DTYPE_CODES: float32, bfloat16, float16)
    5           3       zero
    8           4       G: scale groups, one per (layer, K|V): num_layers x P
    12          4       S: elements per group, block_size x KV heads x head_dim
    16          4 G     the groups' scales, float32
    16 + 4 G    G S     the values, float8_e4m3fn, group after group

    encoded bytes = 16 + 4 G + G S        (1 byte per element, plus the scales)

A group's scale is its largest magnitude / 448 (e4m3's largest finite value; 1.0 for an
all-zero group), so every value encodes in range. Decoding multiplies back and rounds to the
pool's dtype. Error bound per value x of a group with scale s (fp32 pool, the test's):
|decoded - x| <= |x| / 16 + s / 1024 (e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of a
normal value; below 2^-6 s it is subnormal, with steps of 2^-9 s); a bf16 pool adds its own
rounding (1/256 of the value).
"""

from __future__ import annotations

import struct

import torch

from pdserve.kvstore.memory_tier import BytesLike, as_uint8_tensor

MAGIC = b"PDF8"
HEADER = struct.Struct("<4sB3xII")
HEADER_BYTES = HEADER.size  # 16
FP8_MAX = 448.0
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class WireFormatError(ValueError):
    """A block that says it is FP8-encoded but whose header or length does not add up."""


def encoded_nbytes(num_groups: int, group_size: int) -> int:
    """Bytes of one encoded block of `num_groups` groups of `group_size` elements."""
    return HEADER_BYTES + 4 * num_groups + num_groups * group_size


class Fp8Wire:
    """The encoder of one pool's blocks: their dtype and groups (a KV layout's)."""

    def __init__(self, dtype: torch.dtype, num_groups: int, group_size: int) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"the FP8 hand-off wire encodes float32, bfloat16 or float16 "
                             f"pools, not {dtype} (an FP8 cache moves 1 byte a value already)")
        if num_groups <= 0 or group_size <= 0:
            raise ValueError("an FP8 wire block needs at least one group of one element")
        self.dtype, self.num_groups, self.group_size = dtype, num_groups, group_size
        self.raw_nbytes = num_groups * group_size * dtype.itemsize
        self.nbytes = encoded_nbytes(num_groups, group_size)

    @classmethod
    def for_block_shape(cls, block_shape: list[int], dtype: torch.dtype) -> Fp8Wire:
        """For stored blocks [num_layers, P, block_size, heads, head_dim] of `dtype`."""
        num_layers, num_kv = block_shape[0], block_shape[1]
        group_size = 1
        for size in block_shape[2:]:
            group_size *= size
        return cls(dtype, num_layers * num_kv, group_size)

    def encode(self, block: torch.Tensor) -> torch.Tensor:
        """One raw block (its bytes, uint8, or its values) -> the encoded block, uint8."""
        values = block.reshape(-1).view(torch.uint8).view(self.dtype) \
            if block.dtype == torch.uint8 else block.reshape(-1)
        if values.numel() != self.num_groups * self.group_size:
            raise ValueError(f"a block of {values.numel()} values, expected "
                             f"{self.num_groups} x {self.group_size}")
        groups = values.float().view(self.num_groups, self.group_size)
        scales = groups.abs().amax(dim=1) / FP8_MAX  # [G]
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = (groups / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch.empty(self.nbytes, dtype=torch.uint8)
        out[:HEADER_BYTES] = torch.frombuffer(bytearray(HEADER.pack(
            MAGIC, DTYPE_CODES[self.dtype], self.num_groups, self.group_size)),
            dtype=torch.uint8)
        scale_end = HEADER_BYTES + 4 * self.num_groups
        out[HEADER_BYTES:scale_end] = scales.view(torch.uint8)
        out[scale_end:] = codes.view(torch.uint8).reshape(-1)
        return out


def decode_block(data: BytesLike, raw_nbytes: int) -> torch.Tensor | None:
    """An encoded block back as the raw block's bytes (uint8, `raw_nbytes`); None where
    `data` is not an encoded block (a raw one: its length is `raw_nbytes`, or no magic).
    Raises WireFormatError where the magic is there but the rest does not add up to a block
    of `raw_nbytes`."""
    buf = as_uint8_tensor(data)
    if buf.numel() == raw_nbytes or buf.numel() < HEADER_BYTES:
        return None
    magic, code, num_groups, group_size = HEADER.unpack(bytes(buf[:HEADER_BYTES].numpy()))
    if magic != MAGIC:
        return None
    dtype = DTYPES.get(code)
    if dtype is None:
        raise WireFormatError(f"an FP8 wire block of unknown dtype code {code}")
    if (num_groups * group_size * dtype.itemsize != raw_nbytes
            or buf.numel() != encoded_nbytes(num_groups, group_size)):
        raise WireFormatError(
            f"an FP8 wire block of {num_groups} x {group_size} {dtype} values in "
            f"{buf.numel()} bytes does not stand for a block of {raw_nbytes} bytes")
    scale_end = HEADER_BYTES + 4 * num_groups
    scales = buf[HEADER_BYTES:scale_end].clone().view(torch.float32)  # (aligned copy)
    codes = buf[scale_end:].view(torch.float8_e4m3fn).view(num_groups, group_size)
    values = (codes.float() * scales[:, None]).to(dtype)
    return values.reshape(-1).view(torch.uint8)


def decode_blocks(blocks: list[BytesLike], raw_nbytes: int) -> list[BytesLike]:
    """Each block raw: encoded ones decoded, raw ones as they are. A block that fails to
    decode (WireFormatError) ends the list there: the rest is a miss."""
    decoded: list[BytesLike] = []
    for block in blocks:
        if block is None:
            break
        try:
            raw = decode_block(block, raw_nbytes)
        except WireFormatError:
            break
        decoded.append(block if raw is None else raw)
    return decoded
