"""Choosing the torch device and thread count for this machine."""

from __future__ import annotations

import os
import platform
import re


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


def describe_device(device: str, threads: int | None = None) -> str:
    """What a volunteer recognises: 'NVIDIA GeForce RTX 3060 (cuda:0, 12 GiB)', 'AMD Ryzen 7 5800X (cpu, 1 of
    16 threads)'."""
    import torch

    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        props = torch.cuda.get_device_properties(index)
        return f"{props.name} ({device}, {props.total_memory / 2**30:.0f} GiB)"
    model = cpu_model()
    used = f"{threads} of {os.cpu_count()} threads" if threads else f"{os.cpu_count()} threads"
    return f"{model} (cpu, {used})" if model else f"cpu ({used})"


_CPU_NOISE = re.compile(r"\((R|TM|tm|r)\)|\bCPU\b|@ *[\d.]+ *GHz|\b\d+-Core Processor\b|\bProcessor\b"
                        r"|\bwith Radeon( \w+)? Graphics\b")


def short_cpu_name(raw: str) -> str:
    """'Intel(R) Core(TM) i7-10700K CPU @ 3.80GHz' -> 'Intel Core i7-10700K'; 'AMD Ryzen 7 5800X 8-Core
    Processor' -> 'AMD Ryzen 7 5800X': the part that names the chip, short enough for the dashboard."""
    return " ".join(_CPU_NOISE.sub(" ", raw).split())


def cpu_model() -> str:
    """The CPU's marketing name, or '' when the platform does not say (read from /proc/cpuinfo on Linux,
    sysctl on macOS)."""
    raw = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            raw = next((line.split(":", 1)[1] for line in f if line.startswith("model name")), "")
    except OSError:
        if platform.system() == "Darwin":
            import subprocess

            try:
                raw = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                     timeout=2).stdout
            except (OSError, subprocess.SubprocessError):
                raw = ""
    return short_cpu_name(raw.strip() or platform.processor())


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
