"""Models: the tiny Qwen3-MoE and char tokenizer, the supervised warm start, R3 hooks."""
