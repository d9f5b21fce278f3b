"""Split steps (``cpu_share``, ``moepage.split``): each step's misses split between page-ins and the CPU. Every routed
entry is computed once (by a wave or by the CPU) and every routed expert counted once (hit, miss or CPU); the CPU's
experts equal a float32 reference within the stated tolerance; the cost model splits nothing where it cannot win (and
the step is then bit-exact); captures and modules without a CPU expert are refused with the reason; an interrupt or a
failed read of a CPU expert's rows leaves the layer intact. Off (the default), nothing changes."""

from __future__ import annotations

import copy
import random
import time

import pytest
import torch

import moepage
from helpers.models import layer_of, make_experts
from moepage import cpu, split
from moepage.bits import same_bits
from moepage.config import parse_cpu_share
from moepage.nn.layer import ModuleWaves
from moepage.split import Costs, choose
from moepage.toy import ToyExperts, ToyMoE

pytestmark = pytest.mark.usefixtures("single_thread")
E, TOP_K, H = 16, 4, 32
# The CPU's experts against float32 arithmetic on the same rows, relative to the largest output (docs/cpu-split.md).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.randn(tokens, H, generator=gen), ids, torch.rand(tokens, TOP_K, generator=gen) + 0.1


def split_experts(share="auto", dtype=torch.float32, implementation="eager", k=4, **wrap):
    module, ref = make_experts(E, H, 16, TOP_K, implementation, dtype)
    moepage.wrap(module, resident=k, backend="torch", cpu_share=share, **wrap)
    return module, ref


def reference32(ref: ToyExperts, x, ids, w) -> torch.Tensor:
    """The unpaged layer in float32 (its rows upcast)."""
    return copy.deepcopy(ref).float()(x.float(), ids, w.float())


# -- on by choice only ------------------------------------------------------------------------------------------------
def test_off_by_default_and_unchanged():
    module, ref = make_experts(E, H, 16, TOP_K)
    moepage.wrap(module, resident=4, backend="torch")
    pager = layer_of(module).pager
    assert moepage.PagingConfig().cpu_share is None and pager.split is None
    for seed in range(3):
        x, ids, w = routing(6, seed)
        assert same_bits(module(x, ids, w), ref(x, ids, w))
    assert moepage.stats(module).total.cpu == 0


@pytest.mark.parametrize("given,read", [(None, None), (False, None), ("off", None), (0, None), (0.0, None),
                                        ("0", None), ("0.0", None), (" 0.00 ", None), (True, "auto"),
                                        ("auto", "auto"), ("on", "auto"), (0.5, 0.5), ("1", 1.0)])
def test_cpu_share_values(given, read):
    assert parse_cpu_share(given) == read


def test_a_zero_share_in_any_spelling_is_off(monkeypatch):
    """0.0, as the argument, the variable or an engine's flag, is off as 0 is: nothing split, nothing refused."""
    for given in (0, 0.0):
        module, _ = make_experts(E, H, 16, TOP_K)
        moepage.wrap(module, resident=4, backend="torch", cpu_share=given)
        assert layer_of(module).pager.split is None
    monkeypatch.setenv("MOEPAGE_CPU_SHARE", "0.0")
    module, _ = make_experts(E, H, 16, TOP_K)
    moepage.wrap(module, resident=4, backend="torch")
    assert layer_of(module).pager.split is None
    from moepage.config import Problems
    from moepage.integrations.vllm.checks import cpu_share  # the engines' flag: the same parser (no vLLM imported)

    problems = Problems()
    assert cpu_share({"cpu_share": "0.0"}, problems) is None and not problems


@pytest.mark.parametrize("bad", [2, -0.5, "half", 1.5, -1e-9, "-0.1"])
def test_a_bad_cpu_share_is_refused_naming_it(bad):
    module, _ = make_experts(E, H, 16, TOP_K)
    with pytest.raises(moepage.ConfigError, match=rf"cpu_share={bad!r} is not off, auto or a share in \(0, 1\]"):
        moepage.wrap(module, resident=4, backend="torch", cpu_share=bad)
    assert getattr(module, "_moepage", None) is None  # nothing was paged


