"""``anchor-rl serve``: serve a model over an OpenAI-compatible HTTP API.

torch, transformers and uvicorn are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Annotated

import typer

from anchor_rl.cli.options import AdapterOpt, DeviceOpt


def serve_command(
    model: Annotated[str, typer.Option(help="A model directory, sft:SIZE or random:SIZE.")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free one).")] = 8000,
    host: Annotated[
        str,
        typer.Option(
            help="Interface to listen on. 127.0.0.1 keeps it to this machine; the server loads "
            "any weights file a client names, so expose it only to trusted clients."
        ),
    ] = "127.0.0.1",
    task: Annotated[str, typer.Option(help="Task of an sft:SIZE spec.")] = "arithmetic",
    task_kwargs: Annotated[
        str | None, typer.Option(help="Task constructor kwargs of an sft:SIZE spec, as JSON.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of a random:SIZE init.")] = 0,
    name: Annotated[
        str | None, typer.Option(help="Served model name. Default: --model as given.")
    ] = None,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Most rows (choices) sampled together in one forward batch.")
    ] = 256,
    batch_wait_ms: Annotated[
        float,
        typer.Option(min=0.0, help="How long a batch waits for concurrent requests to join it."),
    ] = 5.0,
    device: DeviceOpt = "cpu",
    adapter: AdapterOpt = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve a model: /v1/completions, /v1/chat/completions, /v1/models, /v1/weights, /health,
    /v1/load_lora_adapter and /v1/unload_lora_adapter (LoRA adapters loaded at run time).

    Sampling is the built-in engine's, per-request seeds included: a client that sends the
    seeds of its requests (the `seeds` field; the http engine does) gets exactly the tokens
    the in-process engine samples. See docs/models.md, "Serving and the HTTP engine".
    """
    import torch
    import uvicorn

    from anchor_rl.cli.options import default_threads, load_model, parse_task_kwargs
    from anchor_rl.serve.app import build_app
    from anchor_rl.serve.model import ModelServer

    torch.set_num_threads(default_threads())
    kwargs = parse_task_kwargs(task_kwargs)
    policy, tokenizer = load_model(model, task, kwargs, seed, device, adapter)
    server = ModelServer(policy, tokenizer, name or model, max_batch=max_batch)
    app = build_app(server, max_batch, batch_wait_ms)

    class Announced(uvicorn.Server):
        """Prints the URL once the socket listens, with the port it got (``--port 0``)."""

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1]
                typer.echo(f"serving {server.name!r} on http://{host}:{bound}/v1 (health: /health)")

    announced = Announced(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run: Ctrl-C is a clean stop
        announced.run()
    if not announced.started:
        raise typer.Exit(1)
