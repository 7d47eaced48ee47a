"""Pure tensor functions of the RL algorithm: no process groups, no I/O."""
