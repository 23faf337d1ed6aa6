"""What the HTTP server costs per streamed token, apart from the engine: `qpipe serve` driven by
`qpipe bench` (streaming completions), with the CPU time of the server's threads read from /proc
before and after, per generated token. Not a test: timings depend on the machine.

    .venv/bin/python bench/serve_engine/http_overhead.py CHECKPOINT [--concurrency 256]
        [--server-arg=--max-num-seqs=256 ...]

Why: on the H200 (thirty-second session) the offline engine made 10,961 output tok/s at
concurrency 256 and the same engine behind `qpipe serve` 3,706: the server's event loop (one
thread, the GIL shared with the engine thread) handles every token of every stream, and at GPU
speed that loop, not the GPU, sets the rate. On a CPU a small model (tests' 2-layer tiny Llama)
makes the engine fast enough for the loop to matter, and the loop's CPU time per token is what a
change to the serving path moves, whatever the client beside it costs on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from qpipe.bench.server_process import BuiltinServer

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread name; the main thread is
    `main`, threads of one name are summed."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        name = "main" if int(task.name) == pid else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * TICK_S
    return seconds


def generated_tokens(base_url: str) -> float:
    metrics = httpx.get(f"{base_url}/metrics").text
    return sum(
        float(match)
        for match in re.findall(r"^qpipe:generation_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--server-arg", action="append", default=[], help="--flag=value")
    args = parser.parse_args()
    server_args: dict[str, str | int | float | bool] = {"device": "cpu"}
    server_args["max-num-seqs"] = args.concurrency
    for item in args.server_arg:
        flag, _, value = item.lstrip("-").partition("=")
        server_args[flag] = value or True
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.jsonl"
        with BuiltinServer(args.checkpoint, Path(tmp) / "server.log", server_args) as server:
            assert server.process is not None
            pid = server.process.pid
            before, tokens_before = thread_cpu_s(pid), generated_tokens(server.base_url)
            subprocess.run(
                [sys.executable, "-m", "qpipe", "bench", "--endpoint", server.base_url,
                 "--concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--result-file", str(result_file)],
                check=True, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            after, tokens = thread_cpu_s(pid), generated_tokens(server.base_url) - tokens_before
        result = json.loads(result_file.read_text().splitlines()[-1])
    print(
        f"concurrency {args.concurrency}: {result['output_throughput']:.0f} output tok/s, "
        f"TTFT p50 {result['median_ttft_ms']:.0f} ms, TPOT p50 {result['median_tpot_ms']:.1f} ms,"
        f" {tokens:.0f} tokens"
    )
    loop = after["main"] - before["main"]
    rest = sum(after.values()) - sum(before.values()) - loop
    print(f"  event loop (main thread): {loop / tokens * 1e6:6.1f} us CPU per token")
    print(f"  every other thread (engine, torch's workers): {rest / tokens * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
