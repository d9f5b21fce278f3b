"""What a paged experts module does differently as a ``torch.nn.Module``, through hooks ``wrap``
registers and ``unwrap`` removes: ``state_dict()`` gives the E host rows themselves (so
``save_pretrained`` writes the whole model; of coded rows or a disk tier a copy, whose in-place
edits are not followed: said once per model when the copies are handed out), ``load_state_dict()``
fills the host rows (coding them where compressed) and refreshes the resident slots (other shapes
refused), and the forward refuses grad mode where a gradient is expected (moepage computes none).
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import ConfigError
from .layer import PagedLayer


def install(module: torch.nn.Module, layer: PagedLayer) -> list[RemovableHandle]:
    """Register the hooks of paged ``layer`` on its experts ``module``; returns their handles.
    (Module-level functions bound with ``partial``, not closures: pickling a paged model then
    reaches ``PagedLayer``, which refuses it with the reason.)"""
    return [
        module.register_state_dict_post_hook(partial(_state_dict_rows, layer)),
        module.register_load_state_dict_pre_hook(partial(_load_hook, layer)),
        # The module's own loading then copies each slot table onto itself: moepage's write too.
        module.register_load_state_dict_post_hook(partial(_loaded, layer)),
        module.register_forward_pre_hook(partial(_refuse_grad_hook, layer), with_kwargs=True),
    ]


def _state_dict_rows(layer: PagedLayer, module, state_dict, prefix, local_metadata) -> None:
    copies = []
    for name in layer.specs:
        if prefix + name in state_dict:
            state_dict[prefix + name] = layer.store.host_rows(layer.name, name)
            if name in layer.copied:
                copies.append(prefix + name)
    # Said when the copies are handed out, not when one is edited: torch has no read-only tensors, and an entry
    # edited and dropped at once (model.state_dict()[key].mul_(2)) leaves no trace a later check could find.
    if copies and not layer.lifetime.copies_said:
        layer.lifetime.copies_said = True
        warnings.warn(f"moepage: model.state_dict() entries of paged expert rows kept on disk or coded ({copies[0]!r} "
                      "and the like) are copies: an edit written into one in place is not kept. Write edits with "
                      "model.load_state_dict(state), which keeps them (said once per model)", stacklevel=3)


def _load_hook(layer: PagedLayer, module, state_dict, prefix, *rest) -> None:
    _load_rows(module, layer, state_dict, prefix)


def _loaded(layer: PagedLayer, module, incompatible_keys) -> None:
    layer.pager.mark_written()


def _refuse_grad_hook(layer: PagedLayer, module, args, kwargs) -> None:
    if torch.is_grad_enabled():
        _refuse_grad(module, layer, (*args, *kwargs.values()))


def _load_rows(module: torch.nn.Module, layer: PagedLayer, state_dict: dict, prefix: str) -> None:
    """Copy E-row entries into the host rows and the resident experts' slots; leave the module's
    own loading a no-op for them (its entries become the slot parameters themselves)."""
    entries = {n: state_dict[prefix + n] for n in layer.specs if prefix + n in state_dict}
    for name, value in entries.items():
        shape = (layer.num_experts, *layer.specs[name].shape)
        if tuple(value.shape) != shape:
            raise ConfigError(
                f"layer {layer.name}: load_state_dict entry {prefix + name!r} has shape {tuple(value.shape)}; "
                f"the paged parameter holds all {layer.num_experts} experts: {shape} "
                f"(a state_dict of K={layer.num_slots} slot rows is not a checkpoint of this layer)"
            )
    if not entries:
        return
    layer.pager.await_prefetch()
    if layer.device.type == "cuda":
        torch.cuda.synchronize(layer.device)  # no page-in still reads the host rows we overwrite
    try:
        with torch.no_grad():
            for name, value in entries.items():
                layer.store.write_rows(layer.name, name, value)
                state_dict[prefix + name] = module._parameters[name]
    finally:  # a coded tensor may refuse rows its code cannot hold: the slots follow what was written
        layer.pager.refresh_slots()


def _refuse_grad(module: torch.nn.Module, layer: PagedLayer, inputs: tuple[Any, ...]) -> None:
    needs = [n for n in layer.specs if module._parameters[n].requires_grad]
    if needs:
        why = f"its expert parameters {needs} require grad"
    elif any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
        why = "its inputs require grad (a gradient would have to flow through the experts)"
    else:
        return
    raise ConfigError(
        f"layer {layer.name}: moepage computes no gradients, but grad mode is on and {why}; "
        "run the model under torch.no_grad() or torch.inference_mode(), or call "
        "model.requires_grad_(False) (paged experts cannot be trained)"
    )
