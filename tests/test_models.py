"""Tests for ntk_fl.models: parameter counts, initialisation statistics, forward passes, clients."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntk_fl import config as config_lib
from ntk_fl import models as M


def _np_params(params):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), params)["params"]


_NP_ACT = {
  "relu": lambda z: np.maximum(z, 0.0),
  "tanh": np.tanh,
  "sigmoid": lambda z: 1.0 / (1.0 + np.exp(-z)),
  "softplus": lambda z: np.log1p(np.exp(z)),
  "identity": lambda z: z,
}


# --------------------------------------------------------------------- MLP


def test_paper_mlp_has_79510_parameters():
  model = M.mlp()
  params = jax.eval_shape(model.init, jax.random.key(0))  # shapes only: nothing is computed
  assert M.num_params(params) == 784 * 100 + 100 + 100 * 10 + 10 == 79_510
  assert model.input_shape == (784,) and model.num_classes == 10
  assert jax.tree.map(lambda a: a.shape, params) == {
    "params": {
      "dense_0": {"kernel": (784, 100), "bias": (100,)},
      "dense_1": {"kernel": (100, 10), "bias": (10,)},
    }
  }
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def _check_kaiming(w: np.ndarray, fan_in: int, sigmas: float = 5.0):
  """Sample mean/std of N(0, 2/fan_in) draws within `sigmas` standard errors."""
  n, std = w.size, math.sqrt(2.0 / fan_in)
  assert abs(w.mean()) < sigmas * std / math.sqrt(n)
  # The sample std of n normal draws has relative standard error ~ 1 / sqrt(2n).
  assert abs(w.std() / std - 1.0) < sigmas / math.sqrt(2 * n)


def test_mlp_init_is_untruncated_kaiming_normal_with_zero_biases():
  p = _np_params(M.mlp().init(jax.random.key(1)))
  w1 = p["dense_0"]["kernel"]
  _check_kaiming(w1, 784)
  _check_kaiming(p["dense_1"]["kernel"], 100)
  assert np.all(p["dense_0"]["bias"] == 0) and np.all(p["dense_1"]["bias"] == 0)
  # Not truncated: P(|w| > 2 std) = 4.55% for a normal (0 for a 2-std truncation);
  # with 78,400 draws the binomial standard error of that fraction is 0.075%.
  std = math.sqrt(2.0 / 784)
  tail = np.mean(np.abs(w1) > 2 * std)
  assert abs(tail - 0.0455) < 5 * math.sqrt(0.0455 * 0.9545 / w1.size)
  assert np.sum(np.abs(w1) > 3 * std) > 100  # expected ~212


def test_mlp_apply_shapes_and_batch_axes():
  model = M.mlp(input_dim=12, hidden=(7,), num_classes=4)
  params = model.init(jax.random.key(0))
  assert model.apply(params, jnp.ones((5, 12))).shape == (5, 4)
  assert model.apply(params, jnp.ones((12,))).shape == (4,)
  out = model.apply(params, jnp.arange(72.0).reshape(2, 3, 12))
  np.testing.assert_allclose(out[1, 2], model.apply(params, jnp.arange(60.0, 72.0)), rtol=1e-6)
  with pytest.raises(ValueError, match=r"inputs must have shape \[\.\.\., 12\], got \(5, 11\)"):
    model.apply(params, jnp.ones((5, 11)))


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid", "softplus", "identity"])
def test_mlp_matches_handwritten_numpy_forward(activation):
  model = M.mlp(input_dim=9, hidden=(16, 8), num_classes=3, activation=activation)
  params = model.init(jax.random.key(2))
  # Non-zero biases so they are exercised too.
  params = jax.tree.map(lambda a: a + 0.1 * jnp.ones_like(a) if a.ndim == 1 else a, params)
  x = np.random.default_rng(0).normal(size=(6, 9))
  p, act = _np_params(params), _NP_ACT[activation]
  h = act(x @ p["dense_0"]["kernel"] + p["dense_0"]["bias"])
  h = act(h @ p["dense_1"]["kernel"] + p["dense_1"]["bias"])
  expected = h @ p["dense_2"]["kernel"] + p["dense_2"]["bias"]
  got = model.apply(params, jnp.asarray(x, jnp.float32))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_dense_stack_lists_every_layer_in_forward_order():
  model = M.mlp(input_dim=5, hidden=(6, 4, 3), num_classes=2, activation="tanh")
  params = model.init(jax.random.key(0))
  stack = model.dense_stack
  assert stack.layers == ("dense_0", "dense_1", "dense_2", "dense_3")
  assert set(stack.layers) == set(params["params"])
  widths = [5, 6, 4, 3, 2]
  for name, fan_in, fan_out in zip(stack.layers, widths[:-1], widths[1:]):
    assert params["params"][name]["kernel"].shape == (fan_in, fan_out)
    assert params["params"][name]["bias"].shape == (fan_out,)
  # The DenseStack semantics (activation between layers, not after the last) reproduce apply.
  x = jax.random.normal(jax.random.key(1), (3, 5))
  h = x
  for i, name in enumerate(stack.layers):
    h = h @ params["params"][name]["kernel"] + params["params"][name]["bias"]
    if i < len(stack.layers) - 1:
      h = stack.activation(h)
  np.testing.assert_allclose(h, model.apply(params, x), rtol=1e-6, atol=1e-6)
  z = jnp.linspace(-2.0, 2.0, 7)
  np.testing.assert_allclose(stack.activation(z), jnp.tanh(z), rtol=1e-6)


def test_linear_model_without_hidden_layers():
  model = M.mlp(input_dim=4, hidden=(), num_classes=3)
  params = model.init(jax.random.key(0))
  assert model.dense_stack.layers == ("dense_0",)
  assert M.num_params(params) == 4 * 3 + 3


def test_gelu_is_exact_erf_gelu():
  model = M.mlp(input_dim=1, hidden=(1,), num_classes=1, activation="gelu")
  z = np.linspace(-3, 3, 13)
  exact = 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
  np.testing.assert_allclose(model.dense_stack.activation(jnp.asarray(z)), exact, atol=1e-6)


# --------------------------------------------------------------------- CNN


def _cnn_param_count(h, w, c, classes, k):
  conv1 = k * k * c * 32 + 32
  conv2 = k * k * 32 * 64 + 64
  fc1 = 64 * (h // 4) * (w // 4) * 100 + 100
  return conv1 + conv2 + fc1 + 100 * classes + classes


@pytest.mark.parametrize(
  "shape,classes,k", [((32, 32, 3), 10, 3), ((28, 28, 1), 10, 3), ((10, 13, 2), 5, 5)]
)
def test_cnn_shapes_and_parameter_count(shape, classes, k):
  model = M.cnn(shape, classes, kernel_size=k)
  params = jax.eval_shape(model.init, jax.random.key(0))
  assert model.dense_stack is None and model.input_shape == shape
  assert M.num_params(params) == _cnn_param_count(*shape, classes, k)
  assert params["params"]["conv_0"]["kernel"].shape == (k, k, shape[2], 32)
  assert params["params"]["dense_0"]["kernel"].shape == (
    64 * (shape[0] // 4) * (shape[1] // 4),
    100,
  )
  batch = jax.ShapeDtypeStruct((3, *shape), jnp.float32)
  assert jax.eval_shape(model.apply, params, batch).shape == (3, classes)
  one = jax.ShapeDtypeStruct(shape, jnp.float32)
  assert jax.eval_shape(model.apply, params, one).shape == (classes,)


def test_default_cnn_has_430102_parameters():
  # 3*3*3*32+32 + 3*3*32*64+64 + 8*8*64*100+100 + 100*10+10
  params = jax.eval_shape(M.cnn().init, jax.random.key(0))
  assert M.num_params(params) == 896 + 18_496 + 409_700 + 1_010


def test_cnn_matches_an_independent_lax_forward():
  shape = (8, 8, 2)
  model = M.cnn(shape, 4)
  params = model.init(jax.random.key(3))
  params = jax.tree.map(lambda a: a + 0.05 if a.ndim == 1 else a, params)
  p = params["params"]
  x = jax.random.normal(jax.random.key(4), (2, *shape))

  def conv_relu_pool(h, layer):
    h = (
      jax.lax.conv_general_dilated(
        h, layer["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      + layer["bias"]
    )
    h = jnp.maximum(h, 0.0)
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

  h = conv_relu_pool(conv_relu_pool(x, p["conv_0"]), p["conv_1"]).reshape(2, -1)
  h = jnp.maximum(h @ p["dense_0"]["kernel"] + p["dense_0"]["bias"], 0.0)
  expected = h @ p["dense_1"]["kernel"] + p["dense_1"]["bias"]
  np.testing.assert_allclose(model.apply(params, x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 8, 6, 4), (2, 7, 5, 3)])
def test_cnn_max_pool_derivatives_are_nn_max_pools_bit_for_bit(shape):
  # Ties on purpose: ReLU zeros and values rounded to halves, so many windows have several maxima.
  k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
  x = jnp.maximum(jnp.round(2 * jax.random.normal(k1, shape)) / 2, 0.0)
  ref = lambda h: nn.max_pool(h, (2, 2), strides=(2, 2))
  out = (shape[0], shape[1] // 2, shape[2] // 2, shape[3])
  g = jax.random.normal(k2, (5, *out))  # five cotangents, vmapped as the kernel's are
  t = jax.random.normal(k3, shape)
  assert np.array_equal(M._max_pool_2x2(x), ref(x))
  pullback = lambda f: jax.vmap(jax.vjp(f, x)[1])(g)[0]
  got, want = np.asarray(pullback(M._max_pool_2x2)), np.asarray(pullback(ref))
  assert np.array_equal(got, want) and np.array_equal(np.signbit(got), np.signbit(want))
  np.testing.assert_array_equal(
    jax.jvp(M._max_pool_2x2, (x,), (t,))[1], jax.jvp(ref, (x,), (t,))[1]
  )
  # Brute force: each window's cotangent goes to its first maximum in row-major order.
  xn, gn = np.asarray(x), np.asarray(g[0])
  brute = np.zeros(shape, np.float32)
  for b, i, j, c in np.ndindex(*out):
    window = xn[b, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2, c].reshape(-1)
    di, dj = divmod(int(np.argmax(window)), 2)
    brute[b, 2 * i + di, 2 * j + dj, c] = gn[b, i, j, c]
  np.testing.assert_array_equal(got[0], brute)


def test_cnn_init_uses_receptive_field_fan_in():
  p = _np_params(M.cnn((8, 8, 3)).init(jax.random.key(5)))
  _check_kaiming(p["conv_1"]["kernel"], 3 * 3 * 32)  # 18,432 draws
  _check_kaiming(p["dense_0"]["kernel"], 2 * 2 * 64)
  assert all(np.all(p[name]["bias"] == 0) for name in p)


# ------------------------------------------------------------------ clients


def test_init_clients_shared_gives_every_client_the_same_init():
  model = M.mlp(input_dim=6, hidden=(5,), num_classes=3)
  key = jax.random.key(7)
  stacked = M.init_clients(model, key, 4, shared=True)
  single = model.init(key)
  for s, one in zip(jax.tree.leaves(stacked), jax.tree.leaves(single)):
    assert s.shape == (4, *one.shape)
    for i in range(4):
      np.testing.assert_array_equal(s[i], one)
  assert M.num_params(stacked) == 4 * M.num_params(single)


def test_init_clients_per_client_draws_independent_inits():
  model = M.mlp(input_dim=6, hidden=(5,), num_classes=3)
  key = jax.random.key(7)
  stacked = M.init_clients(model, key, 4, shared=False)
  kernel = stacked["params"]["dense_0"]["kernel"]
  assert kernel.shape == (4, 6, 5)
  for i in range(4):
    for j in range(i + 1, 4):
      assert not np.allclose(kernel[i], kernel[j])
  keys = jax.random.split(key, 4)
  np.testing.assert_array_equal(kernel[2], model.init(keys[2])["params"]["dense_0"]["kernel"])
  np.testing.assert_array_equal(stacked["params"]["dense_0"]["bias"], 0.0)


# ------------------------------------------------------------------- config


def test_make_model_from_base_config():
  cfg = config_lib.base_config().model
  model = M.make_model(cfg, (28, 28, 1), 10)
  assert model.input_shape == (784,)
  assert M.num_params(jax.eval_shape(model.init, jax.random.key(0))) == 79_510
  cfg.hidden = (20, 10)
  cfg.activation = "tanh"
  deep = M.make_model(cfg, (784,), 10)
  assert deep.dense_stack.layers == ("dense_0", "dense_1", "dense_2")
  cfg.name = "cnn"
  conv = M.make_model(cfg, (32, 32, 3), 10)
  assert conv.dense_stack is None and conv.input_shape == (32, 32, 3)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("name", "resnet", r"unknown model 'resnet'; choose one of \('mlp', 'cnn'\)"),
    ("activation", "swishy", r"unknown activation 'swishy'; choose one of \('relu'"),
    ("hidden", (100, 0), "hidden width must be an int >= 1, got 0"),
    ("init", "random", r"unknown model.init 'random'"),
  ],
)
def test_make_model_rejects_bad_config(field, value, match):
  cfg = config_lib.base_config().model
  setattr(cfg, field, value)
  with pytest.raises(ValueError, match=match):
    M.make_model(cfg, (784,), 10)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match=r"cnn needs input_shape \(H, W, channels\).*flatten=False"):
    M.cnn((3072,))
  with pytest.raises(ValueError, match="H and W must be >= 4"):
    M.cnn((2, 8, 1))
  with pytest.raises(ValueError, match="num_classes must be an int >= 1"):
    M.mlp(num_classes=0)
  with pytest.raises(ValueError, match="num_clients must be an int >= 1"):
    M.init_clients(M.mlp(), jax.random.key(0), 0)
