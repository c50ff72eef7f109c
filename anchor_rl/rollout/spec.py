"""Model specs: what the ``model`` and ``ref_model`` fields of the config name.

* a Hugging Face causal-LM directory (any path),
* ``sft:SIZE``: the SFT warm start of that size on the run's task (trained once, cached;
  see ``anchor_rl.models.sft.train_sft``; seed 0, so every seed of a sweep starts from
  the same reference; where the task's default stops SFT by its accuracy classes, the
  validation samples come from :func:`anchor_rl.rollout.evaluate.class_shares`),
* ``teacher:SIZE``: the task's built-in teacher of that size: SFT on every training record
  (no curriculum: multihop's 4-hop traces too), longer than the reference (trained once,
  cached; PVPO's ``pvpo.teacher = "hf:teacher:small"``),
* ``random:SIZE``: a random init of that size with the built-in tokenizer, seeded by the
  run's seed (for tests).

Spec resolution lives in the rollout layer, above ``models``, because training an
``sft:`` reference may sample from it (the class stop's validator).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.models.factory import SIZES, build_model
from anchor_rl.models.loading import load_policy, quiet_transformers
from anchor_rl.models.tokenizer import build_tokenizer


def load_spec(
    spec: str,
    task: str,
    task_args: dict[str, Any],
    seed: int,
    device: str,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model a spec names; AnchorRLError naming the spec if it is not one."""
    with quiet_transformers():
        return _load(spec, task, task_args, seed, device, progress)


def bare_url(spec: str) -> str | None:
    """What to write instead when a command that samples from served models (``eval``,
    ``presample``) is given a bare URL (``http://host:8000/v1``): a served model's spec is
    ``http:URL``, so ``http:http://host:8000/v1``. None for any other spec."""
    if not spec.startswith(("http://", "https://")):
        return None
    return (
        f"model {spec!r} is a bare URL; a served model's spec is http:URL[#MODEL]: "
        f"write http:{spec}"
    )


def _load(
    spec: str, task: str, task_args: dict[str, Any], seed: int, device: str, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kind, _, size = spec.partition(":")
    if kind in {"sft", "teacher", "random"} and size:
        if size not in SIZES:
            raise AnchorRLError(f"model {spec!r}: unknown size {size!r}; sizes: {', '.join(SIZES)}")
        if kind == "random":
            tokenizer = build_tokenizer()
            return build_model(size, tokenizer, seed=seed).to(device), tokenizer
        return load_policy(sft_model_dir(spec, task, task_args, progress), device=device)
    where = Path(spec)
    if (where / "adapter_config.json").is_file() and not (where / "config.json").is_file():
        raise AnchorRLError(
            f"model {spec!r} is a LoRA adapter, not a model: give its base model as the model "
            "and this directory as the adapter (anchor-rl eval/serve --adapter DIR)"
        )
    if not (Path(spec) / "config.json").is_file():
        raise AnchorRLError(
            f"model {spec!r} is neither a model directory (no config.json there) nor a spec "
            "like sft:tiny, teacher:small or random:tiny"
        )
    return load_policy(spec, device=device)


def sft_model_dir(spec: str, task: str, task_args: dict[str, Any], progress: bool = True) -> Path:
    """The directory of the model an ``sft:SIZE`` or ``teacher:SIZE`` spec names, trained
    first when it is not cached (:func:`anchor_rl.models.sft.train_sft` with the task's
    defaults; a class stop samples through :func:`anchor_rl.rollout.evaluate.class_shares`).
    AnchorRLError naming the sizes for any other spec."""
    from anchor_rl.models.sft import train_sft
    from anchor_rl.rollout.evaluate import class_shares

    kind, _, size = spec.partition(":")
    if kind not in {"sft", "teacher"} or size not in SIZES:
        raise AnchorRLError(
            f"model {spec!r} is not an sft:SIZE or teacher:SIZE spec; sizes: {', '.join(SIZES)}"
        )
    role = "teacher" if kind == "teacher" else "reference"
    kwargs = task_args or None
    _check_sft_data(spec, task, role, kwargs)
    return train_sft(
        task, size, task_kwargs=kwargs, progress=progress, role=role, validate=class_shares
    )


def _check_sft_data(spec: str, task: str, role: str, task_args: dict[str, Any] | None) -> None:
    """ConfigError, before any training, when the SFT that ``spec`` names cannot hold out its
    class stop's validation slice from the task's training records (``task_args.n_train``
    set low): with what to do instead."""
    from anchor_rl.models.sft import class_stop_shortfall, default_config, is_complete, sft_dir
    from anchor_rl.tasks import get_task

    size = spec.partition(":")[2]
    cfg = default_config(task, size, role, task_kwargs=task_args)
    if cfg.class_stop is None or is_complete(sft_dir(cfg), cfg):
        return
    try:
        records = get_task(task, **{**cfg.task_kwargs, **cfg.data_kwargs}).records("train")
    except (ValueError, TypeError):
        return  # the task's own error comes from the SFT, as before
    if why := class_stop_shortfall(cfg, len(records)):
        raise ConfigError(
            f"model={spec}: {why}. To train on fewer prompts keep the task and set "
            f"train_prompts=K instead (the {spec} reference stays the task's own), or use a "
            f"model directory or random:{size}"
        )


def load_reference(
    spec: str,
    tokenizer: PreTrainedTokenizerBase,
    task: str,
    task_args: dict[str, Any],
    seed: int,
    device: str,
    progress: bool = True,
) -> PreTrainedModel:
    """The frozen reference policy a spec names (:func:`load_spec`, then :func:`frozen`).

    AnchorRLError when its tokenizer's vocabulary differs from ``tokenizer`` (the policy's):
    a KL term, anchors or teacher log-probs compare the two models token by token.
    """
    model, ref_tokenizer = load_spec(spec, task, task_args, seed, device, progress)
    if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise AnchorRLError(
            f"the reference {spec!r} has a different tokenizer vocabulary from the policy's; "
            "the KL term, PVPO anchors and teacher log-probs need the same vocabulary"
        )
    return frozen(model)


def frozen(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` in eval mode with gradients off (a reference policy)."""
    model.eval()
    model.requires_grad_(False)
    return model