def test_the_variable_turns_it_on_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setenv("MOEPAGE_CPU_SHARE", "0.5")
    module, _ = make_experts(E, H, 16, TOP_K)
    moepage.wrap(module, resident=4, backend="torch")
    assert layer_of(module).pager.split.share == 0.5
    monkeypatch.setenv("MOEPAGE_CPU_SHARE", "most")
    with pytest.raises(moepage.ConfigError, match="MOEPAGE_CPU_SHARE='most' is not off, auto or a share"):
        moepage.wrap(make_experts(E, H, 16, TOP_K)[0], resident=4, backend="torch")


# -- accounting ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_every_entry_is_computed_once_and_every_expert_counted_once(monkeypatch, implementation, share):
    module, _ = split_experts(share, implementation=implementation, k=5)
    layer = layer_of(module)
    module(*routing(2, seed=99))  # its first step checks the runner (a step of its own)
    seen: dict[str, list[torch.Tensor]] = {"waves": [], "cpu": []}
    compute, run = cpu.compute, ModuleWaves.run

    def recording_compute(expert, rows, x, ids, experts, at=None):
        entries, out = compute(expert, rows, x, ids, experts, at)
        seen["cpu"].append(entries)
        return entries, out

    def recording_run(self, wave):
        seen["waves"].append(wave.slots.reshape(-1) >= 0 if not wave.direct else wave.slots.reshape(-1) < 5)
        return run(self, wave)

    monkeypatch.setattr(cpu, "compute", recording_compute)
    monkeypatch.setattr(ModuleWaves, "run", recording_run)
    rng = random.Random(1)
    for step in range(8):
        x, ids, w = routing(rng.choice([1, 2, 3, 9]), seed=step)
        before = layer.pager.read_residency()
        resident = {e for e in ids.unique().tolist() if before.is_resident(e)}
        routed = set(ids.unique().tolist())
        was = copy.copy(layer.pager.counts)
        seen["waves"].clear()
        seen["cpu"].clear()
        module(x, ids, w)
        now = layer.pager.counts
        assert now.hits - was.hits == len(resident)
        assert (now.misses - was.misses) + (now.cpu - was.cpu) == len(routed - resident)  # each miss: paged or CPU
        assert now.cpu - was.cpu == int(len(routed - resident) * share + 0.5)
        count = torch.zeros(ids.numel(), dtype=torch.long)
        for served in seen["waves"]:
            count += served.long()
        for entries in seen["cpu"]:
            count[entries] += 1
        assert count.tolist() == [1] * ids.numel()  # every routed entry exactly once
        after = layer.pager.read_residency()
        cpu_experts = {int(ids.reshape(-1)[i]) for entries in seen["cpu"] for i in entries.tolist()}
        assert not any(after.is_resident(e) for e in cpu_experts)  # computed on the CPU: never made resident
        layer.check_slots()


def test_the_cpu_share_starts_once_the_waves_are_queued(monkeypatch):
    """The CPU's share runs while the device runs what the step queued, not while the driving thread still queues it in
    Python (whose lock every op of the worker takes back as it returns; docs/cpu-split.md)."""
    module, _ = split_experts(0.5, k=5)
    module(*routing(2, seed=99))
    events: list[str] = []
    compute, run = cpu.compute, ModuleWaves.run

    def recording_compute(*args, **kwargs):
        events.append("cpu")
        return compute(*args, **kwargs)

    def slow_run(self, wave):
        time.sleep(0.05)  # a worker started before the waves are queued begins meanwhile
        events.append("wave")
        return run(self, wave)

    monkeypatch.setattr(cpu, "compute", recording_compute)
    monkeypatch.setattr(ModuleWaves, "run", slow_run)
    for step in range(4):
        events.clear()
        module(*routing(6, seed=10 + step))
        assert "cpu" in events and "wave" in events
        assert events.index("cpu") > max(i for i, e in enumerate(events) if e == "wave"), events


