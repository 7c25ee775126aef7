"""The paper configs, one ``get_config(arg)`` file per method (ml_collections), shipped inside the package.

``configs/`` at the repository root points here, so ``--config=configs/ntk_dfl.py:smoke`` works in a checkout.
"""
