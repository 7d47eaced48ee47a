"""The math domain: the final answer found in a response and compared with the reference by a
bounded parser and sympy, the whole verdict in killable worker processes (workers.py)."""
