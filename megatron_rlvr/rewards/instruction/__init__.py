"""The instruction-following verifier (`ifeval`): IFEval's and IFBench's checkers from the
if-verifiable package score a response against the record's constraints (ground_truth.py reads
the record layouts, checkers.py runs the library's checks, verifier.py and worker.py run them
in the sandbox). Everything the checkers read is on this machine (nltk_data.py): nothing
downloads."""
