"""Joining Ray: start it in this process, join a running cluster, or refuse clearly.

Ray is imported only when an engine is built, so the package (and the ``ray`` engine's
registration) works without Ray installed; ``pip install ray`` is needed to use it.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from anchor_rl.errors import ConfigError
from anchor_rl.interrupt import reclaim_signals

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
        reclaim_signals()  # ray.init installed its own SIGTERM handler
        return
    if address == "auto":
        try:
            ray.init(address="auto", logging_level=logging.WARNING)
            reclaim_signals()
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
    reclaim_signals()


class WorkerSet(NamedTuple):
    """One set of Ray rollout workers a run holds: whose model they sample (``name``, for
    messages), how many, and the CPUs and GPUs each reserves."""

    name: str
    workers: int
    cpus: float
    gpus: float


def check_local_fit(address: str, sets: Sequence[WorkerSet], workers_option: str) -> None:
    """Before a run builds anything: when ``address`` is ``local`` and this process is not
    connected to Ray yet, start Ray as the first engine would (:func:`connect`, sized for the
    largest set) and refuse at once, shutting that Ray down, worker ``sets`` that cannot all
    be held together (:func:`check_fit`): the last set's workers would otherwise wait
    ``startup_timeout`` for resources the first hold. A Ray this process is connected to
    already, or a cluster (``auto``, an address), is left unchecked: it may grow."""
    if not sets or not isinstance(address, str) or address.strip() != "local":
        return
    ray = import_ray()
    if ray.is_initialized():
        return
    connect("local", max(s.workers * s.cpus for s in sets))
    try:
        check_fit(sets, ray.cluster_resources(), workers_option, cores=local_cpus())
    except ConfigError:
        ray.shutdown()
        raise


def check_fit(
    sets: Sequence[WorkerSet],
    total: Mapping[str, float],
    workers_option: str,
    cores: int | None = None,
) -> None:
    """ConfigError unless the worker ``sets`` fit ``total`` (Ray's ``cluster_resources()``)
    together, for CPUs and GPUs; the message names each set's need and the fix: the
    ``num_cpus_per_worker`` (``num_gpus_per_worker``) that fits them all and the most
    workers per set (``workers_option``) that fit. ``cores``: the machine's cores, which a
    local Ray is sized by, so the suggested fraction fits the next start too (default: the
    total)."""
    count = sum(s.workers for s in sets)
    for resource, key in (("CPU", "cpus"), ("GPU", "gpus")):
        need = sum(s.workers * getattr(s, key) for s in sets)
        have = float(total.get(resource, 0))
        if need <= have + 1e-9:
            continue
        room = min(have, cores) if resource == "CPU" and cores else have
        parts = ", ".join(f"{s.name} {s.workers}" for s in sets)
        each = max(getattr(s, key) for s in sets)
        fixes = []
        if room > 0:
            fraction = math.floor(room / count * 100) / 100
            if fraction > 0:
                fixes.append(f"rollout.engine_args.num_{key}_per_worker={fraction:g}")
            fewer = math.floor(room / (each * len(sets)) + 1e-9)
            if fewer >= 1:
                fixes.append(f"{workers_option}={fewer}")
        fix = " or ".join(fixes) if fixes else f"fewer {resource}s per worker"
        raise ConfigError(
            f"the run's Ray rollout workers need {need:g} {resource} together ({parts} workers "
            f"x {each:g} {resource}) and Ray has {have:g} in all: the last workers "
            "would wait rollout.engine_args.startup_timeout for a "
            f"{resource} the others hold, then fail. Set {fix} (Ray counts reserved "
            f"{resource}s, not their use: fractions let the sets share them), or join a "
            "larger cluster with cluster.address"
        )


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
