"""ntk_fl: neural-tangent-kernel federated learning in JAX.

Subpackages and modules (each documented in its own docstring):

* :mod:`ntk_fl.data` -- dataset readers, partitions, the stacked ``Federation``.
* :mod:`ntk_fl.models` -- flax models as pure ``(init, apply)`` pairs.
* :mod:`ntk_fl.topology` -- communication graphs and mixing weights.
* :mod:`ntk_fl.ntk` -- empirical neural tangent kernels.
* :mod:`ntk_fl.evolve` -- function-space evolution and NTK weight updates.
* :mod:`ntk_fl.parallel` -- the single "for each client" primitive.
* :mod:`ntk_fl.algorithms` -- NTK-DFL and friends as ``Algorithm(init, step, ...)``.
* :mod:`ntk_fl.schema` -- the config schema, checked once before any work.
* :mod:`ntk_fl.rundir` -- the files of a run directory; resume and branch.
* :mod:`ntk_fl.runner` -- the generic experiment loop (logging, checkpoints, plots).
* :mod:`ntk_fl.summaries` -- TensorBoard event files of a run (tensorboardX).
* :mod:`ntk_fl.cli` -- the ``ntk-fl`` command; :mod:`ntk_fl.configs` -- the packaged paper configs.
"""
__version__ = "0.1.0"
