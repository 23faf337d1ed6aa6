"""The TensorRT-LLM checkpoint writer against the format: names, shapes, dtypes, tp sharding, and
dequantizing the written tensors (all ranks) reproduces the quantized model's weights.

Quantized inputs are real llm-compressor outputs of a small random Llama (hidden 256, 4 heads,
2 kv heads: tp 1, 2 and 4 all split it; tp 4 repeats kv heads). The reference weights are taken from
the in-memory quantized model (compressed-tensors' fake_quantize) before it is saved, so the
reader, the packing and the writer are all checked against an independent path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qpipe.export.quantized_checkpoint import CheckpointFormatError
from qpipe.export.trtllm_checkpoint import ParallelismError, write_trtllm_checkpoint
from qpipe.export.trtllm_quant import check_groupwise_shape

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS = 4, 2, 64, 256, 512, 512, 2
HF_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _schemes() -> dict[str, object]:
    from compressed_tensors.quantization import QuantizationArgs as A
    from compressed_tensors.quantization import QuantizationScheme

    def scheme(weights: A, acts: A | None = None) -> QuantizationScheme:
        return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)

    int8_w = A(num_bits=8, type="int", strategy="channel", symmetric=True)
    return {
        "int8-dynamic": scheme(int8_w, A(num_bits=8, type="int", strategy="token", dynamic=True)),
        "int8-static": scheme(int8_w, A(num_bits=8, type="int", strategy="tensor", dynamic=False)),
        "fp8-static": scheme(
            A(num_bits=8, type="float", strategy="channel", symmetric=True),
            A(num_bits=8, type="float", strategy="tensor", dynamic=False),
        ),
        "fp8-dynamic": scheme(
            A(num_bits=8, type="float", strategy="channel", symmetric=True),
            A(num_bits=8, type="float", strategy="token", dynamic=True),
        ),
        "w4-group-asym": scheme(
            A(num_bits=4, type="int", strategy="group", group_size=64, symmetric=False)
        ),
        "w4-group-sym": scheme(
            A(num_bits=4, type="int", strategy="group", group_size=64, symmetric=True)
        ),
        "w8-channel": scheme(int8_w),
        "fp8-kv": scheme(  # plus an fp8 KV cache (kv_cache_scheme below)
            A(num_bits=8, type="float", strategy="tensor", symmetric=True),
            A(num_bits=8, type="float", strategy="tensor", dynamic=False),
        ),
        # layer 1 kept 16-bit (KEEP_LAYER_1)
        "w8-channel-keep1": scheme(int8_w),
        "int8-dynamic-keep1": scheme(
            int8_w, A(num_bits=8, type="int", strategy="token", dynamic=True)
        ),  # fmt: skip
    }


KEEP_LAYER_1 = ["lm_head", r"re:model\.layers\.1\..*"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Path) -> dict:
    """{scheme: (checkpoint dir, {hf linear name: reference dequantized weight})}."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("trtllm-src")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "none")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    rows = [torch.randint(0, VOCAB, (32,)).tolist() for _ in range(4)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 32] * 4})
    base = LlamaForCausalLM.from_pretrained(root / "none", dtype=torch.float32)
    out = {"none": (root / "none", {n: p.detach().clone() for n, p in base.named_parameters()})}
    for name, scheme in _schemes().items():
        model = LlamaForCausalLM.from_pretrained(root / "none", dtype=torch.float32)
        static = scheme.input_activations is not None and not scheme.input_activations.dynamic
        kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
        modifier = QuantizationModifier(
            config_groups={"g": scheme},
            ignore=KEEP_LAYER_1 if name.endswith("-keep1") else ["lm_head"],
            kv_cache_scheme=kv if name == "fp8-kv" else None,
        )
        oneshot(
            model=model, tokenizer=tokenizer, shuffle_calibration_samples=False, recipe=modifier,
            dataset=data if static else None, num_calibration_samples=4 if static else 0,
        )  # fmt: skip
        reference = {}
        for module_name, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                zero = getattr(module, "weight_zero_point", None)
                deq = fake_quantize(module.weight, module.weight_scale, zero, scheme.weights)
                reference[f"{module_name}.weight"] = deq.detach().float()
        model.save_pretrained(root / name, save_compressed=True)
        out[name] = (root / name, reference)
    return out


