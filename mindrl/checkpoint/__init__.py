"""Megatron checkpoint layout on disk, atomic directory writes, and loading per rank."""
