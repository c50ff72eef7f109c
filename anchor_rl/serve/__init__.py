"""``anchor-rl serve``: an OpenAI-compatible HTTP server over the built-in sampler, so any
OpenAI client (and the ``http`` engine, :mod:`anchor_rl.rollout.http`) can sample from a
policy exactly as the in-process engine does. The app is in :mod:`anchor_rl.serve.app`,
the command in :mod:`anchor_rl.serve.commands`; see docs/models.md, "Serving and the HTTP
engine".
"""