# Per-linear tensor suffixes each algorithm stores (TensorRT-LLM's layer parameters).
LINEAR_SUFFIXES = {
    None: {"weight"},
    "W8A16": {"weight"},
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": {"weight", "per_channel_scale"},
    "W8A8_SQ_PER_CHANNEL": {
        "weight",
        "weights_scaling_factor",
        "activation_scaling_factor",
        "prequant_scaling_factor",
    },
    "FP8": {"weight", "weights_scaling_factor", "activation_scaling_factor"},
    "W4A16_AWQ": {"weight", "weights_scaling_factor", "prequant_scaling_factor"},
}
EXPECTED_ALGO = {
    "none": None,
    "int8-dynamic": "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
    "int8-static": "W8A8_SQ_PER_CHANNEL",
    "fp8-static": "FP8",
    "w4-group-asym": "W4A16_AWQ",
    "w4-group-sym": "W4A16_AWQ",
    "w8-channel": "W8A16",
}
WEIGHT_DTYPE = {  # from a float32 model: the weight-only plugins run in bf16
    None: torch.float32, "W8A16": torch.bfloat16, "FP8": torch.float8_e4m3fn,
    "W4A16_AWQ": torch.int8,
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": torch.int8,
    "W8A8_SQ_PER_CHANNEL": torch.int8,
}  # fmt: skip


def _expected_names(algo: str | None, zero: bool, layer: int) -> set[str]:
    p = f"transformer.layers.{layer}"
    names = {f"{p}.input_layernorm.weight", f"{p}.post_layernorm.weight"}
    suffixes = LINEAR_SUFFIXES[algo] | ({"zero"} if zero else set())
    for linear in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        names |= {f"{p}.{linear}.{s}" for s in suffixes}
    if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
        names |= {f"{p}.attention.dense.smoother", f"{p}.mlp.proj.smoother",
                  f"{p}.input_layernorm.scale_to_int",
                  f"{p}.post_layernorm.scale_to_int"}  # fmt: skip
    return names


def _dequantize(tensors: dict[str, torch.Tensor], prefix: str, algo: str | None) -> torch.Tensor:
    """An independent reading of one written linear back to float [out, in]."""
    weight = tensors[f"{prefix}.weight"]
    if algo in (None, "W8A16"):
        return weight.float()
    if algo == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN":
        return weight.float() * tensors[f"{prefix}.per_channel_scale"].reshape(-1, 1)
    if algo == "W8A8_SQ_PER_CHANNEL":
        return weight.float() * tensors[f"{prefix}.weights_scaling_factor"].reshape(-1, 1)
    if algo == "FP8":
        return weight.float() * tensors[f"{prefix}.weights_scaling_factor"]
    raw = weight.view(torch.uint8).to(torch.int16)
    nibbles = torch.stack([raw & 0xF, raw >> 4], dim=1).reshape(-1, raw.shape[1])
    values = (nibbles - 16 * (nibbles >= 8)).float()
    scale = tensors[f"{prefix}.weights_scaling_factor"].float()
    group = values.shape[1] // scale.shape[1]
    deq = values * scale.repeat_interleave(group, dim=1)
    if f"{prefix}.zero" in tensors:
        deq = deq + tensors[f"{prefix}.zero"].float().t().repeat_interleave(group, dim=1)
    return deq


