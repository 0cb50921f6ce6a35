"""Pure tensor math of the RL losses: advantages, policy losses, KL estimators, aggregation.

No I/O and no distributed calls: every function maps tensors to tensors, so each can be
checked against hand-computed numbers. Each family is a registry keyed by its config name.
"""