# -- the CPU's arithmetic --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_the_cpu_share_equals_a_float32_reference_within_tolerance(dtype, implementation):
    module, ref = split_experts(1.0, dtype, implementation)  # every miss on the CPU
    layer = layer_of(module)
    for seed in range(3):
        x, ids, w = routing(5, seed)
        x, w = x.to(dtype), w.to(dtype)
        want = reference32(ref, x, ids, w)
        got = module(x, ids, w)
        assert got.dtype == dtype
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= TOLERANCE[dtype] * scale
    assert moepage.stats(module).total.cpu > 0
    # The CPU expert alone, on one expert's rows, against float32 arithmetic on the same rows.
    expert = layer.pager.split.expert
    rows = {n: layer.store.read_row(layer.name, n, 9) for n in layer.specs}
    x = torch.randn(7, H).to(dtype)
    gate, up = torch.nn.functional.linear(x.float(), rows["gate_up_proj"].float()).chunk(2, dim=-1)
    want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, rows["down_proj"].float())
    got = expert(x, rows)
    assert got.dtype == torch.float32
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()


def test_a_model_decodes_with_a_cpu_share_close_to_unpaged():
    torch.manual_seed(0)
    model = ToyMoE(vocab=40, hidden=32, inter=16, layers=2, num_experts=E, top_k=TOP_K).eval()
    ref = copy.deepcopy(model)
    moepage.wrap(model, 4, backend="torch", cpu_share=0.5)
    ids = torch.tensor([3, 17, 5, 22, 9])
    got, want = model(ids), ref(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert moepage.stats(model).total.cpu > 0


# -- the cost model --------------------------------------------------------------------------------------------------
PAGE = 1e-3  # seconds to page one expert in


def costs(cpu_per_token: float, cpu_fixed: float = 0.0, step_fixed: float = 0.0) -> Costs:
    tokens = (1, 2, 4, 8, 16, 32, 64, 128)
    return Costs(PAGE, tokens, tuple(cpu_fixed + cpu_per_token * t for t in tokens), step_fixed)


def test_the_cost_model_balances_both_paths():
    misses, tokens = list(range(8)), [1] * 8
    chosen = choose(costs(PAGE / 4), misses, tokens, "auto")  # a single-token expert: a quarter of a page-in
    # n on the CPU: max((8 - n) * PAGE, n * PAGE / 4) is least at n = 7 (1 page against 1.75)
    assert len(chosen) == 7
    assert len(choose(costs(PAGE), misses, tokens, "auto")) == 4  # as fast as the link: half and half


def test_the_cost_model_gives_the_cpu_the_misses_with_fewest_tokens():
    misses = [3, 5, 7, 9]
    tokens = [0] * E
    tokens[3], tokens[5], tokens[7], tokens[9] = 40, 1, 12, 2
    assert choose(costs(PAGE / 8), misses, tokens, "auto")[:2] == [5, 9]
    assert choose(None, misses, tokens, 0.5) == [5, 9]  # a fixed share: the same order, whatever the costs


@pytest.mark.parametrize("case", ["slow CPU", "large batch", "fixed cost", "one miss"])
def test_the_cost_model_splits_nothing_where_it_cannot_win(case):
    misses = list(range(8))
    if case == "slow CPU":  # one expert on the CPU takes longer than paging every miss in
        assert choose(costs(0, cpu_fixed=8 * PAGE), misses, [1] * E, "auto") == []
        assert len(choose(costs(0, cpu_fixed=2 * PAGE), misses, [1] * E, "auto")) == 2  # slower than the link: helps
    elif case == "large batch":  # many tokens per expert: the CPU's time grows, the link's does not
        assert choose(costs(PAGE / 4), misses, [64] * E, "auto") == []
    elif case == "fixed cost":  # a step's fixed cost on the CPU path larger than all page-ins
        assert choose(costs(PAGE / 100, step_fixed=9 * PAGE), misses, [1] * E, "auto") == []
    else:  # one miss: the CPU must beat one page-in by the margin
        assert choose(costs(split.GAIN * PAGE * 1.01), [3], [1] * E, "auto") == []
    assert choose(None, misses, [1] * E, "auto") == []  # not measured: nothing


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_a_step_the_cost_model_does_not_split_is_bit_exact(implementation):
    module, ref = split_experts("auto", implementation=implementation)
    layer_of(module).pager.split.costs = costs(PAGE * 10)  # a slow CPU
    for seed in range(4):
        x, ids, w = routing(3, seed)
        assert same_bits(module(x, ids, w), ref(x, ids, w))
    assert moepage.stats(module).total.cpu == 0


def test_a_cpu_slower_in_steps_than_alone_gets_no_more_shares(monkeypatch):
    """The costs are measured with the CPU alone; where a step's share takes far longer, "auto" learns it from the
    share's own time and pages every miss after."""
    module, _ = split_experts("auto", k=4)
    pager = layer_of(module).pager
    pager.split.costs = costs(PAGE / 100)  # alone, the CPU looks a hundred times faster than the link
    compute = cpu.compute

    def slow_compute(*args, **kwargs):
        time.sleep(0.05)  # inside steps it is not
        return compute(*args, **kwargs)

    monkeypatch.setattr(cpu, "compute", slow_compute)
    module(*routing(3, seed=1))
    assert moepage.stats(module).total.cpu > 0 and pager.split.slowdown > 10
    for seed in range(2, 6):  # each share's time moves the slowdown a step towards what it saw
        module(*routing(3, seed))
    learned = moepage.stats(module).total.cpu
    for seed in range(6, 10):
        module(*routing(3, seed))
    assert moepage.stats(module).total.cpu == learned  # no share since: every miss paged


def test_the_costs_are_measured_once_per_kind_and_shape_at_wrap():
    torch.manual_seed(0)
    model = ToyMoE(vocab=40, hidden=32, inter=16, layers=3, num_experts=E, top_k=TOP_K).eval()
    split._measured.clear()
    moepage.wrap(model, 4, backend="torch", cpu_share="auto")
    measured = [layer.pager.split.costs for layer in moepage.paged_layers(model)]
    assert len(split._measured) == 1 and all(c is measured[0] for c in measured)
    c = measured[0]
    assert c.page_seconds > 0 and len(c.cpu_seconds) == len(c.tokens) and all(s > 0 for s in c.cpu_seconds)
    assert c.expert_seconds(3) >= 0 and c.expert_seconds(1000) >= c.expert_seconds(1)


def test_the_worker_takes_one_node_less_the_driving_cpu():
    nodes = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert cpu.worker_cpus({0, 1, 2, 3, 4, 5, 6, 7}, nodes) == {1, 2, 3}
    assert cpu.worker_cpus({2, 4, 5, 6}, nodes) == {5, 6}  # the node holding most of the allowed CPUs
    assert cpu.worker_cpus({3}, nodes) == {3}
    assert cpu.worker_cpus({0, 1}, {}) == {1}
    assert cpu.parse_cpulist("0-2,5,8-9\n") == {0, 1, 2, 5, 8, 9}


# -- refusals --------------------------------------------------------------------------------------------------------
class ReluExperts(torch.nn.Module):
    """Stacked experts declaring no layout: no CPU expert."""

    def __init__(self):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(E, 8, H))
        self.w_out = torch.nn.Parameter(torch.randn(E, H, 8))

    def forward(self, hidden, top_k_index, top_k_weights):
        return hidden


