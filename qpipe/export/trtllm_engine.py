"""Build TensorRT engines from a TensorRT-LLM checkpoint with `trtllm-build` (TensorRT-LLM 1.2.x).

TensorRT-LLM removed this builder in its 2026 releases (PyTorch backend only), and its wheels come
from NVIDIA's index, so on most machines it is missing: `engine_blockers` says exactly what is
missing and how to get it, and nothing engine-shaped is ever written without a real build.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from qpipe import gpu
from qpipe.export.config import TrtllmBuildConfig
from qpipe.export.toolchain import ABSENT, distribution_version

TRTLLM_BUILD = "trtllm-build"
NEWEST_SUPPORTED = (1, 2)
INSTALL_HINT = (
    "install TensorRT-LLM 1.2.x (the last release with trtllm-build) on a CUDA machine: "
    "pip install 'tensorrt_llm==1.2.*' --extra-index-url https://pypi.nvidia.com, "
    "or run qpipe inside NVIDIA's TensorRT-LLM 1.2 container"
)


class EngineBuildError(RuntimeError):
    """trtllm-build ran and failed (the log tail is in the message)."""


@dataclass(frozen=True)
class EngineToolchain:
    executable: str
    version: str


def _version_tuple(version: str) -> tuple[int, int]:
    major, _, rest = version.partition(".")
    minor = rest.split(".")[0]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def engine_blockers(arch: str) -> tuple[list[str], EngineToolchain | None]:
    """Everything that prevents building an engine for `arch` here (empty list: go ahead)."""
    problems = []
    detected = gpu.detect_arch()
    if detected == gpu.NO_GPU:
        problems.append("no NVIDIA GPU found (nvidia-smi lists none); engines are built on the GPU")
    elif arch != detected:
        problems.append(
            f"build.arch is {arch} but this machine's GPU is {detected}; an engine runs only on "
            f"the arch it was built on: build on an {arch} machine or set build.arch: auto"
        )
    executable = shutil.which(TRTLLM_BUILD)
    version = distribution_version("tensorrt_llm", "tensorrt-llm")
    if executable is None:
        problems.append(f"{TRTLLM_BUILD} is not on PATH; {INSTALL_HINT}")
    if version != ABSENT and _version_tuple(version) > NEWEST_SUPPORTED:
        problems.append(
            f"tensorrt_llm {version} has no engine builder (removed after 1.2.x); {INSTALL_HINT}"
        )
    if problems or executable is None:
        return problems, None
    return [], EngineToolchain(executable, version)


def trtllm_build_argv(
    executable: str, checkpoint: Path, output: Path, cfg: TrtllmBuildConfig, workers: int
) -> list[str]:
    """The `trtllm-build` command line (flag names as in TensorRT-LLM 1.2's trtllm-build --help)."""
    argv = [
        executable,
        "--checkpoint_dir", str(checkpoint),
        "--output_dir", str(output),
        "--max_batch_size", str(cfg.max_batch_size),
        "--max_input_len", str(cfg.max_input_len),
        "--max_seq_len", str(cfg.max_seq_len),
        "--max_num_tokens", str(cfg.max_num_tokens),
        "--gemm_plugin", cfg.gemm_plugin,
        "--paged_kv_cache", "enable" if cfg.paged_kv_cache else "disable",
        "--use_paged_context_fmha", "enable" if cfg.use_paged_context_fmha else "disable",
        "--workers", str(workers),
    ]  # fmt: skip
    if cfg.use_timing_cache:
        argv += ["--output_timing_cache", str(output / "timing.cache")]
    return argv


def build_engine(
    toolchain: EngineToolchain,
    checkpoint: Path,
    output: Path,
    cfg: TrtllmBuildConfig,
    world_size: int,
) -> list[Path]:
    """Run trtllm-build; return the rank{N}.engine files (EngineBuildError if any is missing)."""
    from qpipe.console import console

    output.mkdir(parents=True, exist_ok=True)
    argv = trtllm_build_argv(toolchain.executable, checkpoint, output, cfg, world_size)
    log = output / "build.log"
    with console.status(f"trtllm-build ({world_size} rank(s))"), log.open("w") as f:
        returncode = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    engines = [output / f"rank{r}.engine" for r in range(world_size)]
    missing = [e.name for e in engines if not e.is_file()]
    if returncode != 0 or missing or not (output / "config.json").is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise EngineBuildError(
            f"trtllm-build exited {returncode}"
            + (f", missing {', '.join(missing)}" if missing else "")
            + f" (full log: {log}):\n{tail}"
        )
    return engines
