"""Versions of the engine toolchain (TensorRT-LLM, TensorRT, CUDA): an engine binds to all three.

They go into the build stage's key, so an engine built with one toolchain is never reused by
another; "absent" keeps keys stable on machines that have none of them.
"""

from __future__ import annotations

from importlib import metadata

ABSENT = "absent"
# Distribution names as pip installs them; the first one installed wins.
_DISTRIBUTIONS = {
    "tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"),
    "tensorrt": ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt_cu12_libs"),
    "cuda": ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime"),
}


def distribution_version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return ABSENT


def toolchain_versions() -> dict[str, str]:
    """{"tensorrt_llm": ..., "tensorrt": ..., "cuda": ...}, each a version or "absent"."""
    return {tool: distribution_version(*names) for tool, names in _DISTRIBUTIONS.items()}
