"""Peak memory, held tensor bytes and step time of real training steps on a GPU: full
fine-tuning against LoRA, activation checkpointing off and on, the sampler's memory release
off and on, on ``random:base`` and on a ~0.5B HF-format Llama directory; and a PPO critic's
update with activation checkpointing off and on.

    python benchmarks/real_size_gpu.py --out DIR                  # on a GPU (about 5 minutes)
    python benchmarks/real_size_gpu.py --out DIR --rows critic    # the critic rows only
    python benchmarks/real_size_gpu.py --out DIR --device cpu --smoke   # tiny shapes, CPU

Each row builds a run as ``anchor-rl train`` does (``trainer.run.start_run`` on a GRPO config:
the arithmetic task, KL to the reference in the loss, ``optim.autocast=bf16``, the ``hf`` engine
sampling from a bfloat16 copy with ``rollout.engine_args.precision=bf16``) with the row's
``lora.rank``, ``optim.activation_checkpointing`` and ``rollout.release_memory``, and runs the
trainer's own step (``trainer.loop.train_step``: rollout, rewards, reference scoring, the update,
the weight sync) once to warm up and ``--steps`` times measured. Nothing of the step is replaced:
the engine's ``rollout`` and ``sync_weights``, the loop's ``ppo_update`` and the critic's
``trainer.critic.critic_update`` are wrapped only to read the allocator's counters and the clock
around them.

The policy rows (``--rows policy``) are GRPO: full fine-tuning and LoRA x checkpointing x
release. The critic rows (``--rows critic``) are the ``ppo`` preset (a separate critic, a copy of
the policy's body with a value head, updated before the policy in each step; KL coefficient 0),
full fine-tuning, release off, with ``optim.activation_checkpointing`` off and on (it
checkpoints the policy and the critic alike); the same batch shape as the policy rows.

Per row (``rows`` in the JSON, written to ``DIR/real_size_gpu.json`` after every row):

* ``peak_allocated`` / ``peak_reserved``: ``torch.cuda.max_memory_allocated`` / ``_reserved``
  over the measured steps (reset after the warm-up); ``peak_rollout`` and ``peak_update`` the
  same per phase (the update phase: from the end of the step's last rollout to the weight sync,
  reference scoring and a critic's update included); ``peak_policy_update`` the policy's update
  (``ppo_update``) alone and ``peak_critic_update`` the critic's (``critic_update``, critic
  rows).
* ``allocated_after_rollout``: ``torch.cuda.memory_allocated`` when the rollout has returned
  (what the step holds going into the update: policy, optimiser state, reference, the engine's
  copy); ``allocated_update_start``: when the update (``ppo_update``) starts, after the release;
  ``allocated_after_sync``: between steps. ``reserved_after_rollout`` and
  ``reserved_update_start``: ``torch.cuda.memory_reserved`` at the same points (the release's
  ``empty_cache`` shows there).
* ``bytes``: tensor bytes counted from the tensors (each storage once): ``parameters`` (the
  policy's, frozen base weights included), ``gradients`` (every trainable parameter holds one
  of its size during the update), ``optimizer`` (AdamW's state), ``reference`` (a separate
  reference model; 0 with LoRA, whose reference shares the policy's tensors) and
  ``sampling_copy`` (the engine's bfloat16 copy, when it has one); critic rows add
  ``critic_parameters`` and ``critic_optimizer``.
* ``step_seconds``: median wall seconds of the measured steps (CUDA synchronised);
  ``policy_update_seconds`` and ``critic_update_seconds`` the medians of the two updates alone.

A row that fails (out of memory) records its error and the next row runs. Progress lines go to
stdout as each row ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HF_SHAPE = {"hidden": 1536, "layers": 16, "heads": 12, "kv-heads": 4, "intermediate": 5632}
"""The HF-format model's shape (``benchmarks/make_hf_model.py``): 0.52B parameters with the
project's 111-token vocabulary."""
SMOKE_SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv-heads": 2, "intermediate": 128}

