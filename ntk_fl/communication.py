"""Protocol-specific communication accounting: the bits an NTK round sends.

Neighbourhood-NTK methods (NTK-DFL, SPARK) send, per round and client ``i``
with ``κ_i`` neighbours (:func:`neighbourhood_round_bits`): ``κ_i·d·32``
weights out for the consensus, ``κ_i·d·32`` consensus weights back (each
neighbour evaluates its Jacobian at them) and one package per neighbour
(:func:`jacobian_package_bits`: the Jacobian of the client's ``n_i`` samples,
``n_i·C`` float32 function values and ``n_i·⌈log2 C⌉`` label bits). The bit
count of any one payload, dense or sparse and quantised, comes from the
primitives of :mod:`ntk_fl.compression`.

Server-side NTK methods (NTK-FL, CP-NTK-FL) upload, per sampled client
(:func:`server_upload_bits`): the Jacobian rows of its ``n_i`` samples, dense or
sparsified and quantised (:func:`jacobian_payload_bits`), plus ``n_i·C`` float32
logits and ``n_i·⌈log2 C⌉`` label bits.

FedCOM and QSGD upload, per sampled client (:func:`qsgd_upload_bits`), one
QSGD-quantised vector the size of the model (the local update or the
gradient): ``b`` bits per coordinate (sign and level) plus one float32 norm per
bucket of every parameter tensor; float32 values when unquantised. Like NTK-FL
Table 1 for every method, only the uplink is counted.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ntk_fl import validation
from ntk_fl.compression import (
  FLOAT_BITS,
  num_kept,
  payload_bits,
  qsgd_levels,
  sparse_payload_bits,
)

__all__ = [
  "jacobian_package_bits",
  "neighbourhood_round_bits",
  "jacobian_payload_bits",
  "server_upload_bits",
  "qsgd_upload_bits",
]


def jacobian_package_bits(
  num_samples: int,
  num_classes: int,
  tensor_sizes,
  *,
  keep_fraction: float = 1.0,
  bits: int = FLOAT_BITS,
) -> int:
  """Bits of one neighbourhood-NTK package: a Jacobian, function values and labels of ``num_samples`` samples.

  Args:
    num_samples: ``n_i``, the samples the package covers (0 sends nothing).
    num_classes: ``C``.
    tensor_sizes: entries per sample and class of each separately sent Jacobian
      tensor (a parameter leaf's size, or its sketched size); the tensor holds
      ``n_i·C·size`` values.
    keep_fraction: top-k sparsification per tensor, support included
      (:func:`sparse_payload_bits`); 1 = dense.
    bits: bits per Jacobian value (32 = float32, else quantised, :func:`payload_bits`).

  Returns:
    A Python int: the Jacobian tensors + ``n_i·C·32`` function values + ``n_i·⌈log2 C⌉`` label bits.
  """
  if num_samples <= 0:
    return 0
  total = 0
  for tensor_size in tensor_sizes:
    size = num_samples * num_classes * int(tensor_size)
    if keep_fraction < 1:
      total += int(sparse_payload_bits(num_kept(size, keep_fraction), size, bits))
    else:
      total += int(payload_bits(size, bits))
  label_bits = max(1, math.ceil(math.log2(num_classes)))
  return total + num_samples * num_classes * FLOAT_BITS + num_samples * label_bits


def neighbourhood_round_bits(
  num_neighbors,
  package,
  num_params: int,
  *,
  broadcast: bool = False,
  averaging: bool = True,
  velocity: bool = False,
):
  """Bits client(s) send in one neighbourhood-NTK round: weights and one Jacobian package per neighbour.

  Args:
    num_neighbors: ``κ_i`` (int or ``[M]`` array).
    package: bits of the client's package (int or ``[M]``), :func:`jacobian_package_bits`.
    num_params: ``d``.
    broadcast: clustered topology -- every member of a clique shares the consensus,
      so the package is broadcast once and no consensus goes back (SPARK App. A.2).
    averaging: per-round neighbour averaging. Without it a client sends only its
      own weights (``κ_i·d·32``; neighbours evaluate their Jacobians at them) and a
      package per neighbour; ``broadcast`` does not apply (the weights differ per client).
    velocity: the momentum velocity travels with the weights (``κ_i·d·32`` more).

  Returns:
    ``[M]`` (or scalar) bits, the type of ``num_neighbors``.
  """
  weights = num_params * FLOAT_BITS
  out_weights = (2 if velocity else 1) * weights
  if not averaging:
    return num_neighbors * (out_weights + package)
  if broadcast:
    return num_neighbors * out_weights + jnp.where(num_neighbors > 0, package, 0)
  return num_neighbors * (out_weights + weights + package)


def jacobian_payload_bits(
  num_rows,
  row_size: int,
  *,
  keep_fraction: float = 1.0,
  bits: int = FLOAT_BITS,
  num_tensors: int = 1,
):
  """Uplink bits of ``num_rows`` Jacobian rows of ``row_size`` entries each.

  ``keep_fraction = 1``: dense (``row_size`` values per row). Otherwise every
  row sends ``k = ceil(keep_fraction·row_size)`` values plus its support, a
  bitmap or an index list, whichever is smaller
  (:func:`ntk_fl.compression.sparse_payload_bits`). Values cost ``bits`` each;
  ``bits < 32`` adds the quantiser's 64 side bits per tensor (``num_tensors``:
  one per client payload here). ``num_rows`` may be an int or an array.
  """
  validation.check_int("row_size", row_size, low=1)
  if keep_fraction == 1:
    return payload_bits(num_rows * row_size, bits, num_tensors=num_tensors)
  k = num_kept(row_size, keep_fraction)
  support = sparse_payload_bits(k, row_size) - payload_bits(k)
  return payload_bits(num_rows * k, bits, num_tensors=num_tensors) + num_rows * support


def server_upload_bits(
  num_samples,
  num_params: int,
  num_classes: int,
  *,
  keep_fraction: float = 1.0,
  bits: int = FLOAT_BITS,
):
  """Uplink bits of one client of a server-side NTK round: its samples' Jacobians, logits and labels.

  Args:
    num_samples: ``n_i`` (an int or an array of them).
    num_params: the (projected) model's ``d``: entries per Jacobian row.
    num_classes: ``C``; the client sends ``n_i·C`` Jacobian rows.
    keep_fraction, bits: the rows' top-k fraction and bits per value
      (:func:`jacobian_payload_bits`, one quantised tensor per client).
  """
  jac = jacobian_payload_bits(
    num_samples * num_classes, num_params, keep_fraction=keep_fraction, bits=bits, num_tensors=1
  )
  logits = num_samples * num_classes * FLOAT_BITS
  labels = num_samples * max(1, math.ceil(math.log2(num_classes)))
  return jac + logits + labels


def qsgd_upload_bits(tensor_sizes, bits: int, bucket_size: int = 0) -> int:
  """Uplink bits of one client's QSGD-quantised model-sized vector (FedCOM's update, QSGD's gradient).

  Args:
    tensor_sizes: the entry count of every parameter tensor (each quantised on its own).
    bits: code width per coordinate, sign included (:func:`ntk_fl.compression.qsgd_levels`);
      :data:`~ntk_fl.compression.FLOAT_BITS` = float32 values, nothing else.
    bucket_size: entries per bucket within a tensor (0 = the whole tensor); every bucket adds its
      float32 norm.

  Returns:
    A Python int: ``sum_t size_t * bits + 32 * ceil(size_t / bucket)`` (``32 * sum_t size_t`` at 32 bits).
  """
  validation.check_int("bucket_size", bucket_size, low=0)
  sizes = [int(size) for size in tensor_sizes]
  if bits == FLOAT_BITS:
    return FLOAT_BITS * sum(sizes)
  qsgd_levels(bits)  # checks bits
  total = 0
  for size in sizes:
    bucket = size if bucket_size == 0 or bucket_size >= size else bucket_size
    total += size * bits + FLOAT_BITS * -(-size // bucket)
  return total
