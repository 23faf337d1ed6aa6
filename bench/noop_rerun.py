"""How long a re-run of a finished recipe takes (the target: under 3 s, no stage run).

    python bench/noop_rerun.py [RECIPE] [--until STAGE] [--repeats 5]

Runs the recipe once to fill a scratch store (or reuses --store), then times `qpipe run` again in a
fresh process each time, the way CI calls it, and records the figures in bench/noop_rerun.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes/smollm2-135m-int8.yaml"))
    parser.add_argument("--until", default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    store = args.store or tempfile.mkdtemp(prefix="qpipe-noop-")
    command = [sys.executable, "-m", "qpipe", "run", args.recipe, "--store", store, "--json"]
    if args.until:
        command += ["--until", args.until]
    first = subprocess.run(command, capture_output=True, text=True, check=False)
    if first.returncode not in (0, 3):
        sys.exit(first.stderr)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - started)
        statuses = {s["name"]: s["status"] for s in json.loads(result.stdout)["stages"]}
        assert all(s in ("hit", "disabled") for s in statuses.values()), statuses
    record = {
        "recipe": args.recipe,
        "until": args.until,
        "stages": statuses,
        "seconds": {"median": statistics.median(times), "max": max(times), "all": times},
    }
    (REPO / "bench" / "noop_rerun.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
