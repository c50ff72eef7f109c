"""What one GPU can check of the collective weight sync (``anchor_rl.cluster.broadcast``) over
NCCL, with torch alone (no Ray): the NCCL group a one-GPU learner would build, sending a state of
several dtypes in buckets (a group of one rank: the API calls, not the transfer), and whether
NCCL refuses two ranks on the one GPU (why ``weight_sync=collective`` refuses workers that
share the learner's GPU).

    PYTHONPATH=. python benchmarks/weight_sync_gpu_check.py
"""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp

from anchor_rl.cluster.broadcast import SyncGroup, plan_buckets, sync_placement


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1024, 1024, generator=g).to(device),
        "h": torch.randn(4096, generator=g).bfloat16().to(device),
        "n": torch.arange(7, device=device),
        "m": torch.tensor([True, False], device=device),
    }


def _rank(rank: int, port: int, out: dict) -> None:
    try:
        torch.cuda.set_device(0)
        state = _state("cuda:0")
        buckets = plan_buckets(state, 1 << 20)
        if rank == 0:
            store = SyncGroup.open_store("127.0.0.1", 2, 60)
            out["port"] = store.port
            group = SyncGroup(store, 0, 2, sync_placement("cuda:0"), 60)
            group.send(buckets, state, 1)
        else:
            while "port" not in out:
                time.sleep(0.1)
            group = SyncGroup.join("127.0.0.1", out["port"], 1, 2, "cuda", 60)
            got = group.receive(buckets, 1)
            out["equal"] = all(torch.equal(got[k], v) for k, v in state.items())
        torch.cuda.synchronize()
        out[f"rank{rank}"] = "ok"
    except Exception as exc:  # the outcome is the point
        out[f"rank{rank}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "nccl", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))  # fmt: skip
    where = sync_placement("cuda:0")
    print("placement for a learner on cuda:0:", where)
    state = _state("cuda:0")
    buckets = plan_buckets(state, 1 << 20)
    print("buckets:", [(str(b.dtype), len(b.entries), b.nbytes) for b in buckets])
    store = SyncGroup.open_store("127.0.0.1", 1, 60)
    group = SyncGroup(store, 0, 1, where, 60)
    start = time.perf_counter()
    group.send(buckets, state, 1)
    torch.cuda.synchronize()
    print(
        f"one-rank NCCL group: sent {len(buckets)} buckets in {time.perf_counter() - start:.3f} s"
    )
    group.abort()
    print("aborted the one-rank group")

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, 0, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
        print("two NCCL ranks on one GPU:", dict(out))


if __name__ == "__main__":
    main()