class SwappedGate(ToyExperts):
    """Declares a gate (``_apply_gate``) other than the one its forward computes."""

    def _apply_gate(self, gate_up):
        up, gate = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _expert(self, x, e):
        gated = ToyExperts._apply_gate(self, torch.nn.functional.linear(x, self.gate_up_proj[e]))
        return torch.nn.functional.linear(gated, self.down_proj[e])


def test_a_module_without_a_cpu_expert_is_refused_with_the_reason():
    module = ReluExperts()
    with pytest.raises(moepage.ConfigError, match="cpu_share: no integration computes ReluExperts's experts on the "
                                                  "CPU"):
        moepage.wrap(module, resident=4, backend="torch", params=["w_in", "w_out"], top_k=2, num_experts=E,
                     cpu_share="auto")
    moepage.wrap(module, resident=4, backend="torch", params=["w_in", "w_out"], top_k=2, num_experts=E)  # off: fine


def test_a_cpu_expert_that_disagrees_with_the_device_is_refused():
    module = SwappedGate(E, H, 16, TOP_K)
    with pytest.raises(moepage.ConfigError, match=r"differ from the device's by .* run without cpu_share"):
        moepage.wrap(module, resident=4, backend="torch", cpu_share=1.0)
    assert getattr(module, "_moepage", None) is None and module.gate_up_proj.shape[0] == E  # rolled back


