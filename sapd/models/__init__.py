"""Models: loading (local folders or synced from S3), the tokenizer-identity check, generation
backends (HF transformers, vLLM) and teacher scoring."""
