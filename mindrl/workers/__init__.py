"""Role workers: Megatron actor / reference, and how a batch is split over their ranks."""