def test_a_captured_step_is_refused():
    module, _ = split_experts(0.5)
    x, ids, w = routing(2)
    with moepage.capture_mode(), pytest.raises(moepage.ConfigError, match="cpu_share splits each step's misses"):
        module(x, ids, w)


# -- interrupts and faults -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["page-in", "cpu", "join"])
def test_an_interrupt_mid_step_leaves_the_layer_intact(monkeypatch, where):
    module, ref = split_experts(0.5)
    layer = layer_of(module)
    x, ids, w = routing(4, seed=3)
    module(x, ids, w)
    def interrupted(*args):
        raise KeyboardInterrupt

    owner, name = {"page-in": (layer.store, "page_in"), "cpu": (cpu, "compute"), "join": (ModuleWaves, "join")}[where]
    monkeypatch.setattr(owner, name, interrupted)
    was = copy.copy(layer.pager.counts)
    x2, ids2, w2 = routing(6, seed=4)
    with pytest.raises(KeyboardInterrupt):
        module(x2, ids2, w2)
    assert layer.pager.counts.cpu == was.cpu  # nothing of the failed step's CPU share counted
    monkeypatch.undo()
    layer.check_slots()  # the slots hold what the state says
    for seed in range(5, 8):
        x3, ids3, w3 = routing(5, seed)
        got, want = module(x3, ids3, w3), reference32(ref, x3, ids3, w3)
        assert (got - want).abs().max().item() <= TOLERANCE[torch.float32] * want.abs().max().item()
    layer.check_slots()


def test_a_failed_read_of_a_cpu_experts_rows_on_disk_leaves_the_layer_intact(tmp_path, monkeypatch):
    from moepage.backends.tiered import TieredStore

    module, ref = split_experts(1.0, k=4, host_budget=6, spill_dir=tmp_path)
    layer = layer_of(module)
    assert isinstance(layer.store, TieredStore)
    read = TieredStore._read

    def failing(self, layer_name, tensor, expert, out):
        raise OSError(5, "Input/output error")

    module(*routing(3, seed=1))  # warm
    monkeypatch.setattr(TieredStore, "_read", failing)
    was = copy.copy(layer.pager.counts)
    x, ids, w = routing(8, seed=2)  # wide: some CPU experts are on disk only
    with pytest.raises(moepage.PageInError, match="computing .* experts on the CPU failed: .*Input/output error"):
        module(x, ids, w)
    assert layer.pager.counts.cpu == was.cpu
    monkeypatch.setattr(TieredStore, "_read", read)
    layer.check_slots()
    for seed in (2, 3):
        x, ids, w = routing(8, seed)
        got, want = module(x, ids, w), reference32(ref, x, ids, w)
        assert (got - want).abs().max().item() <= TOLERANCE[torch.float32] * want.abs().max().item()
    assert moepage.stats(module).total.cpu > 0


@pytest.mark.parametrize("disk", [False, True])
def test_coded_rows_are_decoded_on_the_cpu_for_its_share(tmp_path, disk):
    module, ref = make_experts(E, 64, 32, TOP_K, dtype=torch.bfloat16)
    tier = dict(host_budget=6, spill_dir=tmp_path) if disk else {}
    moepage.wrap(module, resident=4, backend="torch", compress=True, cpu_share=1.0, **tier)
    layer = layer_of(module)
    assert any(s.code is not None for s in layer.specs.values())
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(6)])
    x, w = torch.randn(6, 64, generator=gen).bfloat16(), torch.rand(6, TOP_K, generator=gen).bfloat16()
    got, want = module(x, ids, w), reference32(ref, x, ids, w)
    assert (got.float() - want).abs().max().item() <= TOLERANCE[torch.bfloat16] * want.abs().max().item()
    assert moepage.stats(module).total.cpu > 0
