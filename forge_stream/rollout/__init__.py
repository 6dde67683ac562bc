"""The agent side: a rollout controller that turns tasks into groups of sessions run by unmodified agents."""
