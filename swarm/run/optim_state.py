"""Optimizer state as named tensors (``{parameter name}/{key}``), so it can travel and be checked.

torch keys optimizer state by parameter object; peers only share parameter *names*. Hyperparameters
(``param_groups``) are not sent: every peer builds its optimizer from the same run config.

It lives beside the optimizer it describes (local.py's ``make_optimizer``), below both users: the stage
captures and restores it (swarm/pipeline/stage/worker.py) without knowing how copies are averaged, and averaging
sends it to newcomers (swarm/averaging/params_rpc.py, checked by swarm/averaging/checks.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def optimizer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer,
                      moments: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A float32 CPU copy of the per-parameter optimizer state (empty before the first step); ``moments`` (e.g.
    bfloat16 for a healing snapshot) is the dtype of every state tensor but the step count, which stays exact."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                dtype = torch.float32 if key == "step" else moments
                out[f"{name}/{key}"] = value.detach().to("cpu", dtype, copy=True)
            elif isinstance(value, (int, float)):
                out[f"{name}/{key}"] = torch.tensor(float(value))
    return out


def load_optimizer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer,
                           tensors: Mapping[str, torch.Tensor]) -> None:
    """Replace the optimizer state with ``tensors`` (checked beforehand: averaging/checks.py ``check_optimizer``)."""
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        param, _, key = name.rpartition("/")
        by_param.setdefault(param, {})[key] = tensor
    optimizer.state.clear()
    for name, param in module.named_parameters():
        entries = by_param.get(name)
        if not entries:
            continue
        state = {}
        for key, tensor in entries.items():
            # Adam keeps `step` as a float32 scalar, on the CPU or (fused, capturable) beside the parameter;
            # moments live beside the parameter.
            if key == "step":
                state[key] = tensor.to(param.device if _step_on_device(optimizer) else "cpu", torch.float32).clone()
            else:
                state[key] = tensor.to(param.device, param.dtype).clone()
        optimizer.state[param] = state


def _step_on_device(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
