"""Prints the length statistics of the long-answer task's correct responses (tokens of the
character tokenizer) and how many distinct problems its settings allow, for the task's default
settings or the ones given as key=value (the fields of data.type long_answers).

    python tools/long_answer_stats.py problem=odd_count max_steps=32 tail_exponent=1.0   # the demo
    python tools/long_answer_stats.py max_divisor=5                                      # the remainder demo
"""

import sys

from megatron_rlvr.data.long_answers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