GPU_RUN = {"prompts_per_step": 16, "n": 8, "max_new_tokens": 256, "micro_batch_size": 32}
SMOKE_RUN = {"prompts_per_step": 2, "n": 2, "max_new_tokens": 8, "micro_batch_size": 2}


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def make_hf_model(out: Path, shape: dict[str, int], device: str) -> Path:
    """The HF-format model directory, written by ``benchmarks/make_hf_model.py``."""
    script = Path(__file__).with_name("make_hf_model.py")
    args = [sys.executable, str(script), str(out), "--device", device]
    for key, value in shape.items():
        args += [f"--{key}", str(value)]
    subprocess.run(args, check=True)
    return out


def tensor_bytes(tensors) -> int:
    """Bytes of ``tensors``, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class Meter:
    """The allocator's counters around the step's phases (CUDA; all None elsewhere)."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.record: dict[str, list[float]] = {}
        self.step_peak = {"allocated": 0, "reserved": 0}  # over the measured steps
        self.update_peak = 0  # the update phase's, over its parts so far

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.cuda else None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def reserved(self) -> int | None:
        return torch.cuda.memory_reserved() if self.cuda else None

    def fold(self) -> None:
        """Keep the peaks since the last reset in ``step_peak`` (before a reset)."""
        if self.cuda:
            self.step_peak["allocated"] = max(self.step_peak["allocated"], self.peak() or 0)
            reserved = torch.cuda.max_memory_reserved()
            self.step_peak["reserved"] = max(self.step_peak["reserved"], reserved)

    def note(self, key: str, value: float | None) -> None:
        if value is not None:
            self.record.setdefault(key, []).append(value)

    def instrument(self, run: Any, loop: Any, critic_module: Any = None) -> None:
        """Wrap the run's engine, the loop's update and ``critic_module.critic_update`` (the
        module ``trainer.critic``, whose component calls it by that name; None: not wrapped)
        to read the counters and the clock around them."""
        engine, meter = run.engine, self
        rollout, sync = engine.rollout, engine.sync_weights

        def phase_start() -> None:
            meter.fold()
            meter.reset_peak()

        def part(fn: Any, key: str, before: Any = None) -> Any:
            """``fn`` as a part of the update phase: its own peak and seconds are noted."""

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                meter.update_peak = max(meter.update_peak, meter.peak() or 0)
                phase_start()
                if before is not None:
                    before()
                meter.synchronize()
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                meter.synchronize()
                meter.note(f"{key}_seconds", time.perf_counter() - start)
                meter.note(f"peak_{key}", meter.peak())
                meter.update_peak = max(meter.update_peak, meter.peak() or 0)
                phase_start()
                return out

            return wrapped

        def timed_rollout(*args: Any, **kwargs: Any) -> Any:
            phase_start()
            out = rollout(*args, **kwargs)
            meter.note("peak_rollout", meter.peak())
            meter.note("allocated_after_rollout", meter.allocated())
            meter.note("reserved_after_rollout", meter.reserved())
            phase_start()  # the update phase starts here (the last rollout's reset counts)
            meter.update_peak = 0
            return out

        def timed_sync(state: Any) -> None:
            if meter.cuda:
                meter.note("peak_update", max(meter.update_peak, meter.peak() or 0))
            phase_start()
            sync(state)
            meter.note("allocated_after_sync", meter.allocated())

        def update_start() -> None:
            meter.note("allocated_update_start", meter.allocated())
            meter.note("reserved_update_start", meter.reserved())

        def critic_start() -> None:
            meter.note("allocated_critic_start", meter.allocated())

        update = loop.ppo_update
        engine.rollout, engine.sync_weights = timed_rollout, timed_sync
        loop.ppo_update = part(update, "policy_update", update_start)
        self._restore: list[tuple[Any, str, Any]] = [(loop, "ppo_update", update)]
        if critic_module is not None:
            critic = critic_module.critic_update
            critic_module.critic_update = part(critic, "critic_update", critic_start)
            self._restore.append((critic_module, "critic_update", critic))

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def uninstrument(self) -> None:
        for module, name, fn in self._restore:
            setattr(module, name, fn)


