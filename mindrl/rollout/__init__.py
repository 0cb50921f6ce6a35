"""Rollout: generation engines behind one interface, and moving the actor's weights into them."""
