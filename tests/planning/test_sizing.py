"""``moepage.planning.sizing`` and ``moepage plan`` on tiny safetensors checkpoints written here: exact
byte counts for per-expert and stacked (HF v5) names, quantized companions, sharded checkpoints,
and proof that no tensor data is read."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from moepage import ConfigError, cli, units
from moepage.planning import sizing

H, I = 16, 8  # hidden, intermediate


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def write_config(path, **values) -> None:
    (path / "config.json").write_text(json.dumps(values))


def dense_tensors(layers: int) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.zeros(32, H, dtype=torch.bfloat16),
           "lm_head.weight": torch.zeros(32, H, dtype=torch.bfloat16)}
    for l in range(layers):
        out[f"model.layers.{l}.self_attn.q_proj.weight"] = torch.zeros(H, H, dtype=torch.bfloat16)
        out[f"model.layers.{l}.mlp.gate.weight"] = torch.zeros(4, H, dtype=torch.bfloat16)  # the router
        out[f"model.layers.{l}.mlp.shared_experts.gate_proj.weight"] = torch.zeros(I, H, dtype=torch.bfloat16)
    return out


def per_expert_checkpoint(path, layers=2, e=4, quantized=False, names=("gate_proj", "up_proj", "down_proj")):
    tensors = dense_tensors(layers)
    expert = 0
    for l in range(layers):
        for x in range(e):
            for n in names:
                base = f"model.layers.{l}.mlp.experts.{x}.{n}"
                if quantized:  # GPTQ-style companions all count toward the expert
                    tensors[f"{base}.qweight"] = torch.zeros(H // 8, I, dtype=torch.int32)
                    tensors[f"{base}.qzeros"] = torch.zeros(1, I // 8, dtype=torch.int32)
                    tensors[f"{base}.scales"] = torch.zeros(1, I, dtype=torch.float16)
                    tensors[f"{base}.g_idx"] = torch.zeros(H, dtype=torch.int32)
                else:
                    tensors[f"{base}.weight"] = torch.zeros(I, H, dtype=torch.bfloat16)
    expert = nbytes(*(t for k, t in tensors.items() if k.startswith("model.layers.0.mlp.experts.0.")))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors, expert


def test_per_expert_names(tmp_path):
    tensors, expert = per_expert_checkpoint(tmp_path)
    write_config(tmp_path, num_experts=4, num_experts_per_tok=2)
    size = sizing.checkpoint_size(tmp_path)
    assert expert == 3 * I * H * 2
    assert (size.num_experts, size.top_k, size.num_layers) == (4, 2, 2)
    assert size.moe_layers == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert size.expert_bytes == [expert, expert] and size.slot_bytes == 2 * expert
    assert size.experts_total_bytes == 2 * 4 * expert
    assert size.dense_bytes == nbytes(*tensors.values()) - 8 * expert  # shared experts are dense
    assert size.device_bytes(3) == size.dense_bytes + 3 * size.slot_bytes


def test_quantized_and_mixtral_names(tmp_path):
    _, expert = per_expert_checkpoint(tmp_path, layers=3, e=8, quantized=True, names=("w1", "w2", "w3"))
    write_config(tmp_path, text_config={"num_local_experts": 8, "num_experts_per_tok": 2})
    size = sizing.checkpoint_size(tmp_path)
    assert expert == 3 * ((H // 8) * I * 4 + (I // 8) * 4 + I * 2 + H * 4)
    assert (size.num_experts, size.top_k, size.num_layers, size.slot_bytes) == (8, 2, 3, 3 * expert)


def test_stacked_hf_v5_names(tmp_path):
    e, layers = 6, 3
    tensors = dense_tensors(layers)
    for l in range(layers):
        p = f"model.layers.{l}.mlp.experts"
        tensors[f"{p}.gate_up_proj"] = torch.zeros(e, 2 * I, H, dtype=torch.bfloat16)
        tensors[f"{p}.gate_up_proj_bias"] = torch.zeros(e, 2 * I, dtype=torch.float32)
        tensors[f"{p}.down_proj"] = torch.zeros(e, H, I, dtype=torch.bfloat16)
        tensors[f"{p}.input_scale"] = torch.zeros(1, dtype=torch.float32)  # not per expert: dense
    save_file(tensors, str(tmp_path / "model.safetensors"))
    size = sizing.checkpoint_size(tmp_path)  # no config.json: E from the leading dimension
    expert = 2 * I * H * 2 + 2 * I * 4 + H * I * 2
    assert (size.num_experts, size.top_k, size.num_layers) == (e, None, layers)
    assert size.expert_bytes == [expert] * layers and size.experts_total_bytes == layers * e * expert
    assert size.dense_bytes == nbytes(*tensors.values()) - layers * e * expert
    assert size.min_resident == 1


def test_sharded_index_and_max_resident(tmp_path):
    tensors, expert = per_expert_checkpoint(tmp_path, layers=2, e=4)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    save_file({"lm_head.extra": torch.zeros(64, dtype=torch.uint8)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"stray": torch.zeros(1000, dtype=torch.uint8)}, str(tmp_path / "old.safetensors"))  # not in the index
    weight_map = ({k: "model-00001-of-00002.safetensors" for k in tensors}
                  | {"lm_head.extra": "model-00002-of-00002.safetensors"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_config(tmp_path, num_experts=4, num_experts_per_tok=2)
    size = sizing.checkpoint_size(tmp_path)
    assert size.dense_bytes == nbytes(*tensors.values()) - 8 * expert + 64
    dense, slot = size.dense_bytes, size.slot_bytes
    assert size.max_resident(dense + 3 * slot, 0) == 3
    assert size.max_resident(dense + 3 * slot + 100, 100) == 3
    assert size.max_resident(dense + 3 * slot - 1, 0) == 2
    assert size.max_resident(dense + 100 * slot, 0) == 4  # capped at E
    assert size.max_resident(dense + slot, 0) == 0  # below top_k = 2: infeasible


def test_header_only(tmp_path, monkeypatch):
    """Only the header is read: the data (zeros here, never looked at) only has to be there. A file
    whose data is missing is truncated: refused, naming the file."""
    header = {
        "__metadata__": {"format": "pt"},
        "m.layers.0.experts.0.w1.weight": {"dtype": "F8_E4M3", "shape": [8, 16], "data_offsets": [0, 128]},
        "m.layers.0.experts.1.w1.weight": {"dtype": "F8_E4M3", "shape": [8, 16], "data_offsets": [128, 256]},
        "m.layers.0.experts.0.w1.weight_scale_inv": {"dtype": "F32", "shape": [1], "data_offsets": [256, 260]},
        "m.layers.0.experts.1.w1.weight_scale_inv": {"dtype": "F32", "shape": [1], "data_offsets": [260, 264]},
        "m.norm.weight": {"dtype": "BF16", "shape": [16], "data_offsets": [264, 296]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(ConfigError, match=rf"{path}: truncated or corrupt: its header describes "
                                          rf"{8 + len(raw) + 296} bytes, the file has {8 + len(raw)}"):
        sizing.checkpoint_size(path)
    with open(path, "ab") as f:
        f.truncate(8 + len(raw) + 296)  # sparse: the data's bytes exist, never written
    read = []

    class Counting:
        def __init__(self, *args):
            self.f = open(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n):
            read.append(n)
            return self.f.read(n)

    monkeypatch.setattr(sizing, "open", Counting, raising=False)
    size = sizing.checkpoint_size(path)
    assert (size.num_experts, size.expert_bytes, size.dense_bytes) == (2, [132], 32)
    assert read == [8, len(raw)]  # the length and the header: no tensor data


def test_no_experts_is_an_error(tmp_path):
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no routed expert"):
        sizing.checkpoint_size(tmp_path)


@pytest.mark.parametrize(
    "text,value",
    [("16GiB", 16 * 2**30), ("16G", 16 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20), ("1.5k", 1536),
     ("1000B", 1000), ("0", 0)],
)
def test_parse_bytes(text, value):
    assert units.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["16", "1000", "16 GiBs", "lots"])
def test_parse_bytes_needs_a_unit(text):
    """A bare number was read as bytes: ``--gpu-mem 16`` meant 16 bytes."""
    with pytest.raises(ConfigError, match=f"cannot read a byte size from '{text}': give a number and a unit"):
        units.parse_bytes(text)


def test_plan_cli(tmp_path, capsys):
    _, expert = per_expert_checkpoint(tmp_path, layers=2, e=4)
    write_config(tmp_path, num_experts=4, num_experts_per_tok=2)
    size = sizing.checkpoint_size(tmp_path)
    budget = size.dense_bytes + 3 * size.slot_bytes + 1000
    assert cli.main(["plan", str(tmp_path), "--gpu-mem", f"{budget}B", "--reserve", "1000B"]) == 0
    out = capsys.readouterr().out
    assert f"per-expert bytes: {expert} " in out and f"one slot across 2 layers: {2 * expert} " in out
    assert "feasible K: 2..3" in out
    assert cli.main(["plan", str(tmp_path), "--gpu-mem", f"{size.dense_bytes}B"]) == 1
    assert "infeasible" in capsys.readouterr().out


def test_plan_recommends_the_largest_k_leaving_the_reserve(tmp_path, capsys):
    per_expert_checkpoint(tmp_path, layers=2, e=8)
    write_config(tmp_path, num_experts=8, num_experts_per_tok=2)
    size = sizing.checkpoint_size(tmp_path)
    reserve = 4096
    for k in (5, 3):
        budget = size.dense_bytes + k * size.slot_bytes + reserve + size.slot_bytes - 1  # one byte short of K + 1
        assert cli.main(["plan", str(tmp_path), "--gpu-mem", f"{budget}B", "--reserve", f"{reserve}B"]) == 0
        out = capsys.readouterr().out
        assert f"recommended: K = {k} (the largest K leaving the 4.00 KiB reserve" in out
        marked = [line.split()[0] for line in out.splitlines() if line.endswith("<- recommended")]
        assert marked == [str(k)]


def test_plan_without_a_gpu_budget_reports_sizes_and_host_memory(tmp_path, capsys):
    """A CPU user has no GPU budget: plan still gives the sizes and the host memory, and says what K needs."""
    per_expert_checkpoint(tmp_path, layers=2, e=8)
    write_config(tmp_path, num_experts=8, num_experts_per_tok=2)
    assert cli.main(["plan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "host memory needed: " in out and "give --gpu-mem" in out and "recommended" not in out


def test_sglang_auto_uses_the_planning_rule(tmp_path, monkeypatch):
    """``choose_resident`` asks ``CheckpointSize.slots_fitting`` (the one home), keeping its own error."""
    from moepage.integrations.auto import choose_resident

    per_expert_checkpoint(tmp_path, layers=2, e=8)
    size = sizing.checkpoint_size(tmp_path)
    budget = size.dense_bytes + 5 * size.slot_bytes
    assert choose_resident(size, 8, 2, budget, 1.0, 0.0)[0] == size.max_resident(budget) == 5
    monkeypatch.setattr(sizing.CheckpointSize, "slots_fitting", lambda self, budget, reserve=0: 1)
    with pytest.raises(ConfigError, match=r"leaves room for 1 experts per layer .*top_k=2 are needed"):
        choose_resident(size, 8, 2, budget, 1.0, 0.0)


# -- host memory ---------------------------------------------------------------------------------
def fake_machine(root, meminfo_kib=None, v2=None, v1=None, cgroup="0::/\n"):
    """A /proc and /sys under ``root``: MemAvailable, cgroup v2 ``{dir: (max, current, inactive_file)}``, v1 alike."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    if meminfo_kib is not None:
        (root / "proc" / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kib} kB\n")
    for mount, table, names in (("sys/fs/cgroup", v2, ("memory.max", "memory.current", "inactive_file")),
                                ("sys/fs/cgroup/memory", v1,
                                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))):
        for sub, (limit, usage, cache) in (table or {}).items():
            d = root / mount / sub
            d.mkdir(parents=True, exist_ok=True)
            (d / names[0]).write_text(f"{limit}\n")
            (d / names[1]).write_text(f"{usage}\n")
            (d / "memory.stat").write_text(f"anon 5\n{names[2]} {cache}\n")
    return root


