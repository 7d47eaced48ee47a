"""The code domain: model-written code run against a record's tests in the sandbox
(rewards/runner.py), every comparison made here, outside the sandbox (asserts.py, values.py)."""