def _gather(ranks: list[dict[str, torch.Tensor]], layer: int, algo: str | None,
            tp: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """Reassemble full HF-named weights from per-rank TensorRT-LLM tensors."""
    p = f"transformer.layers.{layer}"
    hf = f"model.layers.{layer}"

    def col(name: str) -> list[torch.Tensor]:
        return [_dequantize(r, f"{p}.{name}", algo) for r in ranks]

    q_rows, kv_rows = HEADS // tp * HEAD_DIM, max(KV_HEADS // tp, 1) * HEAD_DIM
    qkv = [t.split([q_rows, kv_rows, kv_rows]) for t in col("attention.qkv")]
    stride = max(tp // KV_HEADS, 1)  # ranks sharing one kv head hold identical copies
    for rank in range(len(ranks)):
        assert torch.equal(qkv[rank][1], qkv[rank - rank % stride][1])
    return {
        f"{hf}.self_attn.q_proj.weight": torch.cat([s[0] for s in qkv]),
        f"{hf}.self_attn.k_proj.weight": torch.cat([s[1] for s in qkv[::stride]]),
        f"{hf}.self_attn.v_proj.weight": torch.cat([s[2] for s in qkv[::stride]]),
        f"{hf}.self_attn.o_proj.weight": torch.cat(col("attention.dense"), dim=1),
        f"{hf}.mlp.gate_proj.weight": torch.cat(col("mlp.fc")),
        f"{hf}.mlp.up_proj.weight": torch.cat(col("mlp.gate")),
        f"{hf}.mlp.down_proj.weight": torch.cat(col("mlp.proj"), dim=1),
    }


CASES = [("none", 4), ("int8-dynamic", 1), ("int8-dynamic", 2), ("int8-static", 2),
         ("fp8-static", 2), ("w4-group-asym", 1), ("w4-group-asym", 2), ("w4-group-sym", 1),
         ("w8-channel", 2)]  # fmt: skip


@pytest.mark.parametrize(("scheme", "tp"), CASES)
def test_checkpoint_format_and_dequantized_weights(
    quantized: dict, tmp_path: Path, scheme: str, tp: int
) -> None:
    src, reference = quantized[scheme]
    written = write_trtllm_checkpoint(src, tmp_path / "ckpt", tp=tp)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    algo = EXPECTED_ALGO[scheme]
    quant = config["quantization"]
    assert quant["quant_algo"] == algo == written.quant_algo
    assert config["mapping"] == {"world_size": tp, "tp_size": tp, "pp_size": 1}
    assert (config["architecture"], config["num_attention_heads"], config["num_key_value_heads"],
            config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (
        "LlamaForCausalLM", HEADS, KV_HEADS, HIDDEN, INTER, VOCAB)  # fmt: skip
    # TensorRT-LLM's defaults restated: its list is replaced by this one, not added to.
    assert quant["exclude_modules"] == (["*lm_head", "*vocab_embedding"] if algo else None)
    assert config["dtype"] == ("bfloat16" if algo in ("W8A16", "W4A16_AWQ") else "float32")
    zero = scheme == "w4-group-asym"
    assert quant["has_zero_point"] is zero
    if algo == "W4A16_AWQ":
        assert (quant["group_size"], quant["pre_quant_scale"]) == (64, True)
    ranks = [load_file(f) for f in written.rank_files]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted(
        ["config.json"] + [f"rank{r}.safetensors" for r in range(tp)]
    )
    kv_local = max(KV_HEADS // tp, 1) * HEAD_DIM
    qkv_out = HEADS // tp * HEAD_DIM + 2 * kv_local
    packed = 2 if algo == "W4A16_AWQ" else 1
    for tensors in ranks:
        for layer in range(LAYERS):
            layer_names = {n for n in tensors if n.startswith(f"transformer.layers.{layer}.")}
            assert layer_names == _expected_names(algo, zero, layer)
            p = f"transformer.layers.{layer}"
            shapes = {
                "attention.qkv": (qkv_out // packed, HIDDEN),
                "attention.dense": (HIDDEN // packed, HIDDEN // tp),
                "mlp.fc": (INTER // tp // packed, HIDDEN),
                "mlp.gate": (INTER // tp // packed, HIDDEN),
                "mlp.proj": (HIDDEN // packed, INTER // tp),
            }
            for linear, shape in shapes.items():
                assert tuple(tensors[f"{p}.{linear}.weight"].shape) == shape, linear
                assert tensors[f"{p}.{linear}.weight"].dtype == WEIGHT_DTYPE[algo]
        assert tuple(tensors["lm_head.weight"].shape) == (VOCAB // tp, HIDDEN)
        assert tuple(tensors["transformer.vocab_embedding.weight"].shape) == (VOCAB // tp, HIDDEN)
        assert tuple(tensors["transformer.ln_f.weight"].shape) == (HIDDEN,)
    for layer in range(LAYERS):
        for name, weight in _gather(ranks, layer, algo, tp).items():
            ref = reference[name].float()
            if algo == "FP8":  # requantized to one scale per layer: within fp8 rounding
                scale = float(ranks[0][f"transformer.layers.{layer}.mlp.fc.weights_scaling_factor"])
                assert ((weight - ref).abs() <= ref.abs() / 16 + 4 * scale * 2**-9).all(), name
            elif algo == "W8A16":  # bf16 weights: within one bf16 rounding
                assert ((weight - ref).abs() <= ref.abs() * 2**-8).all(), name
            elif zero:  # the zero points (-zero * scale) are bf16
                assert ((weight - ref).abs() <= ref.abs().max() * 2**-8).all(), name
            else:
                torch.testing.assert_close(weight, ref, rtol=1e-5, atol=1e-6, msg=name)


def test_static_int8_scales_are_the_input_scales(quantized: dict, tmp_path: Path) -> None:
    """W8A8_SQ_PER_CHANNEL: activation_scaling_factor is the static input scale (one for the fused
    qkv, which shares its input), prequant_scaling_factor is 1 (smoothing is in the weights)."""
    from safetensors import safe_open

    src, _ = quantized["int8-static"]
    write_trtllm_checkpoint(src, tmp_path / "ckpt", tp=2)
    for rank in (0, 1):
        out = load_file(tmp_path / "ckpt" / f"rank{rank}.safetensors")
        with safe_open(str(src / "model.safetensors"), "pt") as f:
            qkv_in = max(f.get_tensor(f"model.layers.0.self_attn.{n}_proj.input_scale").float()
                         for n in "qkv")  # fmt: skip
            down_in = f.get_tensor("model.layers.0.mlp.down_proj.input_scale").float()
        p = "transformer.layers.0"
        torch.testing.assert_close(out[f"{p}.attention.qkv.activation_scaling_factor"],
                                   qkv_in.reshape(1))  # fmt: skip
        torch.testing.assert_close(out[f"{p}.mlp.proj.activation_scaling_factor"],
                                   down_in.reshape(1))  # fmt: skip
        assert torch.equal(out[f"{p}.mlp.proj.prequant_scaling_factor"], torch.ones(INTER // 2))


def test_fp8_kv_cache_scales(quantized: dict, tmp_path: Path) -> None:
    """kv_cache_quant_algo FP8 and one kv_cache_scaling_factor per layer: max(k_scale, v_scale)."""
    from safetensors import safe_open

    src, reference = quantized["fp8-kv"]
    written = write_trtllm_checkpoint(src, tmp_path / "ckpt", tp=2)
    assert written.config["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert written.config["quantization"]["quant_algo"] == "FP8"
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        k, v = (f.get_tensor(f"model.layers.1.self_attn.{n}_scale") for n in "kv")
    for rank_file in written.rank_files:
        scale = load_file(rank_file)["transformer.layers.1.attention.kv_cache_scaling_factor"]
        assert scale.dtype == torch.float32
        torch.testing.assert_close(scale, torch.maximum(k, v).float().reshape(1))
    # A single per-tensor-scaled linear (o_proj) passes through exactly.
    ranks = [load_file(f) for f in written.rank_files]
    full = _gather(ranks, 0, "FP8", 2)["model.layers.0.self_attn.o_proj.weight"]
    torch.testing.assert_close(full, reference["model.layers.0.self_attn.o_proj.weight"])


def test_refusals_name_the_fix(quantized: dict, tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="activations: static"):
        write_trtllm_checkpoint(quantized["fp8-dynamic"][0], tmp_path / "a")
    with pytest.raises(ParallelismError, match=r"build.tp in \{1, 2, 4\}"):
        write_trtllm_checkpoint(quantized["none"][0], tmp_path / "b", tp=3)
    with pytest.raises(ParallelismError, match="pp=3 does not divide"):
        write_trtllm_checkpoint(quantized["none"][0], tmp_path / "c", pp=3)
    # int4 groupwise layers must be multiples of max(64, group) * tp (no channel-moving padding):
    # SmolLM2's 576 hidden features with group 128 are not.
    with pytest.raises(CheckpointFormatError, match="use group_size: 64$"):
        check_groupwise_shape("transformer.layers.0.attention.qkv", 576, 960, 128, 1)
    check_groupwise_shape("transformer.layers.0.attention.qkv", 576, 960, 64, 3)
    # A smaller group cannot help below 64: the tps that fit are named.
    with pytest.raises(CheckpointFormatError, match=r"use build.tp in \{1, 3\}$"):
        check_groupwise_shape("transformer.layers.0.attention.qkv", 576, 960, 64, 4)


def test_kept_layers_are_excluded_as_tensorrt_llm_matches(quantized: dict, tmp_path: Path) -> None:
    """A layer kept 16-bit is named in exclude_modules so that TensorRT-LLM's fnmatch finds it both
    as a module (quantize_layers) and as a weight (weight_only_quantize_dict), the embedding and
    lm_head stay excluded, and its weights are written 16-bit."""
    from fnmatch import fnmatchcase

    written = write_trtllm_checkpoint(quantized["w8-channel-keep1"][0], tmp_path / "ckpt")
    patterns = written.config["quantization"]["exclude_modules"]
    assert written.quant_algo == "W8A16"

    def excluded(name: str) -> bool:
        return any(fnmatchcase(name, p) for p in patterns)

    tensors = load_file(written.rank_files[0])
    for linear in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert excluded(f"transformer.layers.1.{linear}")
        assert excluded(f"transformer.layers.1.{linear}.weight")
        assert not excluded(f"transformer.layers.0.{linear}")
        assert not excluded(f"transformer.layers.0.{linear}.weight")
    assert excluded("lm_head") and excluded("transformer.vocab_embedding")
    assert not excluded("transformer.layers.10.attention.qkv.weight")  # layers.1 is not a prefix
    assert tensors["transformer.layers.1.attention.qkv.weight"].dtype == torch.bfloat16


def test_tensorrt_llm_cannot_hold_these_exclusions(quantized: dict, tmp_path: Path) -> None:
    # The SmoothQuant plugin replaces every decoder layer and never reads exclude_modules.
    with pytest.raises(CheckpointFormatError, match="activations: static"):
        write_trtllm_checkpoint(quantized["int8-dynamic-keep1"][0], tmp_path / "a")
    # Per-stage layer names under one config: stage 0 keeps none, stage 1 its layer 0.
    with pytest.raises(CheckpointFormatError, match="or use build.pp: 1"):
        write_trtllm_checkpoint(quantized["w8-channel-keep1"][0], tmp_path / "b", pp=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_weight_only_dtype_follows_the_gpu(quantized: dict, tmp_path: Path) -> None:
    """fp16 before sm80 (no bf16 tensor cores), bf16 from it; 16-bit models keep their dtype."""
    src = quantized["w4-group-asym"][0]
    pre_ampere = write_trtllm_checkpoint(src, tmp_path / "sm75", arch="sm75")
    hopper = write_trtllm_checkpoint(src, tmp_path / "sm90", arch="sm90")
    kept = write_trtllm_checkpoint(src, tmp_path / "f16", dtype="float16", arch="sm90")
    assert (pre_ampere.config["dtype"], hopper.config["dtype"], kept.config["dtype"]) == (
        "float16", "bfloat16", "float16")  # fmt: skip
    zero = load_file(pre_ampere.rank_files[0])["transformer.layers.0.mlp.fc.zero"]
    assert zero.dtype == torch.float16


def test_fp8_requantize_error_is_reported(quantized: dict, tmp_path: Path) -> None:
    """Per-channel FP8 scales become one per linear: the writer reports the largest relative
    weight error this adds to the evaluated weights, as measured here from the written tensors."""
    src, reference = quantized["fp8-static"]
    written = write_trtllm_checkpoint(src, tmp_path / "ckpt")
    ranks = [load_file(f) for f in written.rank_files]
    errors = []
    for layer in range(LAYERS):
        gathered = _gather(ranks, layer, "FP8", 1)
        hf = f"model.layers.{layer}"
        fused = {
            "qkv": [f"{hf}.self_attn.{n}_proj.weight" for n in "qkv"],
            **{n: [f"{hf}.{n}.weight"] for n in ("self_attn.o_proj", "mlp.gate_proj",
                                                  "mlp.up_proj", "mlp.down_proj")},
        }  # fmt: skip
        for names in fused.values():
            engine = torch.cat([gathered[n] for n in names])
            ref = torch.cat([reference[n].float() for n in names])
            errors.append(float((engine - ref).norm() / ref.norm()))
    assert written.requantize_error > 0
    assert written.requantize_error == pytest.approx(max(errors), rel=1e-4)


def test_pipeline_parallel_splits_layers(quantized: dict, tmp_path: Path) -> None:
    src, reference = quantized["int8-dynamic"]
    written = write_trtllm_checkpoint(src, tmp_path / "ckpt", tp=2, pp=2)
    ranks = [load_file(f) for f in written.rank_files]
    assert written.config["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    first, last = ranks[0], ranks[2]  # rank = pp_rank * tp + tp_rank
    assert "transformer.vocab_embedding.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "transformer.vocab_embedding.weight" not in last
    assert {n.split(".")[2] for n in last if n.startswith("transformer.layers.")} == {"0"}
    # pp stage 1's local layer 0 is the model's layer 1.
    stage1 = _gather(ranks[2:], 0, "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", 2)
    torch.testing.assert_close(stage1["model.layers.0.mlp.down_proj.weight"],
                               reference["model.layers.1.mlp.down_proj.weight"])  # fmt: skip


@pytest.mark.slow
def test_smollm2_int8_tp3(smollm2_checkpoint: Path, tmp_path: Path) -> None:
    """The real model: 9 heads / 3 kv heads cannot split in 2 (clear error); tp=3 does, and the
    written int8 weights equal the quantized model's."""
    from compressed_tensors.quantization import QuantizationArgs as A
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qpipe.export.hf_package import package_checkpoint

    weights = A(num_bits=8, type="int", strategy="channel", symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights,
                                input_activations=A(num_bits=8, type="int", strategy="token",
                                                    dynamic=True))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32)
    oneshot(model=model, recipe=QuantizationModifier(config_groups={"g": scheme},
                                                     ignore=["lm_head"]))  # fmt: skip
    o_proj = model.model.layers[29].self_attn.o_proj
    reference = fake_quantize(o_proj.weight, o_proj.weight_scale, None, weights).detach()
    model.save_pretrained(tmp_path / "q", save_compressed=True)
    del model
    with pytest.raises(ParallelismError, match=r"tp=2 does not divide the model's 9 attention"):
        write_trtllm_checkpoint(tmp_path / "q", tmp_path / "tp2", tp=2)
    written = write_trtllm_checkpoint(tmp_path / "q", tmp_path / "tp3", tp=3, dtype="bfloat16")
    assert written.config["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert written.config["rotary_base"] == 100000.0 and written.config["head_size"] == 64
    ranks = [load_file(f) for f in written.rank_files]
    name = "transformer.layers.29.attention"
    # 3 q heads + 1 k + 1 v head per rank, each 64 rows.
    assert all(tuple(r[f"{name}.qkv.weight"].shape) == (5 * 64, 576) for r in ranks)
    assert all(r["transformer.ln_f.weight"].dtype == torch.bfloat16 for r in ranks)
    dense = torch.cat(
        [r[f"{name}.dense.weight"].float() * r[f"{name}.dense.per_channel_scale"].reshape(-1, 1)
         for r in ranks], dim=1,
    )  # fmt: skip
    torch.testing.assert_close(dense, reference.float(), rtol=1e-5, atol=1e-6)
    # The same quantized model as the compressed-tensors target: transformers loads it and the
    # int8 model still answers.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(smollm2_checkpoint / name, tmp_path / "q" / name)
    files = package_checkpoint(tmp_path / "q", tmp_path / "ct")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ct")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    text = tokenizer.decode(served.generate(ids, max_new_tokens=4, do_sample=False)[0])
    assert "Paris" in text, text