def test_host_memory_from_meminfo_and_cgroup_limits(tmp_path):
    from moepage.planning.host import host_memory_available

    only = host_memory_available(fake_machine(tmp_path / "a", meminfo_kib=1000))
    assert (only.available, only.source) == (1000 * 1024, "MemAvailable in /proc/meminfo")
    # cgroup v2, the process two levels down: its parent's limit is the tightest; page cache is reclaimable
    v2 = host_memory_available(fake_machine(tmp_path / "b", meminfo_kib=10**9, cgroup="0::/job/task\n", v2={
        "job/task": ("max", 50, 0), "job": (10_000, 4_000, 1_000)}))
    assert v2.available == 10_000 - (4_000 - 1_000)
    assert v2.source == ("cgroup v2 limit /sys/fs/cgroup/job/memory.max less its usage "
                         "(memory.current - inactive_file)")
    v1 = host_memory_available(fake_machine(tmp_path / "c", meminfo_kib=10**9, cgroup="4:memory:/x\n0::/\n", v1={
        "x": (8_000, 3_000, 500), "": (9223372036854771712, 1, 0)}))  # v1 writes "no limit" as a huge number
    assert v1.available == 8_000 - 2_500
    assert v1.source.startswith("cgroup v1 limit /sys/fs/cgroup/memory/x/memory.limit_in_bytes less its usage")
    loose = host_memory_available(fake_machine(tmp_path / "d", meminfo_kib=2, v2={"": (10**12, 0, 0)}))
    assert loose.source == "MemAvailable in /proc/meminfo"  # the smaller figure wins
    assert host_memory_available(tmp_path / "nothing") is None
    unlimited = fake_machine(tmp_path / "e", cgroup="4:memory:/\n", v1={"": (9223372036854771712, 1, 0)},
                             v2={"": ("max", 1, 0)})
    assert host_memory_available(unlimited) is None  # no limit is no figure, not a huge one


