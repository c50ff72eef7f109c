"""The machine a benchmark ran on: the device by name, torch's threads, library versions."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def host_info(device: str) -> dict[str, Any]:
    """The device by name, torch's thread count and the library versions."""
    import torch

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = _cpu_name()
    versions = {}
    for package in ("torch", "transformers", "trl", "accelerate"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "device": device,
        "device_name": name,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
