"""LoRA policies through the ``peft`` library (the ``lora`` extra, imported on first use).

A LoRA run trains low-rank adapters injected into the policy's linear layers
(``peft.inject_adapter_in_model``): the policy stays its own class (``LlamaForCausalLM``...),
its projections become ``peft`` LoRA layers whose forward adds ``scale * B(A(x))`` to the
frozen base layer's output, so every forward pass of the project (the model's own, the
packed and shared-prefix scoring, the static decoder, which call the projections as modules)
applies the adapter. Only the adapters' parameters require gradients.

What the rest of the project gets from here:

* :func:`lora_base`: the base model with the adapters taken out, *sharing* the policy's base
  tensors (no second copy of the weights): the reference of the KL term and of PVPO's anchors.
* :func:`sampling_state`: what an engine in another process samples with: the policy's
  ``state_dict`` for a plain policy; for a LoRA policy the merged weights (``W + scale * B A``)
  under the plain model's names, computed one tensor at a time as the engine reads them
  (:class:`MergedState`). The in-process engine recognises its own model's and copies nothing.
* :func:`save_adapter` / :func:`load_adapter`: a PEFT-format adapter directory
  (``adapter_config.json``, ``adapter_model.safetensors``, the tokenizer): what a LoRA run's
  checkpoints hold, and what ``anchor-rl eval --adapter`` / ``serve --adapter`` read.
* :func:`lora_backbone`: a critic's backbone in a LoRA run: the base model's body, sharing the
  policy's base tensors, with adapters of its own.
* :func:`inert_lora_base`: the rule that a LoRA whose adapters add nothing (a fresh one)
  samples as its base model, shared by the anchor store's fingerprints.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.section import Section

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
INSTALL = "pip install 'anchor-rl[lora]'"
STORED_CONFIG = "lora_config.json"
"""``RUN_DIR/lora_config.json``: the PEFT config a run read from ``lora.config_file`` at its
start, which its resumes use instead of the file."""
STORED_LORA_CONTEXT = "lora_stored_config"
"""The validation-context key (``TrainConfig.model_validate(..., context=...)``) naming a
run's stored copy, read instead of ``lora.config_file``."""


class LoRAConfig(Section):
    """LoRA adapters instead of full fine-tuning (the `peft` library: `pip install
    'anchor-rl[lora]'`)."""

    rank: int = Field(0, ge=0)
    """r: the adapters' rank; 0 (the default) fine-tunes every weight."""
    alpha: float = Field(16.0, gt=0)
    """lora_alpha: the adapters' output is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input. `disable_dropout=true` (the default) switches it off
    with every other dropout, so a value above 0 needs `disable_dropout=false`."""
    target_modules: list[str] | str = "all-linear"
    """The modules that get an adapter: `all-linear` (every linear layer but the output
    layer), or module names (`["q_proj", "v_proj"]`)."""
    config_file: str | None = None
    """A PEFT LoRA config (a JSON file, or a directory holding adapter_config.json) used
    instead of rank, alpha, dropout and target_modules (which then stay at their defaults).
    Read once, when the run starts: the run keeps a copy (RUN_DIR/lora_config.json) that
    its resumes use."""

    _file: dict[str, Any] | None = PrivateAttr(None)
    """The PEFT config read from ``config_file`` (or a resumed run's stored copy) when the
    section was validated."""

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> LoRAConfig:
        own = [k for k in ("alpha", "dropout", "target_modules") if k in self.model_fields_set]
        own = [k for k in own if getattr(self, k) != type(self).model_fields[k].default]
        if self.config_file is not None:
            if self.rank or own:
                names = ", ".join(f"lora.{k}" for k in (["rank"] if self.rank else []) + own)
                raise ValueError(
                    f"{names} with lora.config_file: the file sets the adapters; drop {names}"
                )
            stored = (info.context or {}).get(STORED_LORA_CONTEXT)
            self._file = read_config_file(stored or self.config_file)
        elif own and not self.rank:
            names = ", ".join(f"lora.{k}" for k in own)
            raise ValueError(
                f"{names} has no effect with lora.rank=0 (full fine-tuning): set lora.rank, "
                f"e.g. lora.rank=8, or drop {names}"
            )
        if self.enabled and importlib.util.find_spec("peft") is None:
            raise ValueError(f"lora needs the peft library, which is not installed: {INSTALL}")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the run trains adapters (a rank, or a config file)."""
        return self.rank > 0 or self.config_file is not None

    @property
    def file_config(self) -> dict[str, Any] | None:
        """The PEFT config ``config_file`` held when the section was validated (a resumed
        run's: the copy the run stored at its start); None without a file."""
        if self.config_file is None:
            return None
        if self._file is None:  # built without validation (model_construct)
            self._file = read_config_file(self.config_file)
        return dict(self._file)


def store_file_config(lc: LoRAConfig, run_dir: str | Path) -> Path | None:
    """Write the PEFT config of ``lc.config_file`` (as read when the config was validated)
    to ``RUN_DIR/lora_config.json``, the copy a resume reads; None without a file."""
    data = lc.file_config
    return None if data is None else _write_config(data, run_dir)


def _write_config(data: dict[str, Any], directory: str | Path) -> Path:
    path = Path(directory) / STORED_CONFIG
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path


def stored_file_config(run_dir: str | Path) -> Path | None:
    """The run's stored PEFT config (:func:`store_file_config`), or None when it has none."""
    path = Path(run_dir) / STORED_CONFIG
    return path if path.is_file() else None


def check_same_file_config(given: str, stored: Path) -> None:
    """ConfigError unless the PEFT config at ``given`` (a ``lora.config_file`` named on a
    resume's command line) equals the run's ``stored`` copy, naming the keys that differ."""
    try:
        new = read_config_file(given)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    old = read_config_file(stored)
    differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if differ:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ[:4])
        raise ConfigError(
            f"lora.config_file={given!r} differs from the LoRA config this run started with "
            f"(kept in {stored}; {shown}): a resumed run trains the adapters it started with. "
            "Drop lora.config_file to resume, or start a new run with --out"
        )


