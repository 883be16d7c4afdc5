"""Evaluation: held-out perplexity, downstream multiple-choice tasks, saved per-token outputs."""
