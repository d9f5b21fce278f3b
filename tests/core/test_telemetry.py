"""Telemetry: per-layer hit rate, misses per step, bytes and time spent paging; device-planned steps
counted on the device and read on demand; the opt-in periodic log line."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

import moepage
from moepage.toy import ToyExperts, ToyMoE


def _routing(t: int, e: int, k: int) -> torch.Tensor:
    return torch.stack([torch.randperm(e)[:k] for _ in range(t)])


def _drive(module, steps: int, tokens: list[int], e: int = 16, k: int = 4) -> None:
    for i in range(steps):
        t = tokens[i % len(tokens)]
        module(torch.randn(t, 32), _routing(t, e, k), torch.rand(t, k))


def test_counters_hit_rate_misses_per_step_and_paging_time():
    torch.manual_seed(0)
    paged = ToyExperts(16, 32, 64, 4)
    moepage.wrap(paged, resident=6)
    _drive(paged, 20, [1, 3, 9])
    s = moepage.stats(paged).total
    layer = next(moepage.paged_layers(paged))
    assert s.steps == 20 and s.misses > 0 and s.hits > 0
    assert s.misses_per_step == s.misses / 20
    assert s.hit_rate == s.hits / (s.hits + s.misses)
    assert s.bytes_paged == s.misses * layer.pager.row_bytes
    assert s.paging_seconds > 0
    d = s.as_dict()
    assert d["misses_per_step"] == s.misses_per_step and d["experts_paged"] == s.misses
    assert "hit rate" in s.line() and "misses/step" in s.line()


def test_device_planned_steps_are_counted_on_the_device_like_host_planned_ones():
    torch.manual_seed(1)
    device_planned = ToyExperts(16, 32, 64, 4)
    host_planned = copy.deepcopy(device_planned)
    moepage.wrap(device_planned, resident=8, device_planner=True)
    moepage.wrap(host_planned, resident=8, device_planner=False)
    layer = next(moepage.paged_layers(device_planned))
    for _ in range(30):
        t = 2  # 2 x 4 = 8 entries = K: every step is device planned
        x, idx, w = torch.randn(t, 32), _routing(t, 16, 4), torch.rand(t, 4)
        assert torch.equal(device_planned(x, idx, w), host_planned(x, idx, w))
    assert layer.pager.counts.steps == 0  # nothing was counted on the host ...
    assert int(layer.pager.device_state.counters[0]) == 30  # ... the device counted every step
    a, b = moepage.stats(device_planned).total, moepage.stats(host_planned).total
    assert (a.steps, a.waves, a.hits, a.misses, a.bytes_paged) == (b.steps, b.waves, b.hits, b.misses, b.bytes_paged)


def test_periodic_log_line_is_opt_in(monkeypatch, caplog):
    torch.manual_seed(2)
    quiet = ToyExperts(16, 32, 64, 4)
    moepage.wrap(quiet, resident=6)
    with caplog.at_level(logging.INFO, logger="moepage"):
        _drive(quiet, 10, [2])
    assert not [r for r in caplog.records if r.name == "moepage"]

    monkeypatch.setenv("MOEPAGE_LOG_EVERY", "4")
    loud = ToyExperts(16, 32, 64, 4)
    moepage.wrap(loud, resident=6, name="loud")
    with caplog.at_level(logging.INFO, logger="moepage"):
        _drive(loud, 10, [2])
    lines = [r.getMessage() for r in caplog.records if r.name == "moepage"]
    assert len(lines) == 2  # steps 4 and 8
    assert lines[0].startswith("layer loud: steps 4,") and "hit rate" in lines[0]


def test_print_stats_is_a_table_with_a_total():
    torch.manual_seed(3)
    model = ToyMoE(vocab=64, hidden=32, inter=16, layers=2, num_experts=16, top_k=4)
    moepage.wrap(model, resident=6)
    for _ in range(3):
        model(torch.randint(0, 64, (12,)))
    stats = moepage.stats(model)
    lines, note = str(stats).splitlines()[:4], "\n".join(str(stats).splitlines()[4:])
    assert lines[0].split() == ["layer", "K", "steps", "waves", "hit", "rate", "misses/step", "prefetched", "MiB",
                                "paged", "ms", "paging"]
    assert [line.split()[0] for line in lines[1:]] == ["blocks.0.experts", "blocks.1.experts", "total"]
    assert len({len(line) for line in lines}) == 1  # aligned
    t = stats.total
    assert lines[-1].split()[1:] == [str(t.num_slots), str(t.steps), str(t.waves), f"{t.hit_rate:.1%}",
                                     f"{t.misses_per_step:.2f}", str(t.prefetched), f"{t.bytes_paged / 2**20:.1f}",
                                     f"{t.paging_seconds * 1e3:.1f}"]
    assert t.steps == 6 and t.waves > t.steps  # 12 tokens x top-4 route more than K=6 experts: several waves
    assert "ms paging: host-planned page-ins only (device-planned gathers are not timed)" in note
    assert "cpu:" not in note and "disk" not in note  # only the columns shown are said


def test_the_table_says_what_every_column_counts_and_no_rate_where_nothing_was_counted():
    """Under the table, every column shown is said (the disk tier's and the CPU's too); a layer that ran no step
    shows no rate ("–"), not a 0.0% hit rate; the host tier's column is a rate and says so."""
    stats = moepage.Stats({"ran": moepage.LayerStats(steps=3, waves=3, hits=4, misses=2, cpu=1, num_slots=2,
                                                     host_hits=1, host_misses=1, disk_bytes=2**20, disk_seconds=0.5),
                           "idle": moepage.LayerStats(num_slots=2)})
    text = str(stats)
    header, ran, idle, total, *note = text.splitlines()
    columns = ["K", "steps", "waves", "hit rate", "misses/step", "cpu", "prefetched", "MiB paged", "ms paging",
               "host hit rate", "MiB disk", "ms disk"]
    assert header.split() == ["layer", *" ".join(columns).split()]
    assert all(f"{c}: " in "\n".join(note) for c in [*columns, "–"])
    assert all(len(line) <= 120 for line in note)
    assert ran.split()[4:6] == ["57.1%", "0.67"] and ran.split()[-3:] == ["50.0%", "1.0", "500.0"]
    assert idle.split()[4:6] == ["–", "–"] and idle.split()[-3] == "–"  # no step: no rate
    assert "0.0%" not in idle and total.split()[4] == "57.1%"


