"""The HTTP peers: how each server is started for this comparison, and how its version is read.

Every server gets the same model name, so one `Target` shape fits all of them.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVED_MODEL_NAME = "smollm2"
HTTP_PEERS = (
    "llamacpp", "vllm", "vllm-bf16", "vllm-512", "qpipe", "qpipe-bf16", "qpipe-int8",
    "qpipe-w4a16", "qpipe-2048",
)  # fmt: skip
# qpipe's own configurations: the headline ratio is against the best of the others
QPIPE_PEERS = tuple(peer for peer in HTTP_PEERS if peer.startswith("qpipe"))
# the peers that serve a quantized model: the PeerPaths field (and compare.py option) naming it
QUANTIZED = {"qpipe-int8": "int8", "qpipe-w4a16": "w4a16"}
# fp32 peers run with the other engine's default token budget per step, to tell the scheduling
# default apart from the engine: vLLM's CPU API server steps 2048 tokens, qpipe's 512
STEP_TOKENS = {"vllm-512": 512, "qpipe-2048": 2048}
VLLM_PEERS = ("vllm", "vllm-bf16", "vllm-512")
PEERS = ("hf", *HTTP_PEERS)
LABELS = {
    "hf": "HF transformers generate, fp32, static batches",
    "llamacpp": "llama.cpp llama-server, Q4_1 GGUF",
    "vllm": "vLLM (CPU), fp32",
    "vllm-bf16": "vLLM (CPU), bf16 (its auto for this checkpoint)",
    "vllm-512": "vLLM (CPU), fp32, 512-token steps",
    "qpipe": "qpipe serve, fp32",
    "qpipe-bf16": "qpipe serve, bf16 (its auto on CPUs with a bf16 dot product)",
    "qpipe-int8": "qpipe serve, int8 W8A8 artifact (auto dtype)",
    "qpipe-w4a16": "qpipe serve, int4 W4A16 checkpoint (group 64, auto dtype)",
    "qpipe-2048": "qpipe serve, fp32, 2048-token steps",
}
DTYPES = {
    "vllm": "float32", "vllm-bf16": "bfloat16", "vllm-512": "float32",
    "qpipe": "float32", "qpipe-bf16": "bfloat16", "qpipe-2048": "float32",
}  # fmt: skip
# vLLM's CPU docs ask for tcmalloc and Intel's OpenMP in LD_PRELOAD; it runs best with them.
VLLM_PRELOAD = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "libiomp5.so")
KV_MARGIN_TOKENS = 64  # per llama-server slot, beyond prompt + output


@dataclass(frozen=True)
class ServerSpec:
    """How to start one peer's server (llama-server answers /health with 503 while it loads)."""

    name: str
    command: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)  # on top of this process's environment
    startup_timeout_s: float = 600.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class PeerPaths:
    """Where each peer's program and model live on this machine."""

    checkpoint: Path  # fp32 HF checkpoint: hf, qpipe, and every peer's tokenizer
    gguf: Path
    llama_server: Path | None
    vllm_python: Path
    vllm_model: Path
    int8: str | None  # qpipe artifact directory or store alias
    w4a16: str | None  # compressed-tensors W4A16 checkpoint or qpipe artifact


def server_spec(
    peer: str,
    paths: PeerPaths,
    port: int,
    max_concurrency: int,
    seq_len: int,
    startup_timeout_s: float,
) -> ServerSpec:
    """The command line of one HTTP peer; `seq_len` is prompt + output tokens per request."""
    if peer == "llamacpp":
        if paths.llama_server is None:
            raise ValueError("the llamacpp peer needs --llama-server PATH (llama.cpp's binary)")
        slots = max_concurrency
        command = (
            str(paths.llama_server), "-m", str(paths.gguf), "--alias", SERVED_MODEL_NAME,
            "-np", str(slots), "-c", str(slots * (seq_len + KV_MARGIN_TOKENS)),
            "-t", "2", "-tb", "2", "-cb", "--host", "127.0.0.1", "--port", str(port),
        )  # fmt: skip
        return ServerSpec(peer, command, port, startup_timeout_s=startup_timeout_s)
    budget = ("--max-num-batched-tokens", str(STEP_TOKENS[peer])) if peer in STEP_TOKENS else ()
    if peer in VLLM_PEERS:
        command = (
            str(paths.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(paths.vllm_model), "--dtype", DTYPES[peer],
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--served-model-name", SERVED_MODEL_NAME, *budget,
        )  # fmt: skip
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_KVCACHE_SPACE": "4",
        }
        preload = [
            lib if lib.startswith("/") else str(paths.vllm_python.parents[1] / "lib" / lib)
            for lib in VLLM_PRELOAD
        ]
        if all(Path(lib).is_file() for lib in preload):
            env["LD_PRELOAD"] = ":".join(preload)
        return ServerSpec(peer, command, port, env, startup_timeout_s)
    if peer in ("qpipe", "qpipe-bf16", "qpipe-2048", *QUANTIZED):
        model = getattr(paths, QUANTIZED[peer]) if peer in QUANTIZED else str(paths.checkpoint)
        if model is None:
            raise ValueError(f"the {peer} peer needs --{QUANTIZED[peer]} PATH_OR_ALIAS")
        command = (
            sys.executable, "-m", "qpipe", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(max(64, max_concurrency)),
            "--served-model-name", SERVED_MODEL_NAME,
            "--dtype", DTYPES.get(peer, "auto"), *budget,
        )  # fmt: skip
        return ServerSpec(peer, command, port, startup_timeout_s=startup_timeout_s)
    raise ValueError(f"unknown peer {peer!r}: use {', '.join(HTTP_PEERS)}")


def peer_version(peer: str, paths: PeerPaths) -> str:
    """What built the peer: llama.cpp's build, vLLM's package version, qpipe's commit."""
    if peer == "llamacpp" and paths.llama_server is not None:
        return _output([str(paths.llama_server), "--version"])
    if peer in VLLM_PEERS:
        probe = (
            "import importlib.metadata as m\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(name, m.version(name)); break\n"
            "    except m.PackageNotFoundError:\n        pass\n"
        )
        return _output([str(paths.vllm_python), "-c", probe])
    if peer == "hf":
        from importlib.metadata import version

        return f"transformers {version('transformers')}, torch {version('torch')}"
    return f"qpipe {git_commit()}"


def git_commit() -> str:
    """HEAD of the qpipe checkout, with `+dirty` when the tree has changes."""
    repo = Path(__file__).resolve().parents[2]
    head = _output(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"])
    dirty = _output(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "")


def _output(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        return f"unknown ({exc})"
    return (done.stdout + done.stderr).strip()
