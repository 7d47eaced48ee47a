"""Orchestration: Ray (local or an existing cluster), the learner ranks, engine hosts and
verifier workers as actors or in-process objects, and Slurm submission."""
