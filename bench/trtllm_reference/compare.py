"""Compare two TensorRT-LLM checkpoints: config fields, and per rank every tensor's name, dtype and
shape. Prints a report and writes it as JSON; exits 1 when names, dtypes or shapes differ.

    python compare.py REFERENCE_DIR CANDIDATE_DIR REPORT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors import safe_open

CONFIG_FIELDS = ("architecture", "dtype", "vocab_size", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "intermediate_size", "hidden_act",
                 "norm_epsilon", "position_embedding_type", "rotary_base", "mapping",
                 "quantization")  # fmt: skip


def layout(path: Path) -> dict[str, dict[str, tuple[str, list[int]]]]:
    ranks = {}
    for file in sorted(path.glob("rank*.safetensors")):
        with safe_open(str(file), "pt") as f:
            ranks[file.stem] = {
                k: (str(f.get_slice(k).get_dtype()), list(f.get_slice(k).get_shape()))
                for k in f.keys()  # noqa: SIM118
            }
    return ranks


def main() -> int:
    reference, candidate, report_path = (Path(a) for a in sys.argv[1:4])
    ref_cfg = json.loads((reference / "config.json").read_text())
    cand_cfg = json.loads((candidate / "config.json").read_text())
    config_diff = {
        field: {"reference": ref_cfg.get(field), "qpipe": cand_cfg.get(field)}
        for field in CONFIG_FIELDS
        if ref_cfg.get(field) != cand_cfg.get(field)
    }
    ref_ranks, cand_ranks = layout(reference), layout(candidate)
    tensors = {}
    for rank in sorted(set(ref_ranks) | set(cand_ranks)):
        ref, cand = ref_ranks.get(rank, {}), cand_ranks.get(rank, {})
        tensors[rank] = {
            "only_reference": sorted(set(ref) - set(cand)),
            "only_qpipe": sorted(set(cand) - set(ref)),
            "different": {
                k: {"reference": ref[k], "qpipe": cand[k]}
                for k in sorted(set(ref) & set(cand))
                if ref[k] != cand[k]
            },
            "matching": len([k for k in set(ref) & set(cand) if ref[k] == cand[k]]),
        }
    report = {"config_differences": config_diff, "tensors": tensors}
    report_path.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2)[:6000])
    same = all(not (t["only_reference"] or t["only_qpipe"] or t["different"])
               for t in tensors.values())  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
