"""Quantization on SmolLM2 per method: qpipe vs llm-compressor called directly; the domain effect.

    .venv/bin/python bench/quantize/run.py [--checkpoint DIR] [--samples 16] [--seq-len 256]

Each quantization runs in a fresh subprocess (so peak RSS is its own):
  * `qpipe`:  qpipe.quant.quantize.quantize_checkpoint (the quantize stage's work)
  * `direct`: the same llm-compressor modifiers through `oneshot` + save_pretrained, no qpipe code
    (except the CPU pinning shim AWQ cannot run without)
Quality is measured in the direct run, in memory before saving, against the 16-bit model on
held-out wikitext (articles the shipped wikitext calibration set does not contain) and held-out
math (GSM8K test items 1000-1319, question + worked answer). The domain experiment re-runs the
calibrating methods with the math calibration set (calibration/math-word-problems.jsonl, generated
problems, no GSM8K item). Results: results.json next to this file; `--table` prints them as the
markdown tables RESULTS.md records.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORK = Path("/tmp/qpipe-bench-quantize")
METHODS = {
    "gptq-w4-g64": {"method": "gptq", "group_size": 64},
    "awq-w4-g64": {"method": "awq", "group_size": 64},
    "int8-sq": {"method": "int8-sq"},
    "fp8-dynamic": {"method": "fp8"},
    "int8-wo": {"method": "int8-wo"},
    "int4-wo-g64": {"method": "int4-wo", "group_size": 64},
}
DOMAIN_METHODS = ("gptq-w4-g64", "awq-w4-g64", "int8-sq")


def build_inputs(checkpoint: Path, samples: int, seq_len: int) -> None:
    """Calibration sets (via qpipe's calibrate code) and held-out windows + 16-bit log-probs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpipe.calibration.builder import build_calibration_set
    from qpipe.quant.config import CalibrationConfig
    from qpipe.quant.divergence import heldout_windows, log_probs

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for name, path in (("wikitext", "wikitext-2.txt"), ("math", "math-word-problems.jsonl")):
        config = CalibrationConfig(
            dataset=str(REPO / "calibration" / path), num_samples=samples, seq_len=seq_len,
            packing=True,
        )  # fmt: skip
        (WORK / name).mkdir(parents=True, exist_ok=True)
        build_calibration_set(config, REPO / "calibration" / path, tokenizer).save(WORK / name)
    shared = REPO.parent / "shared" / "data"
    wiki_lines = (shared / "wikitext-2" / "test.txt").read_text(encoding="utf-8").split("\n")
    gsm = [json.loads(line) for line in (shared / "gsm8k" / "test.jsonl").read_text().splitlines()]
    heldout = {
        "wikitext": ["\n".join(wiki_lines[:2991])],
        "math": [f"{r['question']}\n{r['answer']}" for r in gsm[1000:1320]],
    }
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    for name, texts in heldout.items():
        windows = heldout_windows(tokenizer, texts, 8, 256)
        torch.save({"windows": windows, "logprobs": log_probs(model, windows)}, WORK / f"{name}.pt")


def child(checkpoint: Path, case: str, mode: str, calibration: str) -> dict:
    """One quantization in this (fresh) process; prints its JSON record."""
    from qpipe.quant.config import QuantizationConfig
    from qpipe.quant.quantize import peak_rss_mib, reset_peak_rss

    quant = QuantizationConfig(**METHODS[case])
    cal_file = WORK / calibration / "calibration.safetensors"
    out = WORK / f"out-{case}-{mode}-{calibration}"
    if mode == "qpipe":
        import llmcompressor  # noqa: F401 (import cost is outside both timings)

        from qpipe.quant.quantize import quantize_checkpoint

        start = time.perf_counter()
        quantize_checkpoint(checkpoint, quant, out, cal_file)
        return {"wall_s": time.perf_counter() - start, "peak_rss_mib": peak_rss_mib()}
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpipe.quant.compat import cpu_safe_pinning
    from qpipe.quant.divergence import compare
    from qpipe.quant.schemes import modifiers

    reset_peak_rss()  # as quantize_checkpoint does: imports are outside both measurements
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    cal = load_file(str(cal_file))
    rows = [
        ids[m.bool()].tolist()
        for ids, m in zip(cal["input_ids"], cal["attention_mask"], strict=True)
    ]
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    with cpu_safe_pinning():
        oneshot(model=model, tokenizer=tokenizer, recipe=modifiers(quant, ["lm_head"]),
                dataset=dataset if quant.method_calibrates else None,
                num_calibration_samples=len(rows), shuffle_calibration_samples=False)  # fmt: skip
    quantized_s, quantized_rss = time.perf_counter() - start, peak_rss_mib()
    quality = {}
    for name in ("wikitext", "math"):
        held = torch.load(WORK / f"{name}.pt")
        result = compare(held["logprobs"], model, held["windows"])
        quality[name] = {"kld": result.kld, "perplexity": result.perplexity,
                         "top1": result.top1_agreement}  # fmt: skip
    del held  # the reference log-probs are not part of the quantization's memory
    reset_peak_rss()
    save_start = time.perf_counter()
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    wall = quantized_s + time.perf_counter() - save_start
    return {"wall_s": wall, "peak_rss_mib": max(quantized_rss, peak_rss_mib()), "quality": quality}


def run_child(checkpoint: Path, case: str, mode: str, calibration: str) -> dict:
    command = [sys.executable, __file__, "--checkpoint", str(checkpoint), "--child", case, mode,
               calibration]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    """Markdown: per method qpipe vs direct, then the calibration-domain experiment."""
    base = results["baseline_perplexity"]
    runs = results["runs"]
    lines = [
        f"16-bit perplexity: wikitext {base['wikitext']:.2f}, math {base['math']:.2f}",
        "",
        "| method | direct s | qpipe s | direct RSS MiB | qpipe RSS MiB | wiki PPL | wiki KLD "
        "| math PPL | math KLD |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for case in METHODS:
        direct = runs.get(f"{case}/direct/wikitext", {})
        ours = runs.get(f"{case}/qpipe/wikitext", {})
        if "quality" not in direct:
            continue
        q = direct["quality"]
        qpipe_s = f"{ours['wall_s']:.1f}" if "wall_s" in ours else "-"
        qpipe_rss = f"{ours['peak_rss_mib']:.0f}" if "peak_rss_mib" in ours else "-"
        lines.append(
            f"| {case} | {direct['wall_s']:.1f} | {qpipe_s} | {direct['peak_rss_mib']:.0f} | "
            f"{qpipe_rss} | {q['wikitext']['perplexity']:.2f} | {q['wikitext']['kld']:.4f} | "
            f"{q['math']['perplexity']:.3f} | {q['math']['kld']:.4f} |"
        )
    lines += [
        "",
        "| method | calibrated on | math PPL | math KLD | math top-1 | wiki KLD |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for case in DOMAIN_METHODS:
        for calibration in ("wikitext", "math"):
            record = runs.get(f"{case}/direct/{calibration}", {})
            if "quality" in record:
                q = record["quality"]
                lines.append(
                    f"| {case} | {calibration} | {q['math']['perplexity']:.3f} | "
                    f"{q['math']['kld']:.4f} | {q['math']['top1']:.3f} | "
                    f"{q['wikitext']['kld']:.4f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, default=REPO / ".cache/test/smollm2-135m-fp32")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--methods", nargs="*", choices=sorted(METHODS))
    parser.add_argument("--direct-only", action="store_true", help="skip the qpipe-path runs")
    parser.add_argument("--child", nargs=3)
    parser.add_argument("--table", action="store_true", help="print results.json as markdown")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads((HERE / "results.json").read_text())), end="")
        return
    if args.child:
        print(json.dumps(child(args.checkpoint, *args.child)))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    build_inputs(args.checkpoint, args.samples, args.seq_len)
    baseline = {}
    import torch

    from qpipe.quant.divergence import perplexity

    for name in ("wikitext", "math"):
        held = torch.load(WORK / f"{name}.pt")
        baseline[name] = perplexity(held["logprobs"], held["windows"])
    results = {"baseline_perplexity": baseline, "samples": args.samples, "seq_len": args.seq_len,
               "runs": {}}  # fmt: skip
    previous = HERE / "results.json"
    if previous.exists():  # runs of other methods (same inputs) are kept
        earlier = json.loads(previous.read_text())
        if (earlier["samples"], earlier["seq_len"]) == (args.samples, args.seq_len):
            results["runs"] = earlier["runs"]
    modes = ("direct",) if args.direct_only else ("direct", "qpipe")
    cases = args.methods or list(METHODS)
    plan = []
    for case in cases:
        plan += [(case, mode, "wikitext") for mode in modes]
        plan += [(case, "direct", "math")] if case in DOMAIN_METHODS else []
    for case, mode, calibration in plan:
        key = f"{case}/{mode}/{calibration}"
        if "wall_s" in results["runs"].get(key, {}):
            continue  # measured by an earlier invocation
        record = run_child(args.checkpoint, case, mode, calibration)
        results["runs"][key] = record
        print(case, mode, calibration, json.dumps(record)[:300], flush=True)
        (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
