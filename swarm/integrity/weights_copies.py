"""The copies a stage commits to (swarm/integrity/weights.py): their digest, dtype and bytes, and how they are made."""

from __future__ import annotations

import torch

from swarm.integrity.receipts import DIGEST_BYTES, hash_threads

COMMIT_DTYPE: torch.dtype | None = None  # exact (weights.py's docstring: why not bfloat16)


def weights_digest(tensors: dict[str, torch.Tensor]) -> bytes:
    """BLAKE3 over every tensor's name, dtype, shape and bytes, in name order: the same weights give the same digest on
    any machine and any device (the bytes are taken on the CPU). Weights of PARALLEL_HASH_BYTES or more are hashed on
    every core (BLAKE3's tree makes the digest the same): a version is hashed under the stage's lock, with the compute
    thread waiting on it."""
    import blake3

    total = sum(t.numel() * t.element_size() for t in tensors.values())
    h = blake3.blake3(max_threads=hash_threads(total))
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        h.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        flat = tensor.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())
    return h.digest(DIGEST_BYTES)


def committed_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a tensor is committed (hashed, kept, shown) in: its own, unless COMMIT_DTYPE rounds floating ones."""
    return COMMIT_DTYPE if COMMIT_DTYPE is not None and tensor.is_floating_point() else tensor.dtype


def committed_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of one committed copy of ``tensors`` (a version in the ring)."""
    return sum(t.numel() * committed_dtype(t).itemsize for t in tensors.values())


def committed_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` as a commit holds them (a copy on the CPU, in ``committed_dtype``)."""
    return {name: t.detach().to("cpu", committed_dtype(t), copy=True) for name, t in tensors.items()}


def tensors_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def stays_live(state: dict[str, torch.Tensor]) -> bool:
    """Whether a ring keeps this module's current version as its live weights (on the CPU, committed as they are)."""
    return all(t.device.type == "cpu" and committed_dtype(t) == t.dtype for t in state.values())


def copy_to_host(out: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` copied into ``out``; from a GPU every copy is queued first and waited for once (one wait per version,
    not one per tensor: llm-small's stage has 36)."""
    devices = {t.device for t in state.values() if t.is_cuda}
    for name, t in state.items():
        out[name].copy_(t.detach(), non_blocking=t.is_cuda and out[name].is_pinned())
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # the host's bytes are whole before anything hashes them
    return out


def fits(spare: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> bool:
    return spare.keys() == state.keys() and all(
        spare[n].shape == t.shape and spare[n].dtype == committed_dtype(t) for n, t in state.items())
