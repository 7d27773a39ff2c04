"""Boundary codecs: how activations and gradients travel between stages (``training.wire_codec``).

- ``float32``: as they are. ``float16``: hivemind's FLOAT16 compression (half the bytes).
- ``int8``: blockwise absmax int8 as SWARM sends them (Ryabinin et al. 2023): blocks of
  ``INT8_BLOCK`` values, one scale per block; ~1/4 of float32.
- ``lowrank``: the tensor viewed as a matrix (rows: every dimension but the last) is sent as two
  int8 factors ``P (rows x r)`` and ``B (r x cols)`` of rank ``r = training.wire_rank``, found by a
  randomized range finder (2 subspace iterations). Error feedback inside the message: ``B`` is
  fitted to the *quantized* ``P`` (least squares), so the second factor absorbs the first's
  quantization error. There is no error feedback across micro-batches (see docs/ARCHITECTURE.md,
  "Boundary codecs"): rows are samples, different in every micro-batch, so a residual carried to
  the next one would be another sample's error.

A coded tensor travels as one hivemind tensor of dtype uint8 whose bytes are a small header and the
payload (below). It comes from a stranger: ``decode`` checks the header (kind, rank, every
dimension, the decoded size against the caller's byte limit), the exact payload length and every
scale (finite, in range) before it allocates anything, and raises ``CodecError`` otherwise.

Layout (little endian): ``magic "VC" | kind u8 | ndim u8 | param u16 | dims u32 x ndim`` then
int8 payload: ``global scale f32 | block scales f16 x blocks (each in [0, 1], relative to the
global one) | codes i8 x numel``; lowrank: the int8 payload of ``P`` then that of ``B``.
"""

from __future__ import annotations

import math
import struct

import torch

INT8_BLOCK = 256  # values per scale: scales cost 2/256 of a byte per value, 0.8 % over 1/4 of float32
INT8, LOWRANK = 1, 2
MAGIC = b"VC"
_HEAD = struct.Struct("<2sBBH")
MAX_DIMS = 8
MAX_RANK = 4096
SUBSPACE_ITERATIONS = 2
_F32_MAX = torch.finfo(torch.float32).max
_SEED = 0x5EED


class CodecError(ValueError):
    """A coded payload that must be rejected; the text says what was wrong."""


# ----- int8 blockwise
def int8_size(numel: int) -> int:
    return 4 + 2 * math.ceil(numel / INT8_BLOCK) + numel


def int8_pack(values: torch.Tensor) -> bytes:
    flat = values.detach().reshape(-1).float()
    peak = float(flat.abs().max()) if flat.numel() else 0.0
    pad = (-flat.numel()) % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    ratio = (absmax / peak).half() if peak > 0 else torch.zeros_like(absmax).half()
    scale = ratio.float() * (peak / 127.0)  # the scale the receiver will compute, rounding included
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[: flat.numel()]
    return struct.pack("<f", peak / 127.0) + ratio.numpy().tobytes() + codes.numpy().tobytes()


def int8_unpack(buf: memoryview, numel: int) -> torch.Tensor:
    """Values from an int8 payload of exactly ``int8_size(numel)`` bytes (checked by the caller)."""
    blocks = math.ceil(numel / INT8_BLOCK)
    (unit,) = struct.unpack_from("<f", buf, 0)
    if not math.isfinite(unit) or unit < 0 or unit * 128 > _F32_MAX:
        raise CodecError(f"int8 scale {unit!r} is not a finite non-negative number in range")
    ratio = torch.frombuffer(bytearray(buf[4 : 4 + 2 * blocks]), dtype=torch.float16).float()
    if not bool(torch.isfinite(ratio).all()) or bool((ratio < 0).any()) or bool((ratio > 1).any()):
        raise CodecError("int8 block scales must be finite and within [0, 1]")
    codes = torch.frombuffer(bytearray(buf[4 + 2 * blocks :]), dtype=torch.int8).float()
    pad = (-numel) % INT8_BLOCK
    blocks_view = torch.nn.functional.pad(codes, (0, pad)).view(-1, INT8_BLOCK)
    return (blocks_view * (ratio * unit)[:, None]).reshape(-1)[:numel]


