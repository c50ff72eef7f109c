"""verl 0.9.1's whole ``main_ppo`` with ``trainer.v1.trainer_mode=anchor_rl`` on the CPU: the
data, model and reward of ``test_verl_main_ppo.py``, and one launch of verl's trainer.

``python verl_main_ppo.py DIR METHOD STEPS [OVERRIDE ...]`` prepares ``DIR`` once (anchor-rl's
tiny random Llama, 8 GSM8K-style prompts, a reward module) and runs
``python -m verl.trainer.main_ppo`` in it, in the plug-in's CPU mode (``VERL_PLATFORM=cpu``)
with the ``anchor_rl`` rollout backend, for ``STEPS`` steps in all, resuming from the last
checkpoint in ``DIR/checkpoints`` when there is one (verl's ``resume_mode=auto``). Each launch
logs verl's metrics to ``DIR/metrics_<METHOD>_<STEPS>.jsonl`` (verl's file logger) and its
output to ``DIR/log_<METHOD>_<STEPS>.txt``. Hydra writes ``outputs/`` into the working
directory, which is ``DIR``. ``benchmarks/verl_gpu.sh`` runs the same launches on a GPU
(:func:`launch`'s ``device="cuda"``, FSDP1 or FSDP2).

The reward (``reward.py``) picks its rule by ``data_source``, so outcomes vary on a random
model and every branch of the methods is reached:

    easy    1 for every response                 (PVPO's group sampling drops it)
    hard    1 only with ``#### <answer>``         (the reference never solves it; the
                                                  field teacher ``extra_info.answer`` does)
    coin    1 for responses whose CRC32 is even  (about half: mixed groups)
    drift   1 for the first ``PRESAMPLED`` responses a launch scores (its presampling), 0
            after: the anchor says 1, training says 0, so V0.5's first rollouts reject
            the prior and its budget rule asks for top-ups

It also appends ``<data_source>\\t<response>\\t<score>`` to ``DIR/scored.tsv`` (where
``SCORED_LOG`` points), the reward workers' own record of what they scored.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG_DIR = ROOT / "examples" / "verl" / "config"
PROMPT_LENGTH, RESPONSE_LENGTH = 48, 8
BATCH, M = 2, 4
"""Prompts per step; PVPO's presampled rollouts per prompt."""

KL_IN_REWARD = 0.1
"""V0.5's and VAPO's ``algorithm.kl_ctrl.kl_coef`` (a fixed controller): beta of the KL to
verl's reference worker in their rewards."""

KL_IN_REWARD_OVERRIDES = [
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=kl",
    f"algorithm.kl_ctrl.kl_coef={KL_IN_REWARD}",
]
"""The KL in the reward: ``r = score - beta * (old - ref)`` per response token."""

VAPO_LAM_ALPHA = 0.5
"""VAPO's ``lam_alpha``: its length-adaptive lambda ``1 - 1/(alpha l)`` lies strictly between 0
and 1 for responses of 3 to 8 tokens (the default 0.05 clamps every response of this loop's
8 tokens at most to 0, one-step TD)."""

PROMPTS = [
    ("easy", "1+1", "2"),
    ("hard", "2+3", "5"),
    ("coin", "4+4", "8"),
    ("drift", "3+3", "6"),
    ("hard", "1+2", "3"),
    ("coin", "2+2", "4"),
    ("easy", "5+1", "6"),
    ("coin", "3+4", "7"),
]
"""(data_source, question, answer) of the training set."""

REWARD = """
import os
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    path = os.environ.get("SCORED_LOG")
    done = 0
    if path and os.path.exists(path):
        with open(path) as f:
            done = sum(1 for _ in f)
    if data_source == "easy":
        score = 1.0
    elif data_source == "drift":
        score = float(done < int(os.environ.get("PRESAMPLED", "0")))
    elif data_source == "hard":
        score = float(f"#### {ground_truth}" in solution_str)
    else:
        score = float(zlib.crc32(solution_str.encode()) % 2 == 0)
    if path:
        with open(path, "a") as f:
            f.write(f"{data_source}\\t{solution_str!r}\\t{score}\\n")
    return score
"""


