"""A transformers experts module's experts on the CPU (``moepage.CpuExpert``, for ``cpu_share``): from the layout its
class declares to transformers' experts implementations (``use_experts_implementation``: ``has_gate``, ``has_bias``,
``is_transposed``, its own ``_apply_gate``), the arithmetic transformers' ``batched_mm`` runs per entry: the gate/up
projection (plus bias), the module's own gate (SwiGLU, gpt-oss's clamped variant) or activation, the down projection
(plus bias). A module that declares no layout is refused for the split, saying why. No transformers import."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F


class LayoutExpert:
    """One expert of ``module`` on the CPU, in its declared layout (a ``CpuExpert``). It reads only the module's
    attributes (its gate function and activation), so a worker thread may call it while the module runs its waves."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.gate, self.bias, self.transposed = bool(module.has_gate), bool(module.has_bias), bool(module.is_transposed)
        self.first = "gate_up_proj" if self.gate else "up_proj"
        self.params = (self.first, "down_proj") + ((f"{self.first}_bias", "down_proj_bias") if self.bias else ())
        weight = module._parameters[self.first]
        self.hidden_size = int(weight.shape[1] if self.transposed else weight.shape[2])
        self.kind = (f"{type(module).__name__}(gate={self.gate}, bias={self.bias}, transposed={self.transposed}, "
                     f"concatenated={getattr(module, 'is_concatenated', True)})")

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x @ weight if self.transposed else F.linear(x, weight)
        return out if bias is None else out + bias

    def __call__(self, x: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        up = rows[self.first]
        x = x.to(up.dtype)
        h = self._linear(x, up, rows.get(f"{self.first}_bias"))
        h = self.module._apply_gate(h) if self.gate else self.module.act_fn(h)
        return self._linear(h, rows["down_proj"], rows.get("down_proj_bias")).float()


def cpu_expert(module: torch.nn.Module) -> LayoutExpert | str | None:
    """The ``CpuExpert`` of a transformers experts module (a str: why its experts cannot run on the CPU; None: not a
    transformers experts module)."""
    if not hasattr(module, "config") or not hasattr(module, "has_gate"):
        return None  # not one transformers' experts implementations serve (``use_experts_implementation``)
    name = type(module).__name__
    if not all(hasattr(module, a) for a in ("has_bias", "is_transposed")):
        return f"{name} declares no complete experts layout (has_gate / has_bias / is_transposed)"
    first = "gate_up_proj" if module.has_gate else "up_proj"
    needed = (first, "down_proj") + ((f"{first}_bias", "down_proj_bias") if module.has_bias else ())
    missing = [p for p in needed if not isinstance(module._parameters.get(p), torch.Tensor)]
    if missing:
        return f"{name} declares its experts layout but lacks {', '.join(missing)}"
    if module.has_gate and not hasattr(module, "_apply_gate"):
        return f"{name} declares a gate but has no _apply_gate"
    if not module.has_gate and not hasattr(module, "act_fn"):
        return f"{name} has no act_fn"
    return LayoutExpert(module)