def lora_context(data: dict[str, Any] | None, directory: str | Path) -> dict[str, str] | None:
    """The validation context (``build_config(table, context)``) that makes a config's
    ``lora.config_file`` read ``data`` (a PEFT config as another process read it, written to
    ``directory``) instead of the file; None when ``data`` is None."""
    return None if data is None else {STORED_LORA_CONTEXT: str(_write_config(data, directory))}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON of a PEFT LoRA config (a file, or a directory's ``adapter_config.json``),
    checked: ValueError naming the file when it is missing, not LoRA, or trains the base
    layers' biases (``bias`` other than ``none``: the reference shares those tensors)."""
    path = Path(path)
    file = path / ADAPTER_CONFIG if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"lora.config_file={str(path)!r}: cannot read a PEFT config: {exc}"
        ) from None
    if not isinstance(data, dict) or str(data.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"lora.config_file={str(path)!r} is not a LoRA config (peft_type LORA)")
    if data.get("bias", "none") != "none":
        raise ValueError(
            f"lora.config_file={str(path)!r} sets bias={data['bias']!r}: training the base "
            "layers' biases would move the reference, which shares them; use bias='none'"
        )
    if not data.get("r"):
        raise ValueError(f"lora.config_file={str(path)!r} has no rank r > 0")
    return data


def lora_errors(cfg: Any) -> list[str]:
    """The settings a LoRA run refuses (``cfg``: a TrainConfig), each naming the fix."""
    lc = cfg.lora
    if not lc.enabled:
        return []
    errors = []
    if lc.dropout > 0 and cfg.disable_dropout:
        errors.append(
            f"lora.dropout={lc.dropout} has no effect: disable_dropout=true switches every "
            "dropout off; set disable_dropout=false, or drop lora.dropout"
        )
    return errors


def require_peft() -> Any:
    """The ``peft`` module; AnchorRLError with the install command when it is missing."""
    try:
        import peft
    except ImportError:
        raise AnchorRLError(f"LoRA needs the peft library: {INSTALL}") from None
    return peft


def peft_config(lc: LoRAConfig) -> Any:
    """The ``peft.LoraConfig`` of the ``lora`` section (its settings, or its file)."""
    peft = require_peft()
    data = lc.file_config
    if data is not None:
        known = set(peft.LoraConfig.__dataclass_fields__)
        return peft.LoraConfig(**{k: v for k, v in data.items() if k in known})
    target = lc.target_modules
    return peft.LoraConfig(
        r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
        target_modules=target if isinstance(target, str) else list(target), bias="none",
    )  # fmt: skip


def apply_lora(model: PreTrainedModel, lc: LoRAConfig, seed: int = 0) -> PreTrainedModel:
    """``model`` with fresh adapters injected in place (``peft.inject_adapter_in_model``) and
    returned; only the adapters require gradients. The A factors are drawn from a generator
    seeded by ``seed`` (the global random stream is left as it was); the B factors are zero,
    so the policy starts as its base model. ``model`` itself when the section is off."""
    import torch

    if not lc.enabled:
        return model
    peft = require_peft()
    with torch.random.fork_rng(devices=[]):  # peft draws A on the CPU, then moves it
        torch.random.default_generator.manual_seed(seed)  # the CPU's alone: CUDA's untouched
        try:
            peft.inject_adapter_in_model(peft_config(lc), model)
        except ValueError as exc:  # e.g. target modules the model does not have
            raise AnchorRLError(f"lora: {exc}") from None
    return model


