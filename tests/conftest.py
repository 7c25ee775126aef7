"""Shared pytest setup: CPU only, float32 by default (tests needing float64 opt in locally)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
