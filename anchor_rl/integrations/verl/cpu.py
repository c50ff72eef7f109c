"""verl on the CPU: a ``cpu`` platform for verl's platform registry, chosen with ``VERL_PLATFORM=cpu``.

verl 0.9.1 resolves its device through :mod:`verl.plugin.platform` (``PlatformRegistry``,
picked by the ``VERL_PLATFORM`` variable or by probing the registered accelerators) and has
no CPU platform. This module registers one (``PlatformCPU``, :func:`register`), whose
probe always says "not here": verl's auto-detection never picks it, so a machine with GPUs
behaves as before.
It is used only when ``VERL_PLATFORM=cpu`` is set, and then :func:`activate` (run when the
plug-in loads, in every process that imports verl) also fills the gaps a CPU platform
alone leaves:

- **the process group**: verl's ``initialize_global_process_group_ray`` builds the backend
  ``cpu:gloo,{device}:{backend}``, i.e. ``cpu:gloo,cpu:gloo`` here, which torch rejects
  (duplicate device); with the CPU platform a call without a backend gets plain ``gloo``;
- **the engine registry**: verl registers its FSDP engines for ``cuda`` and ``npu`` only;
  the CPU mode registers the FSDP2 engine (``strategy=fsdp2``) for ``cpu`` as well. FSDP1
  (``strategy=fsdp``) keeps parameters on an accelerator and stays unregistered for ``cpu``,
  so verl refuses it with ``No engine registered for device='cpu'``;
- **the reference model's offload**: verl's FSDP engine shards every forward-only model (the
  reference of a KL loss or KL-in-reward) with ``CPUOffloadPolicy(pin_memory=True)``
  (``workers/engine/fsdp/transformer_impl.py``), hard-coded, and pinning host memory needs an
  accelerator; the CPU mode makes the engine's policy unpinned (``pin_memory=False``, the
  parameters stay in the host memory they are computed in), so a KL to the reference runs;
- **the critic's model**: verl's ``load_valuehead_model`` (``verl/utils/model.py``) loads a
  critic as ``AutoModelForTokenClassification`` with ``attn_implementation`` hard-coded to
  ``flash_attention_2``, which needs a GPU, and falls back to trl's value-head class, which
  trl 1.16 lacks; the CPU mode installs ``compat.value_model_loader`` (the same class with
  ``sdpa``, ``eager`` when the model's config asks for it), which ``compat.patch`` also
  installs on any machine without flash-attn.

The mode runs verl's whole loop in fp32, and the actor also in verl's bf16 mixed precision
(FSDP2 ``param_dtype=bf16`` over fp32 master weights, which torch runs on the CPU), with
``sdpa`` attention and without remove-padding (flash-attention's varlen kernels need a GPU):
the settings of docs/integrations.md, section "verl on a CPU".
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from anchor_rl.integrations.verl.compat import value_model_loader

__all__ = ["PLATFORM", "CPUDevice", "activate", "register", "requested"]

PLATFORM = "cpu"
"""The platform's name in verl's registry, and the value of ``VERL_PLATFORM`` that selects it."""


def requested() -> bool:
    """Whether this process asked verl for the CPU platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


class CPUDevice(ModuleType):
    """The ``torch.<device>`` namespace verl calls for the CPU: ``torch.cpu``'s own functions,
    plus the accelerator-only ones verl uses (memory statistics are 0, caches and RNG are the
    process's own)."""

    def __init__(self) -> None:
        super().__init__("anchor_rl_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """``(free, total)`` bytes of the host's memory."""
        import psutil

        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


_DEVICE = CPUDevice()


def _platform_class() -> type:
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """verl's platform interface on the host CPU: device ``cpu``, backend ``gloo``, Ray's
        ``GPU`` resource (declare logical GPUs with ``ray.init(num_gpus=N)`` to place verl's
        workers), no IPC, no profiler ranges."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return _DEVICE

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"  # verl passes it as a device: .to(...), device=..., torch.device(...)

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU


def register() -> type:
    """Register ``PlatformCPU`` under ``cpu`` in verl's platform registry (a platform of
    that name registered before, by verl or another plug-in, is kept). Returns the class
    registered under ``cpu``."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    existing = PlatformRegistry.get(PLATFORM)
    if existing is not None:
        return existing
    return PlatformRegistry.register(platform=PLATFORM)(_platform_class())


def _gloo(initialize: Any) -> Any:
    """``initialize`` (verl's process-group set-up) with ``gloo`` when no backend is given."""

    def initialize_global_process_group_ray(timeout_second: Any = None, backend: Any = None):
        return initialize(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray.__wrapped__ = initialize  # type: ignore[attr-defined]
    return initialize_global_process_group_ray


def _unpinned(policy: type) -> type:
    """``policy`` (torch's ``CPUOffloadPolicy``) with host memory never pinned."""

    class UnpinnedCPUOffloadPolicy(policy):  # type: ignore[misc, valid-type]
        def __init__(self, pin_memory: bool = False) -> None:
            super().__init__(pin_memory=False)

    UnpinnedCPUOffloadPolicy.__wrapped__ = policy  # type: ignore[attr-defined]
    return UnpinnedCPUOffloadPolicy


def activate() -> bool:
    """With ``VERL_PLATFORM=cpu``: the gloo process group, the FSDP2 engine for ``cpu``, the
    reference model's unpinned offload and the critic's model loader (module docstring). Returns whether the CPU mode is on; without the variable it changes
    nothing. Safe to call twice."""
    if not requested():
        return False
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if not hasattr(original, "__wrapped__"):
        patched = _gloo(original)
        distributed.initialize_global_process_group_ray = patched
        for name in ("verl.workers.engine_workers", "verl.workers.fsdp_workers"):
            module = sys.modules.get(name)
            if module is not None and hasattr(module, "initialize_global_process_group_ray"):
                module.initialize_global_process_group_ray = patched
    import verl.utils.model as model_utils

    if not hasattr(model_utils.load_valuehead_model, "__wrapped__"):
        model_utils.load_valuehead_model = value_model_loader(model_utils.load_valuehead_model)
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    policy = getattr(fsdp_engine, "CPUOffloadPolicy", None)
    if policy is not None and not hasattr(policy, "__wrapped__"):
        fsdp_engine.CPUOffloadPolicy = _unpinned(policy)
    from verl.workers.engine import EngineRegistry

    for model_type in ("language_model", "value_model"):
        engines = EngineRegistry._engines.get(model_type, {}).get("fsdp2", {})
        if "cuda" in engines:
            engines.setdefault("cpu", engines["cuda"])
    return True
