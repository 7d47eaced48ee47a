"""Megatron-Core learner: parallel init, model from an HF config, logprobs, train step,
routing replay, checkpoints. The only package that touches Megatron's parallel state."""

from typing import Any

# One model chunk: Megatron-Core's GPTModel (one per virtual pipeline stage). Megatron ships no
# type information, and a chunk's parts are reached as attributes (decoder.layers, mlp.router)
# that torch's Module.__getattr__ types as Tensor | Module; to the type checker a chunk is Any.
ModelChunk = Any
