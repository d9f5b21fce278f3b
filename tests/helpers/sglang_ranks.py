"""SGLang ranks on CPU: ``run_ranks`` starts ``world`` processes that form SGLang's process groups on gloo (TP =
``world``, EP = ``ep``, as ``--tp-size``/``--ep-size`` would) with the moepage plugin hooked in, runs one job in each
and returns what each returned (a job's exception fails the caller with that rank's traceback).

Processes come from a forkserver that imports SGLang once (``PRELOAD``), so a job starts in about a second. Two
things SGLang does not do on a CPU without its CPU engine are done here: the groups get no NCCL communicators (they
need a CUDA device), and the standard dispatcher's EP id map is built on the CPU (``get_device`` has no CPU answer;
on a GPU it is the GPU)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import queue
import socket
import traceback

PRELOAD = ["sglang.srt.layers.moe.fused_moe_triton.layer", "sglang.srt.distributed.parallel_state",
           "sglang.test.test_utils", "moepage.integrations.sglang.method", "helpers.sglang"]
TIMEOUT_S = 120  # every job here takes seconds; this only ends a hung collective


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, ep: int, port: int) -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.token_dispatcher import standard
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.test.test_utils import publish_build_topology

    import moepage.integrations.sglang as plugin

    ps.init_model_parallel_group = functools.partial(ps.init_model_parallel_group, use_pynccl=False,
                                                     use_custom_allreduce=False, use_mscclpp=False,
                                                     use_torch_symm_mem_allreduce=False)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    publish_build_topology(world_rank=rank, tp_size=world, ep_size=ep, pp_size=1)
    ps.initialize_model_parallel(backend="gloo")
    standard.get_device = lambda: "cpu"
    plugin.register()
    HookRegistry.apply_hooks()


def _rank_main(rank: int, world: int, ep: int, port: int, env: dict, job, args: tuple, results) -> None:
    try:
        import torch

        torch.set_num_threads(1)  # tiny layers; ranks share the cores
        os.environ.update(env)
        _init(rank, world, ep, port)
        results.put((rank, True, job(rank, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return ctx


def run_ranks(job, *args, world: int = 2, ep: int = 1, env: dict | None = None) -> list:
    """``job(rank, *args)`` in each of ``world`` ranks (TP = ``world``, EP = ``ep``); their results in rank order.
    ``env``: variables each rank sets first (a forkserver child does not see the caller's later changes)."""
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, ep, port, dict(env or {}), job, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        while len(got) < world:
            try:
                rank, ok, value = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} gave no result in "
                                     f"{TIMEOUT_S} s") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]
