"""Agentic RL with DAPO: advantages, dynamic sampling, rollout batches, updates and the loop."""
