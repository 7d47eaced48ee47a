"""Episodes: multi-turn rollouts with tool calls (issue 49)."""
