"""PVPO's data side: presampling, the anchor store, group sampling and teacher trajectories.

Modules: :mod:`~anchor_rl.anchors.keys` (what identifies a set of anchors: model,
tokenizer, sampling and task fingerprints), :mod:`~anchor_rl.anchors.store` (the SQLite
anchor store, ``AnchorStat``, ``TeacherTrajectory``), :mod:`~anchor_rl.anchors.presample`
(``presample``, ``refresh_anchors``, ``RolloutSampler``), :mod:`~anchor_rl.anchors.filter`
(``group_filter``), :mod:`~anchor_rl.anchors.teachers` (HF, HTTP and oracle teachers) and
:mod:`~anchor_rl.anchors.priors` (baseline priors for V0.5). See docs/pvpo.md.

Nothing is imported here, so the command line (:mod:`anchor_rl.cli`) loads without torch.
"""
