"""Timing of neural-tangents 0.6.5's empirical NTK (runs in the oracle environment, not the library's).

The counterpart of ``benchmarks/ntk_any_model.py``: the same networks (the library's CNN on 28x28x1
inputs and the 784-100-10 MLP, rebuilt as plain JAX functions exactly as ``compute_references.py``
does), the same seeds' shapes, float32, ``vmap_axes=0``. For every implementation it prints one JSON
line: the median wall time of ``--reps`` runs after compilation, XLA's planned peak memory
(arguments + outputs + temporaries, ``Compiled.memory_analysis()``) and XLA's FLOP count
(``Compiled.cost_analysis()``).

Usage (oracle venv): ``python scripts/nt_oracle/time_kernels.py --net cnn --n 50 --impls 1 2 3``.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import neural_tangents as nt

_KAIMING = jax.nn.initializers.variance_scaling(2.0, "fan_in", "normal")


def dense(p, x):
  return x @ p["kernel"] + p["bias"]


def conv_same(p, x):  # NHWC inputs, HWIO kernels, stride 1, 'SAME' padding (flax nn.Conv)
  y = jax.lax.conv_general_dilated(
    x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + p["bias"]


def max_pool_2x2(x):  # flax nn.max_pool(x, (2, 2), strides=(2, 2)), 'VALID'
  return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def mlp(params, x):  # 784-100-10, ReLU
  p = params["params"]
  return dense(p["dense_1"], jax.nn.relu(dense(p["dense_0"], x)))


def cnn(params, x):  # conv32-relu-pool-conv64-relu-pool-fc100-relu-fc10
  p = params["params"]
  x = max_pool_2x2(jax.nn.relu(conv_same(p["conv_0"], x)))
  x = max_pool_2x2(jax.nn.relu(conv_same(p["conv_1"], x)))
  x = jax.nn.relu(dense(p["dense_0"], x.reshape(x.shape[0], -1)))
  return dense(p["dense_1"], x)


SHAPES = {  # layer -> kernel shape (biases are [out])
  "mlp": {"dense_0": (784, 100), "dense_1": (100, 10)},
  "cnn": {
    "conv_0": (3, 3, 1, 32),
    "conv_1": (3, 3, 32, 64),
    "dense_0": (3136, 100),
    "dense_1": (100, 10),
  },
}
INPUTS = {"mlp": (784,), "cnn": (28, 28, 1)}
NETWORKS = {"mlp": mlp, "cnn": cnn}


def init(net, key):
  tree = {}
  for i, (layer, shape) in enumerate(SHAPES[net].items()):
    tree[layer] = {
      "kernel": _KAIMING(jax.random.fold_in(key, i), shape, jnp.float32),
      "bias": jnp.zeros(shape[-1:], jnp.float32),
    }
  return {"params": tree}


def measure(net, n, implementation, full, reps, warmup=1):
  params = init(net, jax.random.PRNGKey(0))
  x = jax.random.uniform(jax.random.PRNGKey(1), (n, *INPUTS[net]))
  ntk_fn = nt.empirical_ntk_fn(
    NETWORKS[net], trace_axes=() if full else (-1,), vmap_axes=0, implementation=implementation
  )
  compiled = jax.jit(lambda x, p: ntk_fn(x, None, p)).lower(x, params).compile()
  mem = compiled.memory_analysis()
  peak = (
    None
    if mem is None
    else (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes)
  )
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  for _ in range(warmup):
    jax.block_until_ready(compiled(x, params))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(compiled(x, params))
    times.append(time.perf_counter() - start)
  return {
    "library": "neural-tangents " + nt.__version__,
    "jax": jax.__version__,
    "net": net,
    "n": n,
    "kernel": "full" if full else "traced",
    "implementation": int(implementation),
    "seconds": statistics.median(times),
    "times": times,
    "peak_bytes": peak,
    "xla_flops": None if cost is None else cost.get("flops"),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--net", choices=tuple(NETWORKS), default="cnn")
  parser.add_argument("--n", type=int, default=50)
  parser.add_argument("--impls", type=int, nargs="+", default=[1, 2, 3])
  parser.add_argument("--full", action="store_true")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=1, help="untimed runs after compilation")
  args = parser.parse_args()
  for impl in args.impls:
    print(
      json.dumps(measure(args.net, args.n, impl, args.full, args.reps, args.warmup)), flush=True
    )


if __name__ == "__main__":
  main()
