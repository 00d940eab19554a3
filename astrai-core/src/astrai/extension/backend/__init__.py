"""Attention backends: the ABC, the selection policy, torch_native and rotary."""
