"""Prints the length statistics of the long-answer task's correct responses (tokens of the
character tokenizer), for the task's default settings or a given number of problems.

    python tools/long_answer_stats.py [num_prompts [max_divisor [max_steps]]]   # the demo: 512 5
"""

import sys

from megatron_rlvr.data.long_answers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