def prepare(out: Path, model: str = "tiny") -> None:
    """The model (anchor-rl's ``model`` size, random, seed 0; skipped when ``out/model`` holds a
    model already, e.g. one written by ``benchmarks/make_hf_model.py``), the parquet files and
    the reward module in ``out`` (once)."""
    if (out / "reward.py").exists():
        return
    import pandas as pd

    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "model" / "config.json").exists():
        tokenizer = build_tokenizer()
        build_model(model, tokenizer, seed=0).save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")
    rows = [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"What is {q}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"index": i, "answer": f"#### {a}"},
        }
        for i, (source, q, a) in enumerate(PROMPTS)
    ]
    pd.DataFrame(rows).to_parquet(out / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(out / "test.parquet")
    (out / "reward.py").write_text(REWARD)


METHOD_OVERRIDES = {
    "pvpo": [
        f"anchor_rl.pvpo.m={M}",
        "anchor_rl.pvpo.teacher=field:extra_info.answer",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.use_kl_loss=false",
        # anchor-rl's loss reports the ratio: off 1 exactly where old log-probs are log pi_gt
        "actor_rollout_ref.actor.policy_loss.loss_mode=anchor_rl_ppo",
        "actor_rollout_ref.actor.clip_ratio_c=null",
    ],
    "v05": [
        f"anchor_rl.pvpo.m={M}",
        "anchor_rl.v05.k_max=6",
        "anchor_rl.v05.top_up_rounds=1",
        "actor_rollout_ref.rollout.n=2",
        # the example's KL loss to verl's reference worker (low_var_kl, 0.04) stays on, and
        # the same reference's KL goes into the reward too: r = score - beta * (old - ref)
        *KL_IN_REWARD_OVERRIDES,
        # one prompt's rollouts per mini-batch: several optimizer steps per training step
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ],
    "vapo": [
        "actor_rollout_ref.rollout.n=2",
        "trainer.critic_warmup=2",  # step 1 trains the critic alone (value pretraining)
        "critic.strategy=fsdp2",
        "critic.model.path=${actor_rollout_ref.model.path}",
        "critic.model.use_remove_padding=false",
        "+critic.model.override_config.attn_implementation=sdpa",
        "critic.fsdp.strategy=fsdp2",
        "critic.fsdp.model_dtype=fp32",
        "+critic.fsdp.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        f"critic.ppo_micro_batch_size_per_gpu={BATCH}",
        "critic.optim.lr=1e-3",
        # no KL loss; the reference worker's KL in the reward, under the policy's GAE
        *KL_IN_REWARD_OVERRIDES,
        f"anchor_rl.vapo.lam_alpha={VAPO_LAM_ALPHA}",
    ],
}


DEVICES = ("cpu", "cuda")
STRATEGIES = ("fsdp2", "fsdp")


def overrides(
    out: Path, method: str, steps: int, device: str = "cpu", strategy: str = "fsdp2"
) -> list[str]:
    """The Hydra overrides of one launch: the CPU mode's settings (docs/integrations.md) on
    ``device="cpu"``; on ``"cuda"`` the same run on one real GPU (fp32, sdpa, no
    remove-padding, no torch.compile), with ``strategy`` ``fsdp2`` or ``fsdp`` (FSDP1, which
    the CPU mode refuses) for the actor, the reference and the critic."""
    if device not in DEVICES or strategy not in STRATEGIES:
        raise ValueError(f"device {device!r} not in {DEVICES} or strategy {strategy!r} not in "
                         f"{STRATEGIES}")  # fmt: skip
    if device == "cpu" and strategy != "fsdp2":
        raise ValueError("the CPU mode runs FSDP2 only (docs/integrations.md)")
    accelerator = (
        ["+ray_kwargs.ray_init.num_gpus=1"]  # a logical GPU places verl's workers on the CPU
        if device == "cpu"
        else ["actor_rollout_ref.actor.use_torch_compile=false"]
    )
    own = [o.split("=")[0] for o in METHOD_OVERRIDES[method]]
    base = [
        f"anchor_rl_method={method}",
        f"anchor_rl.store={out}/anchors_{method}.db",
        f"data.train_files={out}/train.parquet",
        f"data.val_files={out}/test.parquet",
        f"data.train_batch_size={BATCH}",
        f"data.max_prompt_length={PROMPT_LENGTH}",
        f"data.max_response_length={RESPONSE_LENGTH}",
        "data.dataloader_num_workers=0",
        "data.shuffle=false",
        f"reward.custom_reward_function.path={out}/reward.py",
        "reward.num_workers=1",  # verl starts 8 reward workers by default
        f"actor_rollout_ref.model.path={out}/model",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"actor_rollout_ref.actor.strategy={strategy}",
        f"actor_rollout_ref.ref.strategy={strategy}",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision="
        "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={BATCH}",
        "actor_rollout_ref.rollout.name=anchor_rl",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={BATCH}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={BATCH}",
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision="
        "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=2",
        f"trainer.default_local_dir={out}/checkpoints/{method}",
        "trainer.resume_mode=auto",
        "trainer.logger=[console,file]",
        *accelerator,
        "+ray_kwargs.ray_init.num_cpus=16",
        "+ray_kwargs.ray_init.include_dashboard=false",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    # a method's own value of a key wins (Hydra refuses a key given twice)
    return [
        *(o for o in base if o.split("=")[0] not in own),
        *(o.replace("=fsdp2", f"={strategy}") for o in METHOD_OVERRIDES[method]),
    ]


def launch(
    out: Path,
    method: str,
    steps: int,
    extra: Sequence[str] = (),
    timeout: float = 1800,
    device: str = "cpu",
    strategy: str = "fsdp2",
    probe: bool = False,
) -> subprocess.CompletedProcess:
    """One ``main_ppo`` launch in ``out`` (see the module docstring); its output is also in
    ``out/log_<method>_<steps>.txt``. The launch runs in its own process group, which is
    killed (Ray's processes included) when it outlives ``timeout`` seconds (return code 124).
    ``device`` and ``strategy``: :func:`overrides`; ``"cpu"`` sets ``VERL_PLATFORM=cpu``, and
    ``"cuda"`` removes it. ``probe``: every process of the launch loads :mod:`verl_probe`,
    which records each optimizer step and advantage stage in ``out/probe_<method>_<steps>``."""
    prepare(out)
    tag = f"{method}_{steps}"
    resumes = (out / "checkpoints" / method / "latest_checkpointed_iteration.txt").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RAY_ADDRESS"))}
    env.pop("VERL_PLATFORM", None)
    if device == "cpu":
        env["VERL_PLATFORM"] = "cpu"
    env.update(
        RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false", ANCHOR_RL_CACHE=str(out / "cache"),
        VERL_FILE_LOGGER_PATH=str(out / f"metrics_{tag}.jsonl"),
        SCORED_LOG=str(out / f"scored_{tag}.tsv"), HYDRA_FULL_ERROR="1",
        # no pool of idle Ray workers on 2 cores
        RAY_prestart_worker_first_driver="0", RAY_enable_worker_prestart="0",
        RAY_num_prestart_python_workers="0",
        # the drift rule's presampling: only a launch that presamples scores these first
        PRESAMPLED=str(0 if method == "vapo" or resumes else len(PROMPTS) * M),
    )  # fmt: skip
    if probe:
        folder = out / f"probe_{tag}"
        folder.mkdir(exist_ok=True)
        path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
        env.update(ANCHOR_RL_VERL_PROBE=str(folder), VERL_USE_EXTERNAL_MODULES="verl_probe",
                   PYTHONPATH=path)  # fmt: skip
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIG_DIR}",
           "--config-name=anchor_rl_qwen2.5_1.5b", *overrides(out, method, steps, device, strategy),
           *extra]  # fmt: skip
    log = out / f"log_{tag}.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
    return subprocess.CompletedProcess(cmd, code, log.read_text(), "")


def metrics(out: Path, method: str, steps: int) -> dict[int, dict[str, float]]:
    """The metrics one launch logged: step -> {name: value}."""
    path = out / f"metrics_{method}_{steps}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {int(d["step"]): d["data"] for d in map(json.loads, lines)}


if __name__ == "__main__":
    directory, method_, steps_ = Path(sys.argv[1]).resolve(), sys.argv[2], int(sys.argv[3])
    result = launch(directory, method_, steps_, sys.argv[4:])
    print(result.stdout[-4000:], f"exit {result.returncode}", sep="\n")
