"""Megatron-Core learner: parallel init, model from an HF config, logprobs, train step,
routing replay, checkpoints. The only package that touches Megatron's parallel state."""
