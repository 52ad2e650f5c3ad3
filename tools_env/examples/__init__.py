"""Worked examples of a user's tools, environments, rewards and teachers
(docs/tools_and_rollouts.md, "Add your own tool")."""
