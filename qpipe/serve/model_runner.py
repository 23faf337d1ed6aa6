"""Runs one scheduled batch: flat inputs, slot mapping and block tables -> model -> sampled tokens.

It also owns the KV cache, sized once at start from the memory left after the weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from itertools import accumulate
from pathlib import Path
from typing import Literal

import torch

from qpipe.serve.config import EngineConfig
from qpipe.serve.decode_graphs import DecodeGraphs
from qpipe.serve.host_memory import keep_freed_memory
from qpipe.serve.layers import cpu_kernels, triton_attention
from qpipe.serve.layers.attention import (
    AttentionMetadata,
    PrefillChunks,
    PrefillSpan,
    layer_caches,
)
from qpipe.serve.layers.fp8 import FP8_CAPABILITY
from qpipe.serve.layers.sampler import sample, token_logprobs
from qpipe.serve.loader import load_model, read_config_json, resolve_dtype
from qpipe.serve.models.llama import head_dim_of
from qpipe.serve.sampling_params import SamplingParams
from qpipe.serve.scheduler import ScheduledBatch, ScheduledSeq
from qpipe.serve.sequence import Sequence

log = logging.getLogger(__name__)

GIB = 1 << 30
PROMPT_LOGPROB_SLICE = 256  # prompt rows projected to the vocabulary at a time
PROFILE = SamplingParams(max_tokens=1)  # the profiling step's sequences sample nothing


@dataclass(frozen=True)
class StepResult:
    """What one step computed: (token, logprobs) per request id whose chunk ended its tokens, and
    the prompt logprobs of the prompt tokens this step's chunks predicted, per request id."""

    sampled: dict[str, tuple[int, dict[int, float] | None]]
    prompt_logprobs: dict[str, list[dict[int, float]]]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "EngineConfig.device is 'cuda' but torch sees no GPU; use device='cpu'"
            )
        if config.device == "cpu":
            keep_freed_memory()
        path = Path(config.model)
        raw = read_config_json(path)
        self.dtype = resolve_dtype(config.dtype, config.device, raw)
        limit = raw.get("max_position_embeddings", config.max_model_len_cap)
        limit_name = "max_position_embeddings"
        window = sliding_window(raw)
        if window is not None and window < limit:
            limit, limit_name = window, "sliding_window"
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"EngineConfig.max_model_len={config.max_model_len} exceeds the checkpoint's "
                f"{limit_name}={limit}; lower it"
            )
        # the cap bounds the default only: a max_model_len asked for is taken as asked
        max_len = config.max_model_len or min(limit, config.max_model_len_cap)
        if config.max_model_len is None and limit > max_len:
            log.info(
                "max_model_len %d (the checkpoint's %s is %d; --max-model-len raises it)",
                max_len, limit_name, limit,
            )  # fmt: skip
        elif limit_name == "sliding_window" and config.max_model_len is None:
            log.info("max_model_len %d: the checkpoint's sliding attention window", max_len)
        torch.manual_seed(config.seed)
        self.model = load_model(
            path, self.dtype, config.device, max_len, batch_hint=min(config.max_num_seqs, 256)
        )
        # the loaded layers hold the checkpoint's (or artifact's) fp8 KV scales, if it has them
        calibrated = any(layer.kv_scales is not None for layer in self.model.layers)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.device, calibrated
        )
        self._log_kv_scales()
        hf = self.model.config
        eos = raw.get("eos_token_id")
        self.eos_token_ids = frozenset(
            eos if isinstance(eos, list) else [] if eos is None else [eos]
        )
        self.vocab_size: int = hf.vocab_size
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = head_dim_of(hf)
        # a paged attention kernel: Triton's run the decodes and every prefill chunk on GPU, the
        # C++ one every query on CPU
        self.kernel_family: Literal["triton", "cpu"] = (
            "triton" if self.device.type == "cuda" else "cpu"
        )
        if self.kernel_family == "triton":
            self.attention_kernel = triton_attention.available() and triton_attention.fits(
                self.head_dim, self.block_size
            )
        else:
            self.attention_kernel = cpu_kernels.serves(self.device, self.dtype) and (
                cpu_kernels.attention_fits(self.head_dim, self.block_size)
            )
        self.num_kv_blocks = self._count_kv_blocks(max_len)
        capacity = self.num_kv_blocks * self.block_size
        if capacity < max_len:
            if config.max_model_len is not None:
                # as vLLM: a length asked for is served in full or refused, never quietly lowered
                raise ValueError(
                    f"EngineConfig.max_model_len={max_len} but the KV cache holds {capacity} "
                    f"tokens ({self.num_kv_blocks} blocks of {self.block_size}); give it more "
                    "memory (EngineConfig.kv_cache_memory_gib on CPU, "
                    "EngineConfig.gpu_memory_utilization on GPU) or lower "
                    "EngineConfig.max_model_len"
                )
            log.warning(
                "KV cache holds %d tokens < max_model_len %d: capping max_model_len",
                capacity,
                max_len,
            )
        self.max_model_len = min(max_len, capacity)
        # one block past those the scheduler hands out: the scratch block of padded decode rows
        self.scratch_block = self.num_kv_blocks
        self.kv_cache = torch.zeros(
            self.num_layers, 2, self.num_kv_blocks + 1, self.block_size, self.num_kv_heads,
            self.head_dim, dtype=self.kv_cache_dtype, device=self.device,
        )  # fmt: skip
        self.layer_caches = layer_caches(self.kv_cache)
        log.info(
            "KV cache: %d blocks of %d tokens in %s (%.2f GiB); max concurrency at max_model_len "
            "%d: %d; steps of at most %d tokens",
            self.num_kv_blocks, self.block_size, self.kv_cache_dtype_name,
            self.kv_cache.nbytes / GIB, self.max_model_len,
            self.num_kv_blocks // -(-self.max_model_len // self.block_size), config.token_budget,
        )  # fmt: skip
        if self.kernel_family == "triton" and self.attention_kernel:
            self.warm_up()
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.attention_kernel and not config.enforce_eager:
            self.decode_graphs = self.static_decode(min(config.max_num_seqs, 512))
            self.decode_graphs.capture()

    def _log_kv_scales(self) -> None:
        scales = [layer.kv_scales for layer in self.model.layers if layer.kv_scales is not None]
        if not scales:
            if self.kv_cache_dtype == torch.float8_e4m3fn:
                log.warning(
                    "--kv-cache-dtype %s but the checkpoint calibrated no KV scales: K and V are "
                    "stored with a scale of 1, and accuracy may suffer; calibrate them with the "
                    "recipe's quantization.kv_cache: fp8",
                    self.config.kv_cache_dtype,
                )
            return
        if self.kv_cache_dtype != torch.float8_e4m3fn:
            log.info("the checkpoint's fp8 KV scales are unused: the cache is %s",
                     self.kv_cache_dtype_name)  # fmt: skip
            return
        pairs = [layer.values() for layer in scales]
        k = [x for ks, _ in pairs for x in ks]
        v = [x for _, vs in pairs for x in vs]
        log.info(
            "fp8 KV cache divided by the checkpoint's scales: k_scale %.3g-%.3g, v_scale %.3g-%.3g",
            min(k), max(k), min(v), max(v),
        )  # fmt: skip

    def static_decode(self, max_batch: int) -> DecodeGraphs:
        """Static decode buffers over this runner's model and KV cache: captured into CUDA graphs
        on a GPU, run as they are elsewhere."""
        max_blocks = -(-self.max_model_len // self.block_size)
        return DecodeGraphs(
            self.model, self.layer_caches, max_batch, max_blocks, self.scratch_block
        )

    @property
    def kv_cache_dtype_name(self) -> str:
        """The cache's dtype as logs, /metrics and bench results name it ("float8_e4m3fn")."""
        return str(self.kv_cache_dtype).removeprefix("torch.")

    @property
    def block_bytes(self) -> int:
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _count_kv_blocks(self, max_len: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.device == "cuda":
            budget = self._profile_gpu_free_bytes(max_len)
        else:
            # the largest step's activations first: glibc keeps what they freed in the process
            # (host_memory.py), so what is still available after them is what the cache can use
            self.profile_forward(max_len)
            budget = int(self.config.kv_cache_memory_gib * GIB)
            available = _available_host_bytes()
            if available is not None and budget > available:
                raise ValueError(
                    f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} but only "
                    f"{available / GIB:.1f} GiB of RAM is available after loading the weights "
                    "and a forward pass of the largest step; "
                    "lower --kv-cache-memory"
                )
        blocks = budget // self.block_bytes
        if blocks < 1:
            raise ValueError(
                f"no room for a single KV block ({self.block_bytes} bytes); give the KV cache "
                "more memory (--kv-cache-memory on CPU, --gpu-memory-utilization on GPU)"
            )
        return blocks

    def profile_forward(self, max_len: int) -> torch.Tensor:
        """The largest step the scheduler may form: max_num_batched_tokens fresh prompt tokens,
        as prompts of at most `max_len` tokens (positions past it have no rotary entry), on a
        scratch cache of their own. It goes through `_prepare` like any step, so it measures the
        attention path the server runs (the C++ kernel on CPU). Returns the logits of the last
        prompt's last token; prompt tokens are their positions (mod the vocabulary)."""
        tokens = min(self.config.token_budget, self.config.max_model_len_cap)
        seq_len = min(tokens, max_len)
        items, blocks = [], 0
        for start in range(0, tokens, seq_len):
            n = min(seq_len, tokens - start)
            seq = Sequence(f"profile-{start}", [p % self.vocab_size for p in range(n)], PROFILE)
            seq.block_table = list(range(blocks, blocks + -(-n // self.block_size)))
            blocks += len(seq.block_table)
            items.append(ScheduledSeq(seq, 0, n, samples=True))
        scratch = torch.zeros(
            self.num_layers, 2, blocks, self.block_size, self.num_kv_heads, self.head_dim,
            dtype=self.kv_cache_dtype, device=self.device,
        )  # fmt: skip
        input_ids, positions, meta = self._prepare(DecodeRows(), items)
        with torch.inference_mode():
            last = torch.tensor([tokens - 1], device=self.device)
            return self.model(input_ids, positions, layer_caches(scratch), meta, last)

    def warm_up(self) -> None:
        """One mixed step at start, in the scratch block only: a decode, a fresh prompt and a chunk
        after cached context. Triton compiles a kernel at its first call; the profiling pass runs
        fresh prompts alone, and graph capture (none with `enforce_eager`) decodes alone and not
        eagerly. Without this step the first mixed step could compile a kernel mid-serving,
        stalling every running request (a compile: ~0.4-0.9 s on a 2-core host)."""
        # a context of one block, within the rotary table (positions < max_model_len); a model
        # too short for a 2-token chunk after any context never runs one
        context = min(self.block_size, self.max_model_len - 2)
        if context < 1:
            return
        table = [self.scratch_block] * 2  # nothing else is written, and nothing reads it after

        def scratch(name: str, length: int, start: int, count: int) -> ScheduledSeq:
            seq = Sequence(f"warm-up-{name}", [p % self.vocab_size for p in range(length)], PROFILE)
            seq.block_table = table
            return ScheduledSeq(seq, start, count, samples=True)

        decode = scratch("decode", context + 1, context, 1)
        chunk = scratch("chunk", context + 2, context, 2)
        prefills = [scratch("prompt", 2, 0, 2), chunk]  # fresh prompts first, as `run` orders them
        input_ids, positions, meta = self._prepare(self._decode_rows([decode]), prefills)
        assert meta.chunks is not None and meta.num_decode_tokens == 1
        with torch.inference_mode():
            last = torch.tensor([len(input_ids) - 1], device=self.device)
            self.model(input_ids, positions, self.layer_caches, meta, last)

    def _profile_gpu_free_bytes(self, max_len: int) -> int:
        """Run the biggest batch the scheduler may form, then hand the KV cache what is left of
        the allowed share of GPU memory beyond that peak."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.profile_forward(max_len)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        return int(total * self.config.gpu_memory_utilization - used_by_others - peak)

    def new_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        decodes = [item for item in batch.items if item.num_new_tokens == 1]
        # fresh prompts of one length side by side: their attention runs as one batched call
        prefills = sorted(
            (item for item in batch.items if item.num_new_tokens > 1),
            key=lambda it: (it.start > 0, it.num_new_tokens),
        )
        ordered = decodes + prefills
        sampling = [i for i, it in enumerate(ordered) if it.samples]
        rows = self._decode_rows(decodes)
        graphs = self.decode_graphs
        prompt_rows = prompt_logprob_rows(ordered)
        if not prefills and graphs is not None and graphs.fits(len(decodes), rows.width):
            logits = graphs.run(
                torch.tensor(rows.ids), torch.tensor(rows.positions), torch.tensor(rows.slots),
                torch.tensor(padded_tables(rows.tables), dtype=torch.int32),
                torch.tensor(rows.context_lens, dtype=torch.int32),
            )  # fmt: skip
            # a decode-only step: row i is item i, and a 1-token prefill chunk may score a prompt
            picked = sampling + prompt_rows.flat
            if picked != list(range(len(decodes))):
                logits = logits[torch.tensor(picked, device=self.device)]
            prompt_logits = [logits[len(sampling) :]] if prompt_rows.flat else []
        else:
            input_ids, positions, meta = self._prepare(rows, prefills)
            ends = torch.tensor([it.num_new_tokens for it in ordered]).cumsum(0) - 1
            indices = ends[sampling]
            if prompt_rows.flat:
                indices = torch.cat([indices, torch.tensor(prompt_rows.flat, dtype=torch.long)])
            hidden = self.model.final_hidden(
                input_ids, positions, self.layer_caches, meta, indices.to(self.device)
            )
            logits = self.model.compute_logits(hidden[: len(sampling)])
            # prompt rows projected a slice at a time: a 2,048-token chunk's [rows, vocab] logits
            # at once would be GiBs that the memory profile never saw
            prompt_logits = (
                self.model.compute_logits(hidden[first : first + PROMPT_LOGPROB_SLICE])
                for first in range(len(sampling), len(hidden), PROMPT_LOGPROB_SLICE)
            )
        result = StepResult({}, {})
        done = 0
        for block in prompt_logits:
            span = slice(done, done + len(block))
            entries = token_logprobs(block, prompt_rows.targets[span], prompt_rows.top[span])
            for request_id, entry in zip(prompt_rows.request_ids[span], entries, strict=True):
                result.prompt_logprobs.setdefault(request_id, []).append(entry)
            done += len(block)
        if sampling:
            seqs = [ordered[i].seq for i in sampling]
            tokens, logprobs = sample(logits[: len(sampling)], seqs, self.eos_token_ids)
            for seq, token, entry in zip(seqs, tokens, logprobs, strict=True):
                result.sampled[seq.request_id] = (token, entry)
        return result

    def _decode_rows(self, decodes: list[ScheduledSeq]) -> DecodeRows:
        bs = self.block_size
        positions = [item.start for item in decodes]
        tables = [item.seq.block_table for item in decodes]
        return DecodeRows(
            ids=[item.seq.token_ids[item.start] for item in decodes],
            positions=positions,
            slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)],
            tables=tables,
            context_lens=[p + 1 for p in positions],
        )

    def _prepare(
        self, rows: DecodeRows, prefills: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat inputs of a mixed step: the decode rows first, then each prefill chunk (`run`
        puts the fresh prompts before the chunks after cached context). The CPU kernel reads
        every chunk through its block table too; on GPU every prefill chunk goes to the Triton
        context kernel in one call; for SDPA, runs of fresh prompts of one length become one
        span."""
        bs = self.block_size
        ids, pos, slots = list(rows.ids), list(rows.positions), list(rows.slots)
        in_kernel = self.attention_kernel and self.kernel_family == "cpu"
        chunk_kernel = self.attention_kernel and self.kernel_family == "triton"
        tables, seq_lens = list(rows.tables), list(rows.context_lens)
        spans: list[PrefillSpan] = []
        for item in prefills:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            if in_kernel:
                tables.append(self._covering(item))
                seq_lens.append(start + n)
            elif not chunk_kernel:
                self._add_span(spans, item, len(ids))
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n))
        block_tables = lens = query_starts = mask = None
        if tables:
            block_tables = torch.tensor(
                padded_tables(tables), dtype=torch.int32, device=self.device
            )
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        if in_kernel:
            counts = [1] * len(rows.ids) + [item.num_new_tokens for item in prefills]
            query_starts = torch.tensor(list(accumulate(counts, initial=0)), dtype=torch.int32)
        elif lens is not None and not self.attention_kernel:
            offsets = torch.arange(rows.width * bs, device=self.device)
            beyond = offsets[None, :] >= lens[:, None]
            mask = torch.zeros(beyond.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill_(beyond, float("-inf"))[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decode_tokens=len(rows.ids),
            block_tables=block_tables,
            seq_lens=lens,
            query_starts=query_starts,
            decode_mask=mask,
            prefills=tuple(spans),
            chunks=self._prefill_chunks(prefills, len(ids)) if chunk_kernel else None,
        )
        return torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), meta

    def _covering(self, item: ScheduledSeq) -> list[int]:
        """The blocks of `item`'s sequence up to the end of its chunk."""
        return item.seq.block_table[: -(-(item.start + item.num_new_tokens) // self.block_size)]

    def _add_span(self, spans: list[PrefillSpan], item: ScheduledSeq, token_start: int) -> None:
        """SDPA's share of one chunk, added to `spans`: a fresh prompt joins the span before it
        when that holds fresh prompts of its length; a chunk after cached context reads that
        context through its block table."""
        start, n = item.start, item.num_new_tokens
        last = spans[-1] if spans else None
        if start == 0 and last and last.context_start == 0 and last.num_tokens == n:
            spans[-1] = replace(last, num_seqs=last.num_seqs + 1)
            return
        table = torch.tensor(self._covering(item), device=self.device) if start > 0 else None
        spans.append(PrefillSpan(token_start, n, start, table))

    def _prefill_chunks(self, prefills: list[ScheduledSeq], num_rows: int) -> PrefillChunks | None:
        """Every prefill chunk of the step, fresh prompts and chunks after cached context alike,
        for the Triton kernel: the last rows of the step's `num_rows`, after the decodes."""
        if not prefills:
            return None
        counts = [item.num_new_tokens for item in prefills]
        ends = [item.start + item.num_new_tokens for item in prefills]
        tables = [self._covering(item) for item in prefills]
        return PrefillChunks(
            row_start=num_rows - sum(counts),
            block_tables=torch.tensor(padded_tables(tables), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(ends, dtype=torch.int32, device=self.device),
            query_starts=torch.tensor(
                list(accumulate(counts, initial=0)), dtype=torch.int32, device=self.device
            ),
            max_queries=max(counts),
        )


@dataclass
class PromptLogprobRows:
    """Rows of a step whose logits predict a prompt token of a sequence that asked for prompt
    logprobs: their flat index in the batch, the token they predict, how many top tokens."""

    flat: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top: list[int | None] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)


def prompt_logprob_rows(ordered: list[ScheduledSeq]) -> PromptLogprobRows:
    """The prompt positions each chunk computes whose successor is a prompt token not yet
    scored; a chunk replayed after preemption scores nothing twice."""
    rows = PromptLogprobRows()
    offset = 0
    for item in ordered:
        seq = item.seq
        if seq.needs_prompt_logprobs:
            assert seq.prompt_logprobs is not None
            first = max(item.start, len(seq.prompt_logprobs) - 1)
            last = min(item.start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            for position in range(first, last):
                rows.flat.append(offset + position - item.start)
                rows.targets.append(seq.token_ids[position + 1])
                rows.top.append(seq.params.prompt_logprobs)
                rows.request_ids.append(seq.request_id)
        offset += item.num_new_tokens
    return rows


@dataclass
class DecodeRows:
    """The single-token queries of a step, as host lists."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tables), default=0)


def padded_tables(tables: list[list[int]]) -> list[list[int]]:
    """Block tables padded with block 0 to one width; nothing reads past a row's length."""
    width = max((len(t) for t in tables), default=0)
    return [t + [0] * (width - len(t)) for t in tables]


def resolve_kv_cache_dtype(
    requested: str, dtype: torch.dtype, device: torch.device, calibrated_fp8: bool = False
) -> torch.dtype:
    """What the KV cache holds. Decode attention reads every cached K and V of every running
    sequence each step, so a narrower cache is both room for more sequences and less to read:
    bf16 halves an fp32 model's cache, fp8 e4m3 halves a 16-bit one's. fp8 values are divided
    by the checkpoint's calibrated per-layer scales (`calibrated_fp8`), else stored with a
    scale of 1, as vLLM does without them: beyond +-448 they saturate, below 2^-6 they lose
    mantissa bits, and each keeps 3. Attention widens them to fp32 on load (the C++ and Triton
    kernels) or before SDPA. "auto" is fp8 for a checkpoint that calibrated it (the artifact
    was measured that way, as TensorRT-LLM's engines are), else the model's dtype."""
    if requested == "auto" and not calibrated_fp8:
        return dtype
    if requested == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_CAPABILITY:
            if requested == "auto":
                log.warning(
                    "the checkpoint calibrated an fp8 KV cache, but Triton reads fp8 from "
                    "compute capability 8.9 on and this GPU is %d.%d: the cache holds %s",
                    major, minor, str(dtype).removeprefix("torch."),
                )  # fmt: skip
                return dtype
            raise ValueError(
                f"kv_cache_dtype={requested!r}: Triton reads fp8 from compute capability 8.9 "
                f"(Ada, Hopper) on; this GPU is {major}.{minor}. Use --kv-cache-dtype auto or "
                "bfloat16"
            )
    return torch.float8_e4m3fn


def sliding_window(raw: dict) -> int | None:
    """The attention window of a checkpoint that uses one (Mistral 7B v0.1: 4,096 tokens; Qwen2
    only with `use_sliding_window`). The engine attends to the whole context, which equals
    windowed attention only while the context fits the window, so the window caps
    max_model_len."""
    window = raw.get("sliding_window")
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return None
    return window if isinstance(window, int) else None


def _available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
