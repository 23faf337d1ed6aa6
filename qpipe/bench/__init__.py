"""Throughput checks of OpenAI-compatible servers, measured the way `vllm bench serve` measures.

dataset (prompts) → client (async streaming load) → metrics (vLLM's figures) → runner (levels) →
history (SQLite) → regression (vs the accepted baseline); plots and the `qpipe bench` CLI on top.
"""
