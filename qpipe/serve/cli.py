"""`qpipe serve`: load a checkpoint or artifact into the engine and serve it over HTTP."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated

import typer

# EngineConfig's fields as `qpipe serve` spells them, so that an engine error names the flag typed
ENGINE_FLAGS = {
    "model": "MODEL",
    "dtype": "--dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "device": "--device",
    "block_size": "--block-size",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "enable_prefix_caching": "--enable-prefix-caching",
    "kv_cache_memory_gib": "--kv-cache-memory",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enforce_eager": "--enforce-eager",
}
_FIELD = re.compile(r"EngineConfig\.(\w+)")


def in_flags(message: str) -> str:
    """An engine error as a `qpipe serve` user reads it: the engine names its settings
    `EngineConfig.<field>` (its library callers set those), which become `--block-size`,
    `--max-model-len`, ..."""
    return _FIELD.sub(lambda m: ENGINE_FLAGS.get(m[1], m[0]), message)


def resolve_model_path(arg: str, store: str | None = None) -> Path:
    """Where the weights to serve live: a checkpoint/artifact directory, or an engine alias
    (`{model}-{arch}-{quant}-tp{N}`) in the store, whose build's `qpipe/` artifact is served."""
    path = Path(arg).expanduser()
    if path.is_dir():
        return path
    from qpipe.store.base import DanglingAlias, StoreError
    from qpipe.store.entry import CorruptEntry
    from qpipe.store.factory import open_store

    try:
        # a store that is not there has no alias: a mistyped --store must not create one
        opened = open_store(store, create=False)
        record = opened.resolve_alias(arg)
        if record is None:
            raise typer.BadParameter(
                f"{arg!r} is neither a directory nor an alias in {opened.location}; pass a "
                "checkpoint or artifact directory, or an alias from `qpipe cache ls`",
                param_hint="MODEL",
            )
        entry = opened.open(record["key"])
    except DanglingAlias as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL") from exc
    except StoreError as exc:
        raise typer.BadParameter(
            f"{arg!r} is not a directory, and no alias can be looked up: {exc}",
            param_hint="--store" if store else "MODEL",
        ) from exc
    except CorruptEntry as exc:
        raise typer.BadParameter(
            f"alias {arg!r}: {exc}; `qpipe cache verify --quarantine --store "
            f"{opened.location}` moves it aside, then `qpipe run RECIPE` rebuilds it",
            param_hint="MODEL",
        ) from exc
    artifact = entry / "qpipe"
    return artifact if artifact.is_dir() else entry


def serve(
    model: Annotated[str, typer.Argument(help="Checkpoint or artifact directory (or alias).")],
    host: Annotated[str, typer.Option(help="Interface to bind; 0.0.0.0 exposes it.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="0: any free port.")] = 8000,
    max_num_seqs: Annotated[int, typer.Option(help="Most requests in one batch.")] = 64,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help="Most tokens in one step (default: 512 on CPU, 2048 on GPU).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Prompt + output limit (default: the checkpoint's).")
    ] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV-cache block.")] = 16,
    enable_prefix_caching: Annotated[bool, typer.Option()] = True,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    kv_cache_dtype: Annotated[
        str,
        typer.Option(
            help="auto (fp8 when the checkpoint calibrated KV scales, else the model's dtype), "
            "bfloat16, or fp8 (e4m3; the checkpoint's scales, else 1)."
        ),
    ] = "auto",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    kv_cache_memory: Annotated[
        float, typer.Option(help="KV-cache size in GiB (CPU).", min=0.01)
    ] = 2.0,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help="Share of GPU memory for weights + KV cache (GPU).")
    ] = 0.9,
    enforce_eager: Annotated[
        bool, typer.Option(help="GPU: no CUDA graphs for decode steps (slower; for debugging).")
    ] = False,
    api_key: Annotated[
        str | None, typer.Option(envvar="QPIPE_API_KEY", help="Require 'Bearer <key>'.")
    ] = None,
    max_queue: Annotated[
        int | None, typer.Option(help="Waiting requests before 503 + Retry-After.", min=1)
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients send (default: directory name).")
    ] = None,
    keepalive_interval: Annotated[
        float, typer.Option(help="Seconds of silence before an SSE keep-alive comment.")
    ] = 15.0,
    drain_timeout: Annotated[
        int, typer.Option(help="Seconds shutdown waits for running requests.", min=0)
    ] = 30,
    store: Annotated[
        str | None, typer.Option(help="Store that resolves an alias (default: $QPIPE_HOME).")
    ] = None,
) -> None:
    """Serve a checkpoint with qpipe's paged-attention engine (OpenAI-compatible API)."""
    import uvicorn
    from rich.logging import RichHandler

    from qpipe.console import console, error
    from qpipe.serve.api import ServerSettings, build_app
    from qpipe.serve.async_engine import AsyncLLMEngine
    from qpipe.serve.config import EngineConfig
    from qpipe.serve.engine import LLMEngine
    from qpipe.serve.http_server import DrainingServer
    from qpipe.serve.metrics import ServerMetrics
    from qpipe.serve.parent_watch import exit_with_parent

    if not exit_with_parent():
        console.print("[red]error:[/] the process that started this server has exited")
        raise typer.Exit(1)
    path = resolve_model_path(model, store)
    name = served_model_name or (model if path.name == "qpipe" else path.name)
    # the engine logs its KV-cache size (blocks, max concurrency at max_model_len) at INFO
    logging.basicConfig(
        level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=console)]
    )
    try:
        config = EngineConfig(
            model=str(path),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_gib=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
        )
        with console.status(f"loading {path} on {device}"):
            async_engine = AsyncLLMEngine(
                lambda: LLMEngine(config), ServerMetrics(name), max_queue=max_queue
            )
    except (ValueError, OSError, KeyError) as exc:  # what a checkpoint or a flag got wrong
        # a KeyError's str() is its message quoted
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise error(in_flags(str(message))) from exc
    settings = ServerSettings(
        served_model_name=name,
        model_path=str(path),
        api_key=api_key,
        keepalive_interval_s=keepalive_interval,
        drain_timeout_s=drain_timeout,
    )
    console.print(f"serving [bold]{name}[/] on http://{host}:{port}/v1")
    app = build_app(async_engine, settings)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=drain_timeout)
    server = DrainingServer(config, async_engine)
    server.run()
    if not server.started:  # the port was taken, say: uvicorn logged why
        raise typer.Exit(3)
    if async_engine.error is not None:  # the engine died and took the server down with it
        console.print(f"[red]error:[/] the engine failed: {async_engine.error}")
        raise typer.Exit(1)
