"""Choosing the torch device and thread count for this machine."""

from __future__ import annotations


def resolve_device(requested: str) -> str:
    """``auto`` means the first GPU if torch sees one, else the CPU. Call after the DHT has forked."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} was asked for but torch sees no CUDA GPU; use --device cpu or auto")
    if requested.startswith("cuda:"):
        count = torch.cuda.device_count()
        number = requested.split(":", 1)[1]
        if not number.isdigit() or int(number) >= count:
            raise ValueError(f"device {requested!r}: torch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return requested


def describe_device(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        return f"{device} ({torch.cuda.get_device_name(index)})"
    return "cpu"


def gpu_memory_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.memory_allocated(torch.device(device)))


def set_threads(max_cpu_threads: int) -> int:
    """One torch thread per stage process by default: several volunteers may share the machine."""
    import torch

    threads = max_cpu_threads if max_cpu_threads > 0 else 1
    torch.set_num_threads(threads)
    return threads
