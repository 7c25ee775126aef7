"""ntk_fl's implementation layer: private modules that the public modules of ``ntk_fl`` re-export.

Nothing here is public API; import from ``ntk_fl`` or its public modules instead.
"""
