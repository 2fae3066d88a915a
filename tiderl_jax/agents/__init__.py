"""Agentic environments, multi-turn trajectories and the rollout loop with Continuous Task Batching."""
