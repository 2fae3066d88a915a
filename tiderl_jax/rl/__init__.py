"""The learning side: advantages, losses, scoring and the sharded train step (issue 5)."""
