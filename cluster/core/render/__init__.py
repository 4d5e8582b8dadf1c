"""Rendering: items to chat messages, the incremental renderer, its start-up probe, the tokenizer."""
