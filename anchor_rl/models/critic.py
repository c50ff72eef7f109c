"""A value model ``V(s_t)`` for PPO and VAPO: a causal-LM backbone with a scalar head.

Shapes: ``B`` responses, ``T`` response tokens, ``H`` hidden size.

Alignment. The state before response token ``t`` is ``s_t = prompt + response[:t]``, and
``V(s_t)`` is read from the backbone's last hidden state at the position of the last token
of ``s_t`` -- the position whose logits predict token ``t`` in
:func:`anchor_rl.models.scoring.token_logprobs`. So ``values[:, 0]`` comes from the last
prompt token and ``values[:, t]`` depends on the prompt and ``response[:t]`` only, never
on token ``t`` itself or anything after it. ``values[b, t]`` and ``logp[b, t]`` therefore
describe the same decision: the state, and the action taken in it.

Initialisation. The backbone starts as a copy of a causal LM's body (its ``lm_head`` is
dropped); we use the SFT reference policy. The VAPO paper initialises its critic from a
reward model, which this project does not have; value pretraining
(:mod:`anchor_rl.models.value_pretrain`) then fits it to the reference policy's returns.
The head ``nn.Linear(H, 1)`` is zero-initialised (weight and bias), so an untrained
critic predicts 0 everywhere and its first gradient steps move the head only (the
backbone's gradient is proportional to the head weight). The head is kept in float32
and reads the hidden state cast to float32.

Modes.

* ``separate`` (default, what PPO and VAPO use): the critic owns a full copy of the
  backbone; ``critic.parameters()`` are that copy plus the head. In a LoRA run the
  backbone is instead the LoRA policy's base model's body with adapters of its own
  (:func:`anchor_rl.models.lora.lora_backbone`): its base tensors are the policy's frozen
  ones, and only the adapters and the head require gradients (and are saved).
* ``shared``: the critic reads the policy's own backbone module (no copy; it sees every
  policy update). ``critic.parameters()`` are the head only. The backbone runs under
  ``torch.no_grad()`` for the critic, so the value loss never reaches the policy's
  weights: the critic is a linear probe on the current policy's features and the policy
  is trained by the policy loss alone. The trainer may therefore add the value loss to
  the policy's loss terms in one backward or run it in its own backward -- the gradients
  are the same either way -- and steps the critic's optimiser (head only) and the
  policy's optimiser independently, so the value loss never reshapes the policy between
  its ratio computations. The probe costs one extra gradient-free backbone forward per value
  call and keeps no backbone activations for backward. The policy's train/eval mode is
  left as the trainer set it.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from anchor_rl.models.lora import is_lora, load_adapter, lora_base, save_adapter
from anchor_rl.models.scoring import (
    pack_prompt_response,
    packed_inputs,
    packing_supported,
    pass_layout,
)
from anchor_rl.models.shared_prefix import (
    SharedPrefixLayout,
    shared_prefix_states,
    shared_prefix_unsupported,
)

if TYPE_CHECKING:
    from anchor_rl.batch import RolloutBatch

CriticMode = Literal["separate", "shared"]
MODES: tuple[str, ...] = get_args(CriticMode)

CONFIG_FILE = "critic.json"
HEAD_FILE = "value_head.safetensors"
BACKBONE_DIR = "backbone"
ADAPTER_DIR = "backbone_adapter"
FORMAT_VERSION = 1


class Critic(nn.Module):
    """Backbone + scalar value head; see the module docstring for alignment and modes.

    Build one with :meth:`from_causal_lm` (from the reference policy) or :meth:`load` (a
    saved critic). The constructor takes a backbone directly: a base model whose output
    has ``last_hidden_state`` (e.g. ``LlamaModel``, a causal LM's ``.base_model``).

    Attributes:
        mode: ``"separate"`` or ``"shared"``.
        base_path: the causal-LM directory the backbone came from, or None if unknown.
        backbone: the backbone module (registered as a submodule in ``separate`` mode
            only, so that ``parameters()``, ``state_dict()`` and ``.to()`` leave the
            policy's shared backbone alone).
        head: ``nn.Linear(H, 1)``, float32, on the backbone's device.
    """

    def __init__(
        self, backbone: PreTrainedModel, mode: CriticMode = "separate", base_path: str | None = None
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown critic mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode = mode
        self.base_path = base_path
        if mode == "separate":
            self.backbone = backbone
        else:
            # A plain attribute, not a submodule: the policy owns these weights.
            object.__setattr__(self, "backbone", backbone)
        device = next(backbone.parameters()).device
        # the layouts the values may be read in where the backbone allows, chosen per pass
        # as the policy's are (scoring.pass_layout): packed (optim.padding_free), and each
        # distinct prompt run once for the responses that share it (optim.shared_prefix; off
        # for an FSDP-sharded replica, whose layers must be called whole)
        self.padding_free = True
        self.shared_prefix = True
        self.head = nn.Linear(backbone.config.hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_causal_lm(
        cls,
        source: str | os.PathLike | PreTrainedModel,
        mode: CriticMode = "separate",
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Critic:
        """A fresh critic (zero head) on the body of a causal LM.

        ``source`` is a causal-LM directory (any Hugging Face checkpoint; its body is loaded
        with ``AutoModel``, the ``lm_head`` is not) or a loaded causal LM. ``separate`` mode
        copies the body; ``shared`` mode needs the live policy model and uses its body
        as is (``device`` and ``dtype`` must then be None: the policy decides them).
        ``dtype`` None keeps the checkpoint's (or the model's) dtype.
        """
        if isinstance(source, PreTrainedModel):
            base_path = source.name_or_path or None
            if mode == "shared":
                if device is not None or dtype is not None:
                    raise ValueError(
                        "a shared critic uses the policy's device and dtype; pass neither"
                    )
                return cls(source.base_model, "shared", base_path)
            backbone = copy.deepcopy(source.base_model)
        else:
            if mode == "shared":
                raise ValueError(
                    "a shared critic needs the live policy model, not a path; pass the model"
                )
            base_path = str(source)
            backbone = AutoModel.from_pretrained(base_path, dtype=dtype)
        backbone.requires_grad_(True)
        backbone.to(device=device, dtype=dtype)
        return cls(backbone, mode, base_path)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def values(self, batch: RolloutBatch, micro_batch: int | None = None) -> torch.Tensor:
        """``V(s_t)`` for every response position: ``[B, T]`` float32 on the critic's device.

        ``values[b, t]`` is computed from ``prompt_ids[b] + response_ids[b, :t]`` (see the
        module docstring) and is 0 where ``batch.attention_mask`` is 0. Tool-output
        positions get values too (masking them out of losses is the caller's job).
        Gradients flow into ``self.parameters()`` when called with grad enabled.
        ``micro_batch`` bounds the rows per backbone forward.
        """
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        empty = [i for i, p in enumerate(batch.prompt_ids) if not p]
        if empty:
            raise ValueError(f"rows {empty[:5]} have empty prompts; V(s_0) needs a prompt token")
        b = len(batch)
        step = micro_batch or b
        if step >= b:
            return self._values(batch)
        return torch.cat(
            [self._values(batch.select(range(i, min(i + step, b)))) for i in range(0, b, step)]
        )

    def forward(self, batch: RolloutBatch) -> torch.Tensor:
        """:meth:`values` of ``batch`` in one pass (``[B, T]``): what a wrapper that hooks a
        module's forward, such as ``DistributedDataParallel``, calls."""
        return self.values(batch)

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        grad = torch.is_grad_enabled() and self.mode == "separate"
        kind = self.layout(batch)
        if kind == "padded":
            # Same layout as token_logprobs: [pad.. prompt | response ..pad], positions count
            # real tokens, so the hidden state at column c sees exactly the real tokens at
            # columns <= c; no columns past the longest response (a micro-batch's T).
            width, batch = batch.response_ids.shape[1], batch.trimmed()
            ids, mask, positions = pack_prompt_response(batch, self.device)
            response_mask = batch.attention_mask.to(self.device)
            t = batch.response_ids.shape[1]
            with torch.set_grad_enabled(grad):
                hidden = self.backbone(
                    input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
                ).last_hidden_state
            # Column P + t - 1 (P = padded prompt width) ends s_t: the last T + 1 columns but one.
            state = hidden[:, -(t + 1) : -1, :].to(self.head.weight.dtype)
            values = self.head(state).squeeze(-1) * response_mask.to(self.head.weight.dtype)
            return nn.functional.pad(values, (0, width - t))
        # the states that predict response token t end s_t (anchor_rl.models.scoring)
        with torch.set_grad_enabled(grad):
            if kind == "shared":
                layout = SharedPrefixLayout.of(batch).to(self.device)
                states = shared_prefix_states(self.backbone, layout)  # [N, H]
                row_of, t_of = layout.row_of, layout.t_of
            else:
                ids, positions, select, row_of, t_of = packed_inputs(batch, self.device)
                out = self.backbone(input_ids=ids, position_ids=positions, use_cache=False)
                states = out.last_hidden_state[select]  # [N, H]
        flat = self.head(states.to(self.head.weight.dtype)).squeeze(-1)  # [N]
        zeros = torch.zeros(batch.response_ids.shape, device=self.device, dtype=flat.dtype)
        return zeros.index_put((row_of.to(self.device), t_of.to(self.device)), flat)

    def layout(self, batch: RolloutBatch) -> str:
        """The layout :meth:`values` reads ``batch`` in (one pass): ``"padded"``,
        ``"packed"`` or ``"shared"``, by :func:`~anchor_rl.models.scoring.pass_layout` with
        :attr:`padding_free` and :attr:`shared_prefix` on (its defaults) or off, and what the
        backbone allows: on the CPU shared prefixes where a prompt repeats, else packed; on
        a GPU padded unless packing pays."""
        return pass_layout(
            batch,
            None if self.padding_free else False,
            None if self.shared_prefix else False,
            packing_supported(self.backbone, head=False),
            shared_prefix_unsupported(self.backbone, head=False) is None,
            self.device,
            sum(p.numel() for p in self.backbone.parameters()),
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write the critic to directory ``path``.

        ``critic.json`` (mode, base path, hidden size, format version), the head in
        ``value_head.safetensors`` and, in ``separate`` mode, the backbone as a Hugging Face
        model directory ``backbone/`` (safetensors + config). A shared critic saves its
        head only; the backbone is the policy's and is saved with it.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        head = {
            k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in self.head.state_dict().items()
        }
        save_file(head, str(path / HEAD_FILE))
        lora = self.mode == "separate" and is_lora(self.backbone)
        if lora:  # the adapters only: the base tensors are the LoRA policy's base model's
            save_adapter(self.backbone, None, path / ADAPTER_DIR)
        elif self.mode == "separate":
            self.backbone.save_pretrained(path / BACKBONE_DIR)
        config = {
            "format": FORMAT_VERSION,
            "mode": self.mode,
            "base_path": self.base_path,
            "hidden_size": self.head.in_features,
            **({"lora": True} if lora else {}),
        }
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        policy: PreTrainedModel | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> Critic:
        """Read a critic written by :meth:`save`.

        A ``shared`` critic needs ``policy`` (the live causal LM whose body it reads; it must
        have the saved hidden size) and lives on the policy's device. A ``separate`` critic
        ignores ``policy``, loads its own backbone and is moved to ``device`` / ``dtype``
        (None keeps the saved dtype, CPU); one saved as adapters (a LoRA run's) needs the
        LoRA ``policy``, whose base tensors it shares, and lives on its device.
        """
        path = Path(path)
        config_path = path / CONFIG_FILE
        if not config_path.is_file():
            raise FileNotFoundError(f"no saved critic at {path} (missing {CONFIG_FILE})")
        config = json.loads(config_path.read_text())
        if config.get("format") != FORMAT_VERSION:
            raise ValueError(f"{config_path}: unsupported critic format {config.get('format')!r}")
        mode = config["mode"]
        if mode == "shared":
            if policy is None:
                raise ValueError(f"the critic at {path} shares the policy's backbone; pass policy=")
            if policy.config.hidden_size != config["hidden_size"]:
                raise ValueError(
                    f"policy hidden size {policy.config.hidden_size} != saved critic's {config['hidden_size']}"
                )
            critic = cls(policy.base_model, "shared", config["base_path"])
        elif config.get("lora"):  # adapters on the LoRA policy's base model's body
            if policy is None or not is_lora(policy):
                raise ValueError(
                    f"the critic at {path} is adapters on a LoRA policy's base model; pass the "
                    "LoRA policy as policy="
                )
            backbone = load_adapter(lora_base(policy).train().base_model, path / ADAPTER_DIR)
            critic = cls(backbone, "separate", config["base_path"])
        else:
            backbone = AutoModel.from_pretrained(path / BACKBONE_DIR, dtype=dtype)
            backbone.to(device=device)
            critic = cls(backbone, "separate", config["base_path"])
        critic.head.load_state_dict(load_file(str(path / HEAD_FILE), device=str(critic.device)))
        return critic
