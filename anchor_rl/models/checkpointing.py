"""Activation checkpointing (``optim.activation_checkpointing``) of the policy and the critic.

A checkpointed decoder layer keeps only its input for the backward pass and recomputes its
activations there (``torch.utils.checkpoint`` with ``use_reentrant=False``): the update's
activation memory drops from every layer's intermediate tensors to one hidden state per
layer, for about one extra forward pass of compute. The gradients are the same as without it
(the recomputation runs the same operations on the same inputs, under the same autocast
state; dropout's random state is replayed).

Every model the trainer trains is a Hugging Face ``PreTrainedModel`` (the built-in sizes are
``LlamaForCausalLM``; a critic's backbone is its body), so :func:`enable` switches on the
library's own per-layer checkpointing (``activation_checkpointing_enable``, or
``gradient_checkpointing_enable`` on the transformers releases that name it so). It applies
to every pass through the model's ``forward``: the padded and the packed scoring layouts.
The shared-prefix layout (:mod:`anchor_rl.models.shared_prefix`) runs the decoder layers
itself; it checkpoints each layer the same way where :func:`layer_checkpointed` says the
model asked for it. LoRA layers injected by :mod:`anchor_rl.models.lora` sit inside the
decoder layers and are checkpointed with them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from anchor_rl.errors import AnchorRLError

CHECKPOINT_KWARGS = {"use_reentrant": False}
"""``torch.utils.checkpoint`` options: the non-reentrant form (no input needs
``requires_grad``, so a LoRA model's frozen embeddings need no hook)."""


def enable(model: nn.Module) -> nn.Module:
    """Switch on per-layer activation checkpointing of ``model`` (a Hugging Face model: a
    causal LM or a critic's backbone) in place and return it. AnchorRLError naming the class
    when the model does not support it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise AnchorRLError(
            f"optim.activation_checkpointing: {type(model).__name__} does not support "
            "activation checkpointing (a Hugging Face model with supports_gradient_checkpointing); "
            "set optim.activation_checkpointing=false"
        )
    switch: Any = getattr(model, "activation_checkpointing_enable", None)
    if switch is not None:  # transformers >= 5.2x: the new name
        switch(activation_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    return model


def is_enabled(model: nn.Module) -> bool:
    """Whether any decoder layer of ``model`` is checkpointed (:func:`enable` was called)."""
    return any(layer_checkpointed(m) for m in model.modules())


def layer_checkpointed(layer: nn.Module) -> bool:
    """Whether ``layer`` (a decoder layer) asked for checkpointing: its ``gradient_checkpointing``
    flag, which :func:`enable` sets on every decoder layer."""
    return bool(getattr(layer, "gradient_checkpointing", False))