def test_stats_carry_each_layers_k_under_a_split():
    torch.manual_seed(4)
    model = ToyMoE(vocab=64, hidden=32, inter=16, layers=2, num_experts=16, top_k=4)
    moepage.wrap(model, resident={0: 4, 1: 7})
    model(torch.randint(0, 64, (12,)))
    stats = moepage.stats(model)
    assert [s.num_slots for s in stats.values()] == [4, 7] and stats.total.num_slots == 11
    rows = str(stats).splitlines()[1:4]
    assert [row.split()[1] for row in rows] == ["4", "7", "11"]  # the K column, a total of all layers' slots


def test_stats_round_trip_through_json():
    """``json.dumps(moepage.stats(m))`` fails (its values are LayerStats); ``as_dict()`` is plain JSON and
    ``Stats.from_dict`` reads it back equal."""
    torch.manual_seed(5)
    model = ToyMoE(vocab=64, hidden=32, inter=16, layers=2, num_experts=16, top_k=4)
    moepage.wrap(model, resident={0: 5, 1: 6})
    model(torch.randint(0, 64, (12,)))
    stats = moepage.stats(model)
    text = json.dumps(stats.as_dict())
    back = moepage.Stats.from_dict(json.loads(text))
    assert back == stats and back.total == stats.total and back["blocks.1.experts"].num_slots == 6
    assert json.loads(text)["total"]["hit_rate"] == stats.total.hit_rate
    with pytest.raises(TypeError, match=r"Stats.from_dict takes what Stats.as_dict returned"):
        moepage.Stats.from_dict([1, 2])


@pytest.mark.parametrize("call", [moepage.stats, moepage.unwrap])
def test_stats_and_unwrap_of_a_non_module(call):
    for value in (None, "x"):
        with pytest.raises(moepage.ConfigError, match=rf"moepage.{call.__name__}: module must be a torch.nn.Module"
                                                      rf".*got {type(value).__name__}"):
            call(value)


def test_paged_layer_says_what_it_is():
    module = ToyExperts(16, 32, 64, 4)
    moepage.wrap(module, resident=6, name="L7", backend="mock")
    _drive(module, 2, [3])
    layer = next(moepage.paged_layers(module))
    assert repr(layer) == "PagedLayer(L7: K=6 of E=16 experts resident, mock store)"  # reads no device state