@pytest.mark.parametrize("available,verdict", [(10**12, ": fits"), (1000, "does NOT fit (short by "),
                                                (None, "unknown (no /proc/meminfo or cgroup limit to read)")])
def test_plan_says_whether_the_experts_fit_host_memory(tmp_path, capsys, monkeypatch, available, verdict):
    from moepage.planning import host

    per_expert_checkpoint(tmp_path, layers=2, e=4)
    write_config(tmp_path, num_experts=4, num_experts_per_tok=2)
    size = sizing.checkpoint_size(tmp_path)
    memory = None if available is None else host.AvailableMemory(available, "a test figure")
    monkeypatch.setattr(host, "host_memory_available", lambda: memory)
    # 1000 B hold no row: infeasible even with a disk tier (status 1), this machine's figure named
    assert cli.main(["plan", str(tmp_path), "--gpu-mem", "1GiB"]) == (1 if available == 1000 else 0)
    out = capsys.readouterr().out
    assert available != 1000 or "infeasible: 1000 B of host memory (a test figure) holds 0 rows per layer" in out
    assert size.host_bytes == size.experts_total_bytes == 2 * 4 * 3 * I * H * 2
    assert f"host memory needed: {units.format_bytes(size.host_bytes)} (all 4 experts of 2 MoE layers" in out
    (line,) = [x for x in out.splitlines() if x.startswith("host memory available here: ")]
    assert verdict in line and (available is None or "(a test figure)" in line)


@pytest.mark.parametrize("text", ["{}", "not json", '{"weight_map": []}'])
def test_a_bad_index_file_is_named(tmp_path, text):
    per_expert_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'model.safetensors.index.json'}: not "):
        sizing.checkpoint_size(tmp_path)
