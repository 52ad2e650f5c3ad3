"""Worked examples of user tools, environments, rewards and teachers (docs/tools_and_rollouts.md)."""
