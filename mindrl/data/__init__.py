"""Prompt templates, tokenizers, dataset reading, synthetic problems and preprocessing."""
