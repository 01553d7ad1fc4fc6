"""Memory and out-of-memory: which errors are out of memory (`oomforms`), retrying a step in
smaller micro-batches (`oom`, `batching`) and doing so inside the HF Trainer (`microbatch`),
training arguments that fit the GPU (`recipes`), and checks before training (`preflight`)."""
