"""Agentic episodes: a rollout that calls tools between model turns, token in and token out.

tools.py (Tool, functions as tools, the calculator and Python tools, the pool that runs calls),
parsers.py (tool calls in each family's format), render.py (the tool turn's tokens and the
exact-prefix check), episode.py (the per-episode state machine). docs/agents.md is the reference.
"""
