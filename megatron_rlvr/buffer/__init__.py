"""The rollout buffer: useful groups in, exact-size batches out."""
