"""Scaling a run out (the ``cluster.*`` settings, docs/distributed.md).

:mod:`~anchor_rl.cluster.engine`: the ``ray`` rollout engine, N rollout workers (Ray actors,
:mod:`~anchor_rl.cluster.worker`) fed the learner's weights, restarted when they die; importing
it registers the engine (``cluster.rollout_workers=N``), Ray is imported only when one is built.
:mod:`~anchor_rl.cluster.learners`: data-parallel learner ranks (``cluster.learners=N``; gloo,
NCCL on GPUs), each running its share of an update (:mod:`~anchor_rl.cluster.data_parallel`:
replicated through DDP or sharded by FSDP2). :mod:`~anchor_rl.cluster.asynchronous`: rollouts prefetched
``cluster.async_steps`` steps ahead. The package sits at the trainer's layer: the learners run
the trainer's update, and the trainer builds the engine, the learners and the prefetching.
:mod:`~anchor_rl.cluster.broadcast`: the workers' weights broadcast in a process group of their
own (``cluster.weight_sync=collective``; gloo, NCCL on GPUs) instead of the object store. The
NCCL learners and the NCCL broadcast have never run on a GPU.
"""
