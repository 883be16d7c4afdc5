"""transformers models under the index: any causal LM run where the native GPT runs (adapter.py),
and the native GPT written as a transformers model (export.py)."""

DTYPES = ("float32", "bfloat16", "float16")  # --dtype: a transformers model's weights
