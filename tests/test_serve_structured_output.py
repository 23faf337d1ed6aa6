"""Structured outputs on the real SmolLM2: constrained greedy decoding equals transformers'
`generate` with xgrammar's own logits processor, in one batch with an unconstrained request,
through preemption; sampled outputs always keep to their grammar; bad constraints are errors
that queue nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from qpipe.serve.config import EngineConfig
from qpipe.serve.engine import LLMEngine
from qpipe.serve.sampling_params import SamplingParams, StructuredOutput
from qpipe.serve.structured_output import choice_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
CASES = [  # (question, constraint, checks the text)
    (
        "Describe a person who lives in Europe as JSON.",
        StructuredOutput("json_schema", json.dumps(PERSON)),
        lambda text: (
            set(json.loads(text)) == {"name", "age", "city"}
            and isinstance(json.loads(text)["age"], int)
        ),
    ),
    (
        "Write a US phone number.",
        StructuredOutput("regex", PHONE),
        lambda text: re.fullmatch(PHONE, text) is not None,
    ),
    (
        "Is this review positive, negative or neutral? 'The soup was cold and the waiter rude.'",
        StructuredOutput("grammar", choice_grammar(CHOICES)),
        lambda text: text in CHOICES,
    ),
    (
        "Give a JSON object with the key 'fruit' set to your favourite fruit.",
        StructuredOutput("json_object"),
        lambda text: isinstance(json.loads(text), dict),
    ),
]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2_engine: LLMEngine) -> Iterator[LLMEngine]:
    yield smollm2_engine
    stats = smollm2_engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "no KV block leaks"


def chat(engine: LLMEngine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return engine.tokenizer.encode(text, add_special_tokens=False)


def text_of(engine: LLMEngine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_constrained_greedy_equals_transformers_with_xgrammar(
    engine: LLMEngine, smollm2_checkpoint: Path
) -> None:
    """Each constraint's greedy tokens equal transformers' greedy `generate` with xgrammar's HF
    logits processor on the same grammar, while an unconstrained request shares the batches and
    keeps its own tokens; every constrained text is complete and valid, ended by EOS."""
    import xgrammar
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    prompts = [chat(engine, question) for question, _, _ in CASES]
    free_prompt = chat(engine, CASES[0][0])
    for i, (prompt, (_, spec, _)) in enumerate(zip(prompts, CASES, strict=True)):
        engine.add_request(f"c{i}", prompt, replace(GREEDY, structured_output=spec))
    engine.add_request("free", free_prompt, GREEDY)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.request_id != "free":
                assert out.finish_reason == "stop", (out.request_id, out.finish_reason)

    for i, (prompt, (_, spec, valid)) in enumerate(zip(prompts, CASES, strict=True)):
        processor = xgrammar.contrib.hf.LogitsProcessor(engine.grammars.compile(spec))
        with torch.inference_mode():
            generated = hf.generate(
                torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                logits_processor=[processor], pad_token_id=engine.tokenizer.eos_token_id,
            )  # fmt: skip
        assert outs[f"c{i}"] == generated[0, len(prompt) :].tolist()
        assert outs[f"c{i}"][-1] in engine.eos_token_ids
        text = text_of(engine, outs[f"c{i}"])
        assert valid(text), text
    assert outs["free"] == engine.generate([free_prompt], GREEDY)[0]
    assert outs["free"] != outs["c0"]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_sampled_choices_keep_to_the_grammar_through_preemption(
    engine: LLMEngine, smollm2_checkpoint: Path
) -> None:
    """Seeded samples at temperature 1.5 (where SmolLM2 wanders) are still valid, the same on an
    engine so tight that requests are preempted and recomputed: each matcher is fed exactly the
    tokens its sequence keeps."""
    cases = [case for case in CASES if case[1].kind != "json_object"]  # bounded outputs
    prompts, params = [], []
    for question, spec, _ in cases:
        for seed in range(3):
            prompts.append(chat(engine, question))
            params.append(
                SamplingParams(max_tokens=64, temperature=1.5, seed=seed, structured_output=spec)
            )

    def run(target: LLMEngine) -> list[list[int]]:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            target.add_request(f"s{i}", prompt, p)
        outs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
        while target.has_unfinished():
            for out in target.step():
                outs[out.request_id] += out.new_token_ids
        return list(outs.values())

    reference = run(engine)
    for i, (_, _, valid) in enumerate(cases):
        texts = [text_of(engine, tokens) for tokens in reference[3 * i : 3 * i + 3]]
        assert all(valid(text) for text in texts), texts
    tight = LLMEngine(
        EngineConfig(
            model=str(smollm2_checkpoint), dtype="float32", num_kv_blocks=14,
            enable_prefix_caching=False,
        )
    )  # fmt: skip
    assert run(tight) == reference
    stats = tight.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bad_constraints_are_errors_that_queue_nothing(engine: LLMEngine) -> None:
    prompt = chat(engine, "Hi")
    for spec, message in [
        (StructuredOutput("regex", r"(\d+"), "regex does not compile: .*parenthesis"),
        (StructuredOutput("json_schema", '{"type": "thing"}'), 'Unsupported type "thing"'),
        (StructuredOutput("grammar", 'answer ::= "yes"'), 'root rule with name "root"'),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, replace(GREEDY, structured_output=spec))
        assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        replace(GREEDY, min_tokens=2, structured_output=StructuredOutput("json_object"))
    with pytest.raises(ValueError, match="at least one non-empty"):
        choice_grammar(["yes", ""])


def test_forced_tool_call_schemas_and_reading_back() -> None:
    """What a forced call constrains the output to, and how its text is read back: a named call
    is its arguments; "required" an array of calls; output cut short (max_tokens) stays text."""
    from qpipe.serve.openai_protocol import ChatTool, NamedToolChoice
    from qpipe.serve.tool_calls import NO_PARAMETERS, ForcedToolCall

    weather = ChatTool.model_validate(
        {"function": {"name": "weather", "parameters": {"type": "object", "required": ["city"]}}}
    )
    clock = ChatTool.model_validate({"function": {"name": "clock"}})
    named = ForcedToolCall.of(
        [weather, clock], NamedToolChoice.model_validate({"function": {"name": "clock"}})
    )
    assert named is not None and named.finish_reason == "stop"
    assert json.loads(named.structured_output().value) == NO_PARAMETERS
    (call,) = named.calls("{ }")
    assert (call.function.name, call.function.arguments) == ("clock", "{ }")
    required = ForcedToolCall.of([weather, clock], "required")
    assert required is not None and required.finish_reason == "tool_calls"
    schema = json.loads(required.structured_output().value)
    assert schema["minItems"] == 1
    assert [s["properties"]["name"] for s in schema["items"]["anyOf"]] == [
        {"enum": ["weather"]}, {"enum": ["clock"]},
    ]  # fmt: skip
    calls = required.calls('[{"name": "weather", "parameters": {"city": "Rome"}}, '
                           '{"name": "clock", "parameters": {}}]')  # fmt: skip
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Rome"}), ("clock", {}),
    ]  # fmt: skip
    assert len({c.id for c in calls}) == 2
    assert required.calls('[{"name": "weather", "parameters": {"ci') is None
    assert ForcedToolCall.of([weather], "none") is None and ForcedToolCall.of(None, None) is None
    for choice, message in [("auto", "'auto'"), (None, "'auto'")]:
        with pytest.raises(ValueError, match=message):
            ForcedToolCall.of([weather], choice)
