"""Supervised fine-tuning (`megatron-rlvr sft`): the cold start an RL run begins from.

data      conversations → token ids and assistant masks; token-budget batches
rank      one learner rank of an SFT run, and the HF export
command   the run: steps, held-out loss, checkpoints, export, pass@1
"""