def held_bytes(run: Any) -> dict[str, int]:
    """Tensor bytes of the policy, its gradients, AdamW's state, a separate reference and the
    engine's sampling copy."""
    from anchor_rl.models.lora import trainable_parameters

    policy = run.policy
    trainable = trainable_parameters(policy)
    state = [v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    own = {t.untyped_storage().data_ptr() for t in policy.parameters()}
    ref = [] if run.ref is None else list(run.ref.parameters())
    ref = [t for t in ref if t.untyped_storage().data_ptr() not in own]
    engine = getattr(run.engine, "model", None)
    copy = [] if engine is None or engine is policy else list(engine.parameters())
    out = {
        "parameters": tensor_bytes(policy.parameters()),
        "gradients": sum(p.numel() * p.element_size() for p in trainable),
        "optimizer": tensor_bytes(state),
        "reference": tensor_bytes(ref),
        "sampling_copy": tensor_bytes(copy),
    }
    out["params_grads_optimizer"] = out["parameters"] + out["gradients"] + out["optimizer"]
    component = run.components.get("critic") if isinstance(run.components, dict) else None
    if component is not None:  # a PPO row's critic and its AdamW
        critic_state = component.optimizer.state.values()
        out["critic_parameters"] = tensor_bytes(component.critic.parameters())
        out["critic_optimizer"] = tensor_bytes(
            [v for s in critic_state for v in s.values() if torch.is_tensor(v)]
        )
    return out


def run_row(model: str, row: dict[str, Any], args: argparse.Namespace, work: Path) -> dict:
    """One configuration: the warm-up step, ``args.steps`` measured steps, the figures."""
    from anchor_rl.trainer import critic as critic_module
    from anchor_rl.trainer import loop
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.run import start_run

    shape = SMOKE_RUN if args.smoke else GPU_RUN
    overrides = [
        f"model={model}", "task=arithmetic", f"device={args.device}", "seed=0",
        "eval.every=0", "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
        f"steps={args.steps + 1}", "optim.autocast=bf16", "rollout.engine_args.precision=bf16",
        f"rollout.prompts_per_step={shape['prompts_per_step']}", f"rollout.n={shape['n']}",
        f"rollout.max_new_tokens={shape['max_new_tokens']}",
        f"optim.micro_batch_size={shape['micro_batch_size']}",
        f"optim.activation_checkpointing={row['checkpointing']}",
        f"rollout.release_memory={row['release']}",
    ]  # fmt: skip
    if row["lora"]:
        overrides += [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}"]
    cfg = load_config(row.get("preset", "grpo"), overrides)
    meter = Meter(args.device)
    name = "-".join(f"{k}={v}" for k, v in row.items())
    run = start_run(cfg, work / f"{Path(model).name}-{name}")
    try:
        meter.instrument(run, loop, critic_module)
        times = []
        for i in range(args.steps + 1):
            if i == 1:  # the measured steps: peaks from here on
                meter.record.clear()
                meter.reset_peak()
                meter.step_peak = {"allocated": 0, "reserved": 0}
            sync_device(args.device)
            start = time.perf_counter()
            metrics = loop.train_step(run)
            sync_device(args.device)
            if i >= 1:
                times.append(time.perf_counter() - start)
        meter.fold()
        result = {
            "step_seconds": statistics.median(times),
            "step_seconds_all": times,
            "parameters": sum(p.numel() for p in run.policy.parameters()),
            "trainable": sum(p.numel() for p in run.policy.parameters() if p.requires_grad),
            "bytes": held_bytes(run),
            "response_tokens": metrics.get("tokens/step"),
            "peak_allocated": meter.step_peak["allocated"] if meter.cuda else None,
            "peak_reserved": meter.step_peak["reserved"] if meter.cuda else None,
        }
        for key, values in meter.record.items():  # the phases' worst over the measured steps
            result[key] = statistics.median(values) if key.endswith("_seconds") else max(values)
        return result
    finally:
        meter.uninstrument()
        run.close()
        del run
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def sync_device(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def table_rows(which: str = "all") -> list[dict[str, Any]]:
    """The rows of one model: ``policy`` (GRPO: LoRA x checkpointing x release, off and on),
    ``critic`` (PPO, full fine-tuning, checkpointing off and on), or ``all`` (policy first)."""
    policy = [
        {"preset": "grpo", "lora": lora, "checkpointing": ckpt, "release": release}
        for lora in (False, True)
        for ckpt in (False, True)
        for release in (False, True)
    ]
    critic = [
        {"preset": "ppo", "lora": False, "checkpointing": ckpt, "release": False}
        for ckpt in (False, True)
    ]
    return {"policy": policy, "critic": critic, "all": policy + critic}[which]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory of the JSON")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--models", nargs="*", default=None, help="default: base and the HF dir")
    parser.add_argument("--hf-model", type=Path, help="an HF directory instead of a new one")
    parser.add_argument(
        "--rows", choices=["all", "policy", "critic"], default="all",
        help="policy: the GRPO rows; critic: the PPO critic rows (checkpointing off/on)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit", type=float, default=450.0,
        help="seconds after which the rows not started are skipped (recorded as skipped)",
    )  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "real_size_gpu.json"
    import transformers

    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": (
            torch.cuda.get_device_name()
            if args.device.startswith("cuda")
            else platform.processor() or platform.machine()
        ),
        "run": SMOKE_RUN if args.smoke else GPU_RUN,
        "rows": [],
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="real_size_gpu-"))
    models = args.models
    if models is None:
        hf = args.hf_model
        if hf is None:
            log("writing the HF-format model (benchmarks/make_hf_model.py)")
            shape = SMOKE_SHAPE if args.smoke else HF_SHAPE
            try:
                hf = make_hf_model(work / "hf-model", shape, args.device)
                result["hf_shape"] = shape
            except (OSError, subprocess.CalledProcessError) as exc:  # the base rows still run
                result["hf_error"] = str(exc)
                log(f"the HF-format model could not be written: {exc}")
        models = [str(hf)] if hf is not None else []
        models.append("random:tiny" if args.smoke else "random:base")  # the larger first
    rows = table_rows(args.rows)
    begun = time.perf_counter()
    for model in models:
        for row in rows:
            started = time.perf_counter()
            entry: dict[str, Any] = {"model": model if ":" in model else "hf-dir", **row}
            if started - begun > args.time_limit:
                entry["skipped"] = f"--time-limit {args.time_limit:g} s reached"
                result["rows"].append(entry)
                out_file.write_text(json.dumps(result, indent=2) + "\n")
                log(f"{entry['model']} {row}: skipped (time limit)")
                continue
            try:
                entry |= run_row(model, row, args, work)
            except Exception as exc:  # an OOM: recorded, the next row runs
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
            gc.collect()  # the failed row's tensors too, once its traceback is gone
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            entry["row_seconds"] = time.perf_counter() - started
            result["rows"].append(entry)
            out_file.write_text(json.dumps(result, indent=2) + "\n")
            gib = (entry.get("peak_allocated") or 0) / 2**30
            critic = (entry.get("peak_critic_update") or 0) / 2**30
            log(
                f"{entry['model']} {row['preset']} lora={row['lora']} "
                f"ckpt={row['checkpointing']} release={row['release']}: peak {gib:.2f} GiB"
                + (f" (critic update {critic:.2f} GiB)" if row["preset"] == "ppo" else "")
                + ", step "
                f"{entry.get('step_seconds', float('nan')):.3f} s, held "
                f"{entry.get('bytes', {}).get('params_grads_optimizer', 0) / 2**30:.2f} GiB"
                + (f" ERROR {entry['error']}" if "error" in entry else "")
            )
    log(f"wrote {out_file}")


if __name__ == "__main__":
    main()
