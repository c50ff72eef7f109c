"""verl 0.9.1's actor worker on the CPU with the plug-in's losses: run by test_verl_worker.py in a
subprocess (``python verl_worker_slice.py OUT_DIR``), which writes ``OUT_DIR/slice.pt``.

With ``VERL_PLATFORM=cpu`` (the plug-in's CPU mode) the script builds verl's
``ActorRolloutRefWorker`` with the ``actor_rollout`` role (its ``TrainingWorker``: FSDP2, fp32,
sdpa, no remove-padding, a one-rank gloo process group) on anchor-rl's tiny random Llama,
from the example Hydra config's VAPO group, and drives it as verl's trainer does
(padded batch -> ``left_right_2_no_padding`` -> the worker):

    lp0      log-probs before training
    step 1   ``loss_mode=anchor_rl_ppo``, old = lp0, advantages +1/-1 per row  -> lp1
    step 2   the same batch again (old = lp0, so the ratio is off 1)            -> lp2
    step 3   VAPO's ``vapo_actor_loss`` (``set_loss_fn``), old = lp2, NLL weights on
             rows 0 and 2                                                       -> lp3
    save     the engine checkpoint; step 4 (as step 3)                          -> lp4
    load     the checkpoint                                                     -> lp5
    step 4'  step 4 again from the loaded state                                 -> lp6
    bf16     a second actor worker (``actor`` role) with verl's bf16 mixed precision:
             ``model_dtype=fp32`` master weights, FSDP2 ``MixedPrecisionPolicy`` with
             ``param_dtype=bf16`` (and verl's CPU autocast in bf16), fp32 gradient
             reduction: its log-probs before training (and their dtype), one
             ``anchor_rl_ppo`` step as step 1, the log-probs after it, and the dtypes of
             its parameters and AdamW moments.
    sync     each row's prompt sampled by the ``anchor_rl`` rollout backend (a replica
             server Ray actor, ``rollout.name=anchor_rl``) before verl's weight sync;
             ``replica.sleep()`` (generation refused); the (fp32) worker's own
             ``update_weights(mode="naive")`` through the backend's ``ServerAdapter``;
             the same requests again; ``sleep`` + ``wake_up`` and again. Each sample is
             also scored by the actor (``compute_log_prob``).

The rows' log-probs are ``[B, R]`` response tensors, 0 past each response. The rollout
server is launched before the actor workers are built and first called at ``sync``, so its
start-up (a Ray worker process importing verl) overlaps both workers' steps; the script ends
with ``os._exit`` once ``slice.pt`` is written, skipping the interpreter's teardown.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import socket
import sys
from functools import partial
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "verl" / "config"
FP32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
BF16 = "{param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}"
"""``actor_rollout_ref.actor.fsdp_config.mixed_precision`` of the two workers."""
B, P, R = 4, 4, 5
"""Rows, prompt width (left-padded), response width (right-padded)."""
PROMPT_LENS = [4, 3, 2, 4]
RESPONSE_LENS = [5, 3, 4, 2]
SIGNS = [1.0, -1.0, 1.0, -1.0]
NLL_WEIGHTS = [2.0, 0.0, 2.0, 0.0]
MICRO = 2
"""ppo_micro_batch_size_per_gpu: the loss runs on rows [0, 1] and [2, 3]."""
NLL_COEF = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: Path) -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )  # fmt: skip
    import ray
    import torch
    from hydra import compose, initialize_config_dir
    from tensordict import TensorDict

    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer

    model_dir = out / "model"
    tokenizer = build_tokenizer()
    model = build_model("tiny", tokenizer, seed=0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    vocab = model.config.vocab_size
    del model

    def config(mixed_precision: str):  # type: ignore[no-untyped-def]
        return compose(
            config_name="anchor_rl_qwen2.5_1.5b",
            overrides=[
                "anchor_rl_method=vapo",
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.model.use_remove_padding=false",
                "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                "actor_rollout_ref.actor.strategy=fsdp2",
                "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
                f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={mixed_precision}",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={B}",
                "actor_rollout_ref.rollout.n=1",
                "actor_rollout_ref.actor.policy_loss.loss_mode=anchor_rl_ppo",
                "actor_rollout_ref.actor.optim.lr=3e-4",
                "actor_rollout_ref.rollout.name=anchor_rl",
                f"actor_rollout_ref.rollout.response_length={R}",
                f"actor_rollout_ref.rollout.prompt_length={P}",
            ],
        )

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg, cfg_bf16 = config(FP32), config(BF16)
    import verl  # noqa: F401  (loads the plug-in: the CPU platform, the trl fix)
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from anchor_rl.integrations.verl.backend import AnchorRLReplica
    from anchor_rl.integrations.verl.losses import vapo_actor_loss

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    model_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    replica = AnchorRLReplica(0, cfg.actor_rollout_ref.rollout, model_config, gpus_per_node=1)
    asyncio.run(replica.launch_servers())
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    workers = {"fp32": worker}

    gen = torch.Generator().manual_seed(0)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        attention[i, P - PROMPT_LENS[i] : P + RESPONSE_LENS[i]] = 1
    input_ids = torch.randint(5, vocab, (B, P + R), generator=gen) * attention
    mask = attention[:, P:].clone()
    advantages = torch.tensor(SIGNS)[:, None] * mask

    def batch(ids: torch.Tensor, attend: torch.Tensor, **fields: torch.Tensor) -> TensorDict:
        """verl's worker batch from left-padded prompts + right-padded responses ``[b, P+R]``."""
        data = TensorDict(
            {"input_ids": ids.clone(), "attention_mask": attend.clone(),
             "position_ids": (attend.cumsum(-1) - 1).clamp(min=0), "prompts": ids[:, :P].clone(),
             "responses": ids[:, P:].clone(), "response_mask": attend[:, P:].clone(), **fields},
            batch_size=ids.shape[0],
        )  # fmt: skip
        return left_right_2_no_padding(data)

    def log_probs(
        ids: torch.Tensor = input_ids, attend: torch.Tensor = attention, precision: str = "fp32"
    ) -> torch.Tensor:
        data = batch(ids, attend)
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, temperature=1.0)
        output = workers[precision].compute_log_prob(data)
        dtypes[precision].add(str(tu.get(output, "log_probs").dtype))
        return no_padding_2_padding(tu.get(output, "log_probs"), data).float() * attend[:, P:]

    def sample(request_id: str) -> dict:
        """Each row's prompt through the rollout server (``rollout``: the response tokens'
        log-probs it reports, ``[B, R]``) and the actor's log-probs of those responses."""
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": R}
        ids, attend = input_ids.clone(), attention.clone()
        ids[:, P:], attend[:, P:] = 0, 0
        rollout, steps = torch.zeros(B, R), set()
        for i in range(B):
            prompt = input_ids[i, P - PROMPT_LENS[i] : P].tolist()
            handle = replica.server_handle.generate.remote(prompt, params, f"{request_id}-{i}")
            out = ray.get(handle)
            n = len(out.token_ids)
            ids[i, P : P + n], attend[i, P : P + n] = torch.tensor(out.token_ids), 1
            rollout[i, :n] = torch.tensor(out.log_probs)
            steps.add(out.extra_fields["global_steps"])
        actor = log_probs(ids, attend)
        return {"rollout": rollout, "actor": actor, "mask": attend[:, P:], "steps": steps}

    def train(old: torch.Tensor, precision: str = "fp32", **fields: torch.Tensor) -> dict:
        fields = {"old_log_probs": old.clone(), "advantages": advantages.clone(), **fields}
        data = batch(input_ids, attention, **fields)
        tu.assign_non_tensor(
            data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
            global_batch_size=B, mini_batch_size=B, epochs=1, seed=0,
            dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=1.0,
        )  # fmt: skip
        metrics = tu.get(workers[precision].update_actor(data), "metrics")
        return {k: [float(x) for x in v] for k, v in metrics.items() if isinstance(v, list)}

    from verl.utils.device import get_device_name

    platform = (get_device_name(), torch.distributed.get_backend())
    dtypes: dict[str, set[str]] = {"fp32": set(), "bf16": set()}  # of compute_log_prob's
    result: dict = {"mask": mask, "advantages": advantages, "platform": platform}
    result["trl"] = importlib.util.find_spec("trl") is not None  # the model build ran beside it
    result["lp0"] = log_probs()
    result["m1"] = train(result["lp0"])
    result["lp1"] = log_probs()
    result["m2"] = train(result["lp0"])
    result["lp2"] = log_probs()
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    worker.set_loss_fn(partial(vapo_actor_loss, config=actor, nll_coef=NLL_COEF))
    weights = {"anchor_rl_nll_weight": torch.tensor(NLL_WEIGHTS)}
    result["m3"] = train(result["lp2"], **weights)
    result["lp3"] = log_probs()
    checkpoint = out / "checkpoint"
    worker.save_checkpoint(str(checkpoint), global_step=3)
    result["checkpoint_files"] = sorted(os.listdir(checkpoint))
    result["m4"] = train(result["lp3"], **weights)
    result["lp4"] = log_probs()
    worker.load_checkpoint(str(checkpoint))
    result["lp5"] = log_probs()
    result["m4_again"] = train(result["lp3"], **weights)
    result["lp6"] = log_probs()
    # bf16 mixed precision: a second actor (same initial weights), one anchor_rl_ppo step
    workers["bf16"] = ActorRolloutRefWorker(cfg_bf16.actor_rollout_ref, role="actor")
    workers["bf16"].init_model()
    bf16 = {"lp0": log_probs(precision="bf16")}
    bf16["m1"] = train(bf16["lp0"], precision="bf16")
    bf16["lp1"] = log_probs(precision="bf16")
    bf16["lp_dtypes"] = sorted(dtypes["bf16"])
    engine = workers.pop("bf16").actor.engine
    bf16["param_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    bf16["moment_dtypes"] = sorted(
        {str(v.dtype) for st in engine.optimizer.state.values() for k, v in st.items()
         if k.startswith("exp_avg")}
    )  # fmt: skip
    result["bf16"] = bf16
    del engine
    # the rollout server still has the initial weights; verl's weight sync: the replica is
    # put to sleep (generation refused), the worker pushes the actor's weights and wakes it
    result["before_sync"] = sample("a")
    asyncio.run(replica.sleep())
    try:
        sample("b")
    except ray.exceptions.RayTaskError as error:
        result["asleep"] = str(error).splitlines()[-1]
    asyncio.run(worker.update_weights(global_steps=5, mode="naive"))
    result["after_sync"] = sample("a")
    asyncio.run(replica.sleep())
    asyncio.run(replica.wake_up())
    result["after_wake"] = sample("a")
    result["generated"] = ray.get(replica.server_handle.__ray_call__.remote(lambda s: s.generated))
    ray.shutdown()
    result["lp_dtypes"] = sorted(dtypes["fp32"])
    result["clip"] = (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c)
    result["loss_agg_mode"] = actor.loss_agg_mode
    torch.save(result, out / "slice.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # slice.pt is written: skip the interpreter's teardown of verl's and torch's state
