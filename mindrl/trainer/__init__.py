"""The GRPO driver: configuration, resource pools, the training loop."""
