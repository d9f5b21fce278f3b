"""Which HF models moepage can page: ``check_supported``, and the ``diagnosis`` ``moepage.wrap`` asks when it finds no
experts module to page (registered with the runners, ``integrations.transformers.runners``)."""

from __future__ import annotations

from torch import nn

from ...errors import ConfigError
from ...nn.find import check_module, dense_experts, dense_reason, find_experts, stack_problem

_PAGED_SHAPE = "gate_up_proj [E, 2I, H] + down_proj [E, H, I] (or up_proj + down_proj)"


def _describe(module: nn.Module) -> str:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        kinds = sorted({type(m).__name__ for m in module.children()})
        return f"a {type(module).__name__} of {len(module)} {'/'.join(kinds) or 'modules'} (one module per expert)"
    shapes = ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters(recurse=True)) or "no parameters"
    return f"{type(module).__name__} with {shapes}"


def _problems(model: nn.Module) -> tuple[list[str], list[str], str]:
    """The routed experts modules moepage pages in ``model``, what it cannot page, and how to name the model."""
    routed = dict(find_experts(model))
    dense = dict(dense_experts(model))  # shared experts beside routed ones are ordinary modules
    stacked = {**routed, **dense}
    problems = [] if routed else [f"{qual}: {dense_reason(module)}" for qual, module in dense.items()]
    problems += [f"{qual}: {type(module).__name__}: {why}" for qual, module in routed.items()
                 if (why := stack_problem(module))]
    for qual, module in model.named_modules():
        if qual in stacked:
            continue
        if qual.rpartition(".")[2] == "experts" and not any(qual.startswith(s + ".") for s in stacked if s):
            parent = model.get_submodule(qual.rpartition(".")[0]) if "." in qual else model
            problems.append(
                f"{qual}: the MoE block {type(parent).__name__} keeps its routed experts as {_describe(module)}; "
                f"moepage pages a stacked HF v5 experts module ({_PAGED_SHAPE}, "
                "forward(hidden_states, top_k_index, top_k_weights)) -- load the model with transformers' own "
                "modeling code (not trust_remote_code) for an architecture that stacks its experts"
            )
    kind = f"{type(model).__name__} (model_type={getattr(getattr(model, 'config', None), 'model_type', None)!r})"
    return list(routed), problems, kind


def _not_moe(kind: str) -> str:
    return (f"{kind} has no routed experts module ({_PAGED_SHAPE}): it is not a Mixture-of-Experts model, so there "
            "is nothing to page")


def check_supported(model: nn.Module) -> list[str]:
    """Qualified names of the routed experts modules moepage will page in ``model``. Raises ``moepage.ConfigError``
    naming the module classes of every MoE layout moepage cannot page (a ``ModuleList`` of per-expert MLPs, unstacked
    weights, a forward not taking the routing, stacks disagreeing on E), or when the model has no MoE experts.
    Shared experts and dense layers are ordinary modules: never paged, never a problem."""
    check_module("integrations.transformers.check_supported", model)
    names, problems, kind = _problems(model)
    if not names and not problems:
        problems = [_not_moe(kind)]
    if problems:
        raise ConfigError(f"moepage: cannot page {kind}:\n  - " + "\n  - ".join(problems))
    return names


def diagnosis(model: nn.Module) -> str | None:
    """Why a model holds no experts module moepage pages, as Hugging Face's MoE layouts tell it (a layout moepage
    cannot page, or a Hugging Face model that is no MoE); None where it cannot tell."""
    names, problems, kind = _problems(model)
    if not problems and not names and hasattr(getattr(model, "config", None), "model_type"):
        problems = [_not_moe(kind)]
    return "\n  - ".join(problems) or None