def is_lora(model: Any) -> bool:
    """Whether ``model`` (or the PEFT wrapper's base model) carries LoRA layers."""
    if not hasattr(model, "peft_config"):
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return any(_is_lora_layer(m) for m in base.modules())


def _is_lora_layer(module: Any) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "get_base_layer")


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimiser steps: those requiring gradients for a LoRA policy (its
    adapters), every parameter otherwise."""
    if is_lora(model):
        return [p for p in model.parameters() if p.requires_grad]
    return list(model.parameters())


def _unwrap(model: torch.nn.Module, merge: bool) -> torch.nn.Module:
    """Replace, in place, every LoRA layer of ``model`` by its base layer (merged with the
    adapter first when ``merge``) and every ``modules_to_save`` wrapper by its active copy
    (``merge``) or its original; drop the PEFT markers. Returns ``model``."""
    swaps = []
    for name, module in model.named_modules():
        if _is_lora_layer(module):
            if merge:
                module.merge(safe_merge=False)
            swaps.append((name, module.get_base_layer()))
        elif hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            active = getattr(module, "active_adapter", "default")
            active = active[0] if isinstance(active, list | tuple) else active
            swaps.append(
                (name, module.modules_to_save[active] if merge else module.original_module)
            )
    for name, replacement in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in vars(model):
            delattr(model, attr)
    return model


def lora_base(model: PreTrainedModel) -> PreTrainedModel:
    """The base model of a LoRA policy, adapters taken out, in eval mode, taking no gradient:
    a second module tree over the *same* parameter tensors as the policy's base layers (the
    module structure and the small buffers are copied, no weight is). The KL reference and
    PVPO's presampling reference of a LoRA run: it is exactly the policy with its adapters
    disabled, and it hashes as the base model (:func:`anchor_rl.anchors.keys.fingerprint_model`).
    """
    memo: dict[int, Any] = {id(p): p for p in model.parameters()}
    base = _unwrap(copy.deepcopy(model, memo), merge=False)
    if any(p.requires_grad for p in base.parameters()):
        raise AnchorRLError(
            "the LoRA policy trains some of its base tensors (bias or modules outside the "
            "adapters), which the reference shares: use bias='none'"
        )
    return base.eval()


def lora_backbone(model: PreTrainedModel, lc: LoRAConfig, seed: int) -> PreTrainedModel:
    """The body (``base_model``, e.g. ``LlamaModel``) of a LoRA policy's base model with fresh
    adapters of its own (the ``lora`` section's, A drawn from ``seed``, B zero) and only those
    requiring gradients: a critic's backbone in a LoRA run. Its base tensors *are* the
    policy's frozen ones (:func:`lora_base`: no copy of the weights); the policy's adapters
    are not in it."""
    backbone = lora_base(model).train().base_model
    return apply_lora(backbone, lc, seed)


def merge_adapter(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` with its adapters merged into its weights in place and taken out: a plain
    model that samples as the LoRA policy did (what ``eval`` and ``serve`` run with
    ``--adapter``). Returns ``model``."""
    return _unwrap(model, merge=True) if is_lora(model) else model


def merged_copy(model: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A plain copy of a LoRA policy with the adapters merged into its weights (``W + scale *
    B A``, merged in the policy's precision, then held in ``dtype``, default the policy's:
    another copy of the weights, made one tensor at a time), taking no gradient; a copy of
    any other model (``dtype`` unused: the caller casts it)."""
    import torch

    grads = {p: p.grad for p in model.parameters()}
    try:
        for p in grads:
            p.grad = None
        if not is_lora(model):
            return copy.deepcopy(model).requires_grad_(False)
        memo: dict[int, Any] = {
            id(p): torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True), False)
            for p in model.parameters()
        }
        twin = _unwrap(copy.deepcopy(model, memo), merge=False)
    finally:
        for p, g in grads.items():
            p.grad = g
    MergedState(model).copy_into(twin)  # every plain weight, merged where adapted
    return twin.requires_grad_(False)


class MergedState(Mapping):
    """The merged weights of a LoRA policy as a read-only state dict under the plain model's
    names: ``q_proj.weight`` is ``base_layer.weight + scale * B @ A`` (computed when read:
    one merged tensor at a time, nothing held here), other entries are the model's own tensors
    (``.base_layer.`` dropped from their names, adapters and original copies left out).

    source: the LoRA model these are the weights of (an in-process engine on that same model
    samples with the adapters applied already, and copies nothing).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.source = model
        self._layers: dict[str, Any] = {}
        for name, module in model.named_modules():
            if _is_lora_layer(module):
                self._layers[f"{name}.weight" if name else "weight"] = module
        self._state = model.state_dict()  # references to the model's tensors, no copies
        self._names: dict[str, str] = {}
        for name in self._state:
            if ".lora_" in name or "original_module" in name or "lora_magnitude" in name:
                continue
            self._names[_drop_saved_copy(name.replace(".base_layer.", "."))] = name

    def __getitem__(self, key: str) -> torch.Tensor:
        import torch

        tensor = self._state[self._names[key]]
        module = self._layers.get(key)
        if module is None:
            return tensor
        with torch.no_grad():
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            return (tensor + delta).to(tensor.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def copy_into(self, model: torch.nn.Module) -> None:
        """Copy these weights into ``model`` (a plain model of the same architecture, any
        dtype) in place, one merged tensor at a time (``load_state_dict`` would build them
        all first); KeyError naming the names that differ."""
        import torch

        own = model.state_dict(keep_vars=True)
        if own.keys() != self._names.keys():
            differ = sorted(set(own) ^ set(self._names))
            raise KeyError(f"the merged weights and the model differ in {differ[:5]}")
        with torch.no_grad():
            for name in self._names:
                own[name].copy_(self[name])

    def __len__(self) -> int:
        return len(self._names)


def _drop_saved_copy(name: str) -> str:
    """``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``."""
    head, sep, tail = name.partition(".modules_to_save.")
    return f"{head}.{tail.partition('.')[2]}" if sep else name


def sampling_state(model: PreTrainedModel) -> Mapping[str, torch.Tensor]:
    """What an engine samples ``model`` with (``Engine.sync_weights``): ``model.state_dict()``,
    or a LoRA policy's :class:`MergedState`."""
    return MergedState(model) if is_lora(model) else model.state_dict()


def save_adapter(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | Path
) -> Path:
    """Write a LoRA model's adapter as a PEFT adapter directory (``adapter_config.json``,
    ``adapter_model.safetensors``: the adapters' tensors only) with the tokenizer (a critic's
    backbone has none: None)."""
    from safetensors.torch import save_file

    peft = require_peft()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = peft.get_peft_model_state_dict(model, adapter_name="default")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, path / ADAPTER_WEIGHTS)
    model.peft_config["default"].save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter directory (an ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_adapter(model: PreTrainedModel, path: str | Path) -> PreTrainedModel:
    """``model`` (the base model) with the adapter saved in ``path`` injected, in place, its
    tensors loaded exactly; AnchorRLError naming the directory when it is no adapter or does
    not fit the model."""
    from safetensors.torch import load_file

    peft = require_peft()
    path = Path(path)
    if not is_adapter_dir(path):
        raise AnchorRLError(f"{path} is not a LoRA adapter directory (no {ADAPTER_CONFIG})")
    config = peft.LoraConfig.from_pretrained(str(path))
    weights = path / ADAPTER_WEIGHTS
    try:
        state = load_file(weights)
        peft.inject_adapter_in_model(config, model)
        result = peft.set_peft_model_state_dict(model, state, adapter_name="default")
    except (OSError, ValueError, RuntimeError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 and "Error(s)" in lines[0] else lines[0]
        raise AnchorRLError(
            f"the adapter in {path} does not fit this base model ({first}; {len(lines)} "
            "problems): give the base model it was trained on"
        ) from None
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise AnchorRLError(
            f"the adapter in {path} does not fit this base model (missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}): give the base model it was "
            "trained on"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    return model


def inert_lora_base(model: torch.nn.Module) -> tuple[str, dict[str, Any]] | None:
    """``(class name, state dict)`` of a LoRA model's base model with its LoRA layers taken
    out (``q_proj.base_layer.weight`` read as ``q_proj.weight``, the adapters' tensors
    dropped), when the adapters change no output: LoRA only, every ``lora_B`` and
    ``lora_embedding_B`` factor zero (as a fresh LoRA's), no DoRA magnitudes and no
    ``modules_to_save`` copies. A PEFT wrapper (``get_peft_model``) and a model with adapters
    injected in place (a LoRA run's policy) both count. None for any other model."""
    if not hasattr(model, "peft_config"):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    plain: dict[str, Any] = {}
    adapters = False
    for name, tensor in base.state_dict().items():
        if "lora_magnitude" in name or "modules_to_save" in name or "original_module" in name:
            return None
        if ".lora_" not in name:
            plain[name.replace(".base_layer.", ".")] = tensor
            continue
        adapters = True
        if ("lora_B" in name or "lora_embedding_B" in name) and bool(tensor.detach().any()):
            return None
    return (type(base).__name__, plain) if adapters else None
