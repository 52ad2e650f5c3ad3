"""Train state, optimizer and the jitted, sharded language-model training step."""
