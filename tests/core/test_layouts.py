"""``backends.layouts``: the one record of what rows on disk are made from, as ``from_pretrained``, ``wrap`` with
``compress`` and the engines name a kept layout by it. The records are those earlier versions wrote into spill folders'
manifests, key for key and value for value, so a layout kept by an earlier version is still found and adopted."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from moepage.backends import layouts
from moepage.backends.disk import identities
from moepage.backends.protocol import RowSpec
from moepage.errors import ConfigError
from moepage.integrations.auto import RankShare
from moepage.integrations.options import _source
from moepage.integrations.session import DiskTier

SPECS = {"gate_up_proj": RowSpec((4, 2), torch.bfloat16), "down_proj": RowSpec((2, 2), torch.bfloat16)}
ROWS = {"down_proj": [[2, 2], "torch.bfloat16"], "gate_up_proj": [[4, 2], "torch.bfloat16"]}


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / "model-00002.safetensors", tmp_path / "model-00001.safetensors"]
    for i, path in enumerate(paths):
        path.write_bytes(bytes(8 + i))
    return paths


def test_a_loads_record_is_the_one_earlier_versions_kept(files):
    """``from_pretrained``'s: its files and every layer's rows; coded (``wrap`` with ``compress``): the same, coded."""
    record = {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ctime_ns, p.stat().st_ino]
              for p in files}
    raw = layouts.source_of(files=identities(files), rows={"b.experts": SPECS, "a.experts": SPECS})
    assert raw == {"files": record, "rows": {"a.experts": ROWS, "b.experts": ROWS}}
    coded = {**raw, "coded": True}
    assert layouts.source_of(files=raw["files"], rows={"a.experts": SPECS, "b.experts": SPECS}, coded=True) == coded
    assert json.loads(json.dumps(coded)) == coded  # as the manifest keeps it


@pytest.mark.parametrize("share", [RankShare(), RankShare(tp_size=2, moe_tp_size=2, moe_tp_rank=1)])
def test_an_engine_layers_record_is_the_one_earlier_versions_kept(files, share):
    """An engine's: the checkpoint's files, the engine, a rank's share under TP / EP, the layer and its rows, coded."""
    tier = DiskTier("/spill", 0, "lru", _source(files, share, "sglang"))
    got = tier.layer_source("model.layers.3.mlp.experts", SPECS, coded=True)
    want = {"files": identities(files), "engine": "sglang", "layer": "model.layers.3.mlp.experts", "rows": ROWS,
            "coded": True}
    if not share.single:
        want["rank"] = {"tp_size": 2, "moe_tp_size": 2, "ep_size": 1, "moe_tp_rank": 1, "ep_rank": 0}
    assert got == want
    assert "coded" not in tier.layer_source("model.layers.3.mlp.experts", SPECS)
    assert DiskTier("/spill", 0, "lru", _source([], share, "sglang")).layer_source("x", SPECS) is None


class _Kept:
    spill_dir, source = "/spill", None

    def __init__(self, reuses: bool):
        self.reuses, self.kept = reuses, []

    def reuse(self, source: dict) -> bool:
        return self.reuses

    def keep(self, source: dict, layer: str | None = None) -> bool:
        self.kept.append((source, layer))
        return self.reuses


def test_adopting_a_layout_that_went_meanwhile_is_refused_where_it_was_found(caplog):
    with pytest.raises(ConfigError, match="layer x's rows: the layout an earlier load kept in /spill changed while"):
        layouts.adopt(_Kept(False), {"a": 1}, "layer x's rows")
    assert layouts.adopt(_Kept(False), {"a": 1}, "rows", found=False) is False  # not found first: laid out anew
    with caplog.at_level(logging.INFO, logger="moepage"):
        assert layouts.adopt(_Kept(True), {"a": 1}, "rows") is True
        store = _Kept(False)
        assert layouts.keep(store, {"a": 1}, "rows", layer="x") is False and store.kept == [({"a": 1}, "x")]
        assert layouts.keep(store, None, "rows") is False and len(store.kept) == 1  # nothing names it: not kept
    assert [r.getMessage() for r in caplog.records] == [
        "moepage: rows reused as an earlier load kept them in /spill",
        "moepage: another load kept rows in /spill meanwhile; this load's own go with it",
        "moepage: rows written to /spill for this load alone (they go with it)",
    ]
