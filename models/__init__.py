"""Policies: where a model's weights and tokenizer come from, and how it is fine-tuned."""
