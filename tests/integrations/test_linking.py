"""``integrations.linking.link_layers``: the one loop both engine plugins run to link their paged layers for
next-layer prefetch (each plugin's own tests drive it through a loaded model)."""

from __future__ import annotations

import types

import pytest
import torch

from moepage.errors import ConfigError
from moepage.integrations.linking import link_layers
from moepage.prefetch import ModuleRouter


def _layers(*settings, experts: int = 8):
    def method(i, setting):
        pager = types.SimpleNamespace(name=f"layer{i}", device_state=None)
        return types.SimpleNamespace(prefetch=setting, link=None, prefetch_linked=False, pager=pager,
                                     global_experts=experts)

    return [(f"model.layers.{i}.experts", torch.nn.Linear(4, experts), method(i, s)) for i, s in enumerate(settings)]


def test_each_layer_links_to_the_next_routed_by_the_next_layers_router_and_rank():
    layers = _layers(True, True, True)
    local_seen = []

    def local(nxt):  # the last layer holds part of the experts: its predictor is wrapped
        local_seen.append(nxt[0])
        return (lambda predict: ("local", predict)) if nxt is layers[2] else None

    made = link_layers(layers, "--prefetch", router=lambda nxt: nxt[1], top_k=lambda nxt: 3, local=local)
    assert made == 2 and local_seen == [layers[1][0], layers[2][0]]
    first, second, last = (m for _, _, m in layers)
    assert first.link.target is second.pager and isinstance(first.link.predictor, ModuleRouter)
    assert first.link.predictor.router is layers[1][1] and first.link.predictor.top == 3
    assert second.link.target is last.pager and second.link.predictor[0] == "local"
    assert second.link.predictor[1].router is layers[2][1]
    assert last.link is None and all(m.prefetch_linked for _, _, m in layers)


def test_a_number_is_the_prediction_width_and_off_links_nothing():
    layers = _layers(2, 2)
    link_layers(layers, "--prefetch", lambda nxt: nxt[1], lambda nxt: pytest.fail("top_k asked"), lambda nxt: None)
    assert layers[0][2].link.predictor.top == 2
    off = _layers(False, False)
    assert link_layers(off, "--prefetch", lambda nxt: nxt[1], lambda nxt: 2, lambda nxt: None) == 0
    assert not any(m.prefetch_linked for _, _, m in off)


def test_layers_built_with_different_settings_are_refused_before_any_link():
    layers = _layers(True, 3)
    with pytest.raises(ConfigError, match=r"--prefetch: the paged layers of one model were built with different"):
        link_layers(layers, "--prefetch", lambda nxt: nxt[1], lambda nxt: 2, lambda nxt: None)
    assert all(m.link is None and not m.prefetch_linked for _, _, m in layers)


def test_a_width_outside_the_experts_is_refused_naming_the_layer():
    with pytest.raises(ConfigError, match="--prefetch: layer layer1 would predict 9 experts per token; need 1..E=8"):
        link_layers(_layers(9, 9), "--prefetch", lambda nxt: nxt[1], lambda nxt: 2, lambda nxt: None)


def test_a_layer_without_a_router_is_refused_by_name_with_where_it_was_looked_for():
    from moepage.integrations.linking import no_router

    method = types.SimpleNamespace(layer_key="model.layers.3.experts", global_experts=8)
    err = no_router("--prefetch", method, "model.layers.3.mlp.experts", "beside it in its block", "Serve with it off")
    assert isinstance(err, ConfigError)
    assert str(err) == ("--prefetch: layer model.layers.3.experts (model.layers.3.mlp.experts): no router to predict "
                        "its experts with; prefetch needs a `gate` with a 2-D weight [E=8, H] beside it in its block. "
                        "Serve with it off")
