"""Did quantization hurt? Candidate vs baseline: KLD/perplexity, lm-eval tasks, significance."""
