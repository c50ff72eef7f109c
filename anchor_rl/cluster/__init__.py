"""Scaling out on Ray: the ``ray`` rollout engine (docs/distributed.md).

Importing this package registers the engine, so a run names it with
``cluster.rollout_workers=N`` (or ``rollout.engine=ray``); Ray itself is imported only when an
engine is built. Built here: N rollout workers (Ray actors, on one machine or a cluster)
fed the learner's weights through the object store, restarted when they die. Data-parallel
learners are in anchor_rl.trainer.learners, asynchronous rollouts (one step off-policy, through
``RayEngine.submit``) in anchor_rl.trainer.asynchronous; not built yet (issue 17): FSDP2, NCCL
weight broadcast.
"""

from anchor_rl.cluster.engine import RayEngine, ray_engine, shard_by_group

__all__ = ["RayEngine", "ray_engine", "shard_by_group"]
