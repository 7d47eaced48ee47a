"""Memory per GPU before a job is queued: `megatron-rlvr plan`, and the check `submit` runs.
From the model's config.json and the run's config alone (no torch): the learner's model state
as Megatron-Core allocates it, what each micro-batch adds (activations, logits, routing replay,
sync buckets), and each SGLang engine's weights and KV cache."""
