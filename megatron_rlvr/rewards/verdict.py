"""What every verifier returns for one response: (reward, reason). The reason names why the
reward is what it is (`exact`, `wrong_answer`, `timeout`, ...) and is counted in the run's
metrics as `verifier/<reason>`."""

Verdict = tuple[float, str]
