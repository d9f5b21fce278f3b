"""A torch stand-in for vLLM's Triton expert kernel on the CPU, where the CUDA wheel has none: ``TorchTritonExperts``
is a ``TritonExperts`` whose ``apply`` computes each entry on its own in torch, shaped as Triton's: the router weight
multiplied in float32 before the cast, the per-entry outputs ``[M, top_k, H]`` in the kernel's reused workspace, then
its own ``_finalize_expert_output`` -> ``moe_sum`` (entries an expert map sends nowhere are left unwritten and skipped,
as on the GPU; here they hold NaN, so a paged step that used one would show it). ``install()`` makes vLLM's unquantized
method build it (vLLM's out-of-tree registration), skipping the CPU prepack (a kernel the CUDA wheel lacks), and
vLLM's FP8 method pick it (block FP8: each expert's weights dequantized by its own block scales, the activations as
vLLM's prepare step quantized them per token group, done here in torch). Each entry's output depends on its own
token and expert only, so paged and unpaged agree bit for bit exactly when the paging routes each entry to the slot
holding its expert (its weights and scales), merges the waves and sums as the kernel does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
from vllm.model_executor.layers.fused_moe.utils import _resize_cache


class TorchTritonExperts(TritonExperts):
    calls = 0  # kernel calls, all instances (a test reads how many waves ran)

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):
        type(self).calls += 1
        m, top = topk_ids.shape
        h = w2.shape[1]
        rows = _resize_cache(workspace2, (m, top, h))
        rows.fill_(float("nan"))  # what an unwritten entry holds
        ids = topk_ids.long()
        local = expert_map[ids].long() if expert_map is not None else ids
        out_dtype = output.dtype
        for t in range(m):
            x = _rows(hidden_states[t : t + 1], a1q_scale[t : t + 1] if a1q_scale is not None else None)[0]
            for j in range(top):
                e = int(local[t, j])
                if e < 0:
                    continue
                gate, up = (self._weight(w1, self.w1_scale, e) @ x).to(out_dtype).float().chunk(2)
                act = (F.silu(gate) * up).to(out_dtype).float()
                y = self._weight(w2, self.w2_scale, e) @ act
                if not apply_router_weight_on_input:
                    y = y * topk_weights[t, j].float()
                rows[t, j] = y.to(rows.dtype)
        self._finalize_expert_output(rows, output, topk_ids, expert_map)

    def _weight(self, w, scale, e: int) -> torch.Tensor:
        """Expert ``e``'s weight in float32: block-FP8 rows scaled by their own blocks' scales."""
        if scale is None:
            return w[e].float()
        bn, bk = self.block_shape
        return w[e].float() * scale[e].repeat_interleave(bn, 0)[: w.shape[1]].repeat_interleave(bk, 1)[:, : w.shape[2]]

    def moe_sum(self, input, output, topk_ids=None, expert_map=None):
        valid = torch.ones(input.shape[:2], dtype=torch.bool, device=input.device)
        if expert_map is not None:
            valid = expert_map[topk_ids.long()] >= 0
        acc = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        for j in range(input.shape[1]):  # a fixed order over top_k, as the CUDA kernel sums
            acc += torch.where(valid[:, j, None], input[:, j].float(), 0.0)
        output.copy_(acc.to(output.dtype))


def _rows(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Activations in float32: FP8 ones (vLLM's prepare step quantizes them per token group) times their scales."""
    if scale is None:
        return x.float()
    group = x.shape[-1] // scale.shape[-1]
    return x.float() * scale.float().repeat_interleave(group, -1)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, column_major_scales: bool = False, **_):
    """vLLM's dynamic FP8 quantization per token group, in torch: each group over its own largest magnitude."""
    groups = x.float().unflatten(-1, (-1, group_size))
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (groups.abs().amax(-1, keepdim=True) / fmax).clamp(min=1e-10)
    q = (groups / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).flatten(-2)
    return q, scale.squeeze(-1)


class CpuUnquantizedMethod(UnquantizedFusedMoEMethod):
    def __init__(self, moe):
        super().__init__(moe)
        self.experts_cls = TorchTritonExperts

    def process_weights_after_loading(self, layer):
        self._init_moe_kernel(layer)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return self.forward_native(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)


_installed = False


def install() -> None:
    global _installed
    if not _installed:
        CustomOp.register_oot(CpuUnquantizedMethod, name="UnquantizedFusedMoEMethod")
        from vllm.model_executor.layers.fused_moe import utils
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
        from vllm.model_executor.layers.quantization import fp8

        # vLLM's FP8 method picks no backend on the CPU: give it the Triton one, computed by the stand-in, and the
        # prepare step's per-token-group quantization (a Triton kernel) in torch
        fp8.select_fp8_moe_backend = lambda **kw: (Fp8MoeBackend.TRITON, TorchTritonExperts)
        utils.per_token_group_quant_fp8 = per_token_group_quant_fp8
        # On a CPU with AMX tiles vLLM packs small bf16 weights (embeddings, routers) for its own CPU GEMM, whose
        # kernels (torch.ops._C) the CUDA wheel lacks: the unpacked torch path serves them here
        torch.cpu._is_amx_tile_supported = lambda: False
        _installed = True
