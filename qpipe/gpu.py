"""Which GPU architecture this machine builds for: engines only run on the arch they were built on.

Detection must stay cheap (it feeds `qpipe plan`'s keys), so it asks `nvidia-smi` and only uses
torch when the process already imported it; no GPU means "none".

What users see and type (engine aliases, registry manifests, `registry pull --arch`) calls a build
without a GPU `cpu`: arch_name() is the one mapping. "none" stays what detection returns because
it is part of existing build keys, and registries written before arch_name() record it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from functools import lru_cache

NO_GPU = "none"
CPU_ARCH = "cpu"
ARCH_PATTERN = re.compile(r"^sm\d{2,3}$")


def arch_from_compute_capability(capability: str) -> str:
    """'8.0' -> 'sm80', '9.0' -> 'sm90', '12.0' -> 'sm120'."""
    major, _, minor = capability.strip().partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"not a compute capability: {capability!r}")
    return f"sm{int(major)}{int(minor)}"


def _from_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    caps = [line for line in out.splitlines() if line.strip()]
    # NOTE: a mixed-GPU box builds for GPU 0, the device trtllm-build uses by default.
    return arch_from_compute_capability(caps[0]) if caps else None


def _from_torch() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor}"


@lru_cache(maxsize=1)
def detect_arch() -> str:
    """This machine's GPU arch (sm80, sm86, sm89, sm90, ...) or "none"."""
    return _from_nvidia_smi() or _from_torch() or NO_GPU


def resolve_arch(setting: str) -> str:
    """The recipe's build.arch: "auto" detects, anything else is taken as written."""
    return detect_arch() if setting == "auto" else setting


def arch_name(arch: str) -> str:
    """The arch as aliases, the registry and `--arch` name it: a build without a GPU (detected
    "none", or "cpu" as typed) is "cpu", so `registry pull --arch cpu` finds what the alias
    `...-cpu-...` names; GPU archs (sm80, ...) are unchanged apart from case and spaces."""
    name = arch.strip().lower()
    return CPU_ARCH if name in (NO_GPU, CPU_ARCH) else name
