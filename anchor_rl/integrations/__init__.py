"""Plug-ins for other trainers: anchor-rl's methods held by a trainer a user already runs.

Each integration is its own subpackage, imported by name, so importing this package
imports no other trainer library (docs/integrations.md):

- ``anchor_rl.integrations.trl``: TRL's ``GRPOTrainer`` with PVPO's static anchors, group
  sampling and teacher rows (``PVPOGRPOTrainer``) or V0.5's fused baseline
  (``V05GRPOTrainer``).
- ``anchor_rl.integrations.verl``: the verl integration (its own section of the doc).

Layer: above the trainer, below ``anchor_rl.bench`` (benchmarks compare the hosts) and the
command line (docs/training.md, "Layers").
"""