# ----- low rank
def low_rank_factors(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``P`` (rows x rank, orthonormal columns) spanning most of ``matrix``'s range: a randomized range
    finder with a private generator, so coding never draws from the run's global random stream."""
    generator = torch.Generator().manual_seed(_SEED)
    probe = torch.randn(matrix.shape[1], rank, generator=generator)
    basis = torch.linalg.qr(matrix @ probe).Q
    for _ in range(SUBSPACE_ITERATIONS):
        basis = torch.linalg.qr(matrix @ (matrix.T @ basis)).Q
    return basis, basis.T @ matrix


def lowrank_pays(rows: int, cols: int, rank: int) -> bool:
    return rank * (rows + cols) < rows * cols


def lowrank_pack(matrix: torch.Tensor, rank: int) -> bytes:
    basis, _ = low_rank_factors(matrix, rank)
    p_bytes = int8_pack(basis)
    p_coded = int8_unpack(memoryview(p_bytes), basis.numel()).view_as(basis)
    coeffs = torch.linalg.lstsq(p_coded, matrix).solution  # B fitted to the quantized P: error feedback
    return p_bytes + int8_pack(coeffs)


# ----- the framed tensor
def encode(tensor: torch.Tensor, codec: str, rank: int) -> bytes:
    """A float tensor as a framed ``int8`` or ``lowrank`` payload (lowrank falls back to int8 where a rank
    of ``rank`` would not be smaller, e.g. a 1-D tensor)."""
    values = tensor.detach().float().cpu()
    dims = list(values.shape)
    if not 1 <= len(dims) <= MAX_DIMS:
        raise ValueError(f"a coded tensor has 1..{MAX_DIMS} dimensions, not {len(dims)}")
    if codec == "lowrank" and len(dims) >= 2:
        cols = dims[-1]
        rows = values.numel() // max(cols, 1)
        rank = min(rank, rows, cols, MAX_RANK)
        if rank >= 1 and lowrank_pays(rows, cols, rank):
            body = lowrank_pack(values.reshape(rows, cols), rank)
            return _header(LOWRANK, dims, rank) + body
    if codec not in ("int8", "lowrank"):
        raise ValueError(f"codec {codec!r} is not framed (int8 or lowrank)")
    return _header(INT8, dims, INT8_BLOCK) + int8_pack(values)


def _header(kind: int, dims: list[int], param: int) -> bytes:
    return _HEAD.pack(MAGIC, kind, len(dims), param) + struct.pack(f"<{len(dims)}I", *dims)


def decoded_numel(buf: bytes | memoryview) -> int:
    """The number of values a payload declares, from its header alone (for size limits before decoding)."""
    _, _, dims, _ = _parse_header(memoryview(buf))
    return math.prod(dims)


def decode(buf: bytes | memoryview, max_bytes: int) -> torch.Tensor:
    """The float32 tensor of a framed payload from a peer; ``CodecError`` for anything malformed or over
    ``max_bytes`` once decoded."""
    view = memoryview(buf)
    kind, param, dims, offset = _parse_header(view)
    numel = math.prod(dims)
    if numel * 4 > max_bytes:
        raise CodecError(f"decodes to {numel * 4} bytes, over the {max_bytes} this stage accepts")
    body = view[offset:]
    if kind == INT8:
        if param != INT8_BLOCK:
            raise CodecError(f"int8 block of {param}, expected {INT8_BLOCK}")
        _expect_length(body, int8_size(numel))
        return int8_unpack(body, numel).view(dims)
    return _decode_lowrank(body, dims, param)


def _decode_lowrank(body: memoryview, dims: list[int], rank: int) -> torch.Tensor:
    if len(dims) < 2:
        raise CodecError("a low-rank payload needs at least 2 dimensions")
    cols = dims[-1]
    rows = math.prod(dims) // cols if cols else 0
    if not 1 <= rank <= min(rows, cols, MAX_RANK) or not lowrank_pays(rows, cols, rank):
        raise CodecError(f"rank {rank} is not within 1..{min(rows, cols, MAX_RANK)} for a {rows}x{cols} matrix")
    p_size = int8_size(rows * rank)
    _expect_length(body, p_size + int8_size(rank * cols))
    basis = int8_unpack(body[:p_size], rows * rank).view(rows, rank)
    coeffs = int8_unpack(body[p_size:], rank * cols).view(rank, cols)
    return (basis @ coeffs).view(dims)


def _parse_header(view: memoryview) -> tuple[int, int, list[int], int]:
    if len(view) < _HEAD.size:
        raise CodecError("coded payload shorter than its header")
    magic, kind, ndim, param = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or kind not in (INT8, LOWRANK):
        raise CodecError("not a coded tensor (bad magic or kind)")
    if not 1 <= ndim <= MAX_DIMS or len(view) < _HEAD.size + 4 * ndim:
        raise CodecError(f"coded tensor with {ndim} dimensions (1..{MAX_DIMS}) or a truncated header")
    dims = list(struct.unpack_from(f"<{ndim}I", view, _HEAD.size))
    if any(d == 0 for d in dims):
        raise CodecError("coded tensor with an empty dimension")
    return kind, param, dims, _HEAD.size + 4 * ndim


def _expect_length(body: memoryview, want: int) -> None:
    if len(body) != want:
        raise CodecError(f"payload of {len(body)} bytes, its header says {want}")
