"""HF ↔ Megatron-Core checkpoints through mbridge, in any parallel layout, checked on the way:
every tensor round-trips bitwise and the converted model's logits are compared with HF
transformers'. Conversion bugs are otherwise silent until rollouts turn to gibberish."""
