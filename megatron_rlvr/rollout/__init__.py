"""Rollout side: the SGLang API protocol, engines, and the data they return."""
