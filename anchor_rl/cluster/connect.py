"""Joining Ray: start it in this process, join a running cluster, or refuse clearly.

Ray is imported only when an engine is built, so the package (and the ``ray`` engine's
registration) works without Ray installed; ``pip install ray`` is needed to use it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
"""How long the reachability check of an explicit address waits for a TCP connection."""

GCS_PORT, CLIENT_PORT = 6379, 10001
"""Default ports: a cluster's GCS (``ray start --head``) and the Ray client (``ray://``)."""


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError saying how to get it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "the 'ray' engine needs Ray: pip install 'ray>=2.40' (or the dev extra)"
        ) from exc
    return ray


def local_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def connect(address: str, cpus_needed: float) -> None:
    """Make sure this process is connected to Ray, as ``address`` asks.

    address: ``local`` starts Ray in this process with ``num_cpus`` = this machine's cores
        (at least ``cpus_needed``, so the requested workers fit), unless this process is
        connected already (then that Ray is used, e.g. a second engine's or a test's);
        ``auto`` joins the cluster a ``ray start --head`` on this machine started;
        anything else (``HOST:PORT``, ``ray://HOST:PORT``) is that cluster's address, checked
        for reachability first (a ConnectionError naming it instead of Ray's long retries).
    """
    ray = import_ray()
    if not isinstance(address, str) or not address.strip():
        raise ValueError(
            f"rollout.engine_args.address must be 'local', 'auto' or a cluster address "
            f"(HOST:PORT), got {address!r}"
        )
    address = address.strip()
    if ray.is_initialized():
        if address in ("local", "auto"):
            return
        current = ray.get_runtime_context().gcs_address
        if _host_port(address, GCS_PORT) != _host_port(current, GCS_PORT):
            raise ValueError(
                f"this process is connected to the Ray cluster at {current!r} already; it "
                f"cannot also join {address!r} (one Ray connection per process)"
            )
        return
    if address == "local":
        num_cpus = max(local_cpus(), math.ceil(cpus_needed))
        logger.info("starting Ray in this process with %d CPUs", num_cpus)
        ray.init(
            address="local",  # a new instance, even where `ray start` runs a cluster
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
        return
    if address == "auto":
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise ConnectionError(
                "rollout.engine_args.address='auto' found no running Ray cluster on this "
                "machine: start one with `ray start --head` (and `ray start --address "
                "HEAD:6379` on the other machines), or use address=local "
                f"({exc})"
            ) from None
        return
    default = CLIENT_PORT if address.startswith("ray://") else GCS_PORT
    host, port = _host_port(address, default)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach the Ray cluster at rollout.engine_args.address={address!r} "
            f"({host}:{port}: {exc or type(exc).__name__}); start it with `ray start --head "
            f"--port={port}` on that machine, check the address and the firewall, or use "
            "address=local"
        ) from None
    ray.init(address=address, logging_level=logging.WARNING)


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    """``(host, port)`` of ``HOST[:PORT]`` or ``SCHEME://HOST[:PORT]``."""
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"cannot read a port in the Ray address {address!r}") from None
    if not parts.hostname:
        raise ValueError(f"cannot read a host in the Ray address {address!r}")
    return parts.hostname, port or default_port
