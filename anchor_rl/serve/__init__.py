"""``anchor-rl serve``: an OpenAI-compatible HTTP server over the built-in sampler, so any
OpenAI client (and the ``http`` engine, :mod:`anchor_rl.rollout.http`) can sample from a
policy exactly as the in-process engine does. The request bodies are in
:mod:`anchor_rl.serve.protocol`, the answers in :mod:`anchor_rl.serve.responses`, the
served model in :mod:`anchor_rl.serve.model`, the batching in :mod:`anchor_rl.serve.batcher`,
the app in :mod:`anchor_rl.serve.app` and the command in :mod:`anchor_rl.cli.serve`; see
docs/models.md, "Serving and the HTTP engine".
"""
