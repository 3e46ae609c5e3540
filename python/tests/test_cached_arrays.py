"""The large arrays the functions return (outputs, gradients, products) come from the library's
block cache (python/src/arrays.hpp, src/common/block_cache.hpp): a dead array's memory is the next
one's, so a training loop does not fault in fresh pages every step; a live array's memory is its
own, also through torch.from_numpy, until the last reference dies."""
import gc

import numpy as np
import torch

import linrope


def address(a):
    return a.__array_interface__["data"][0]


def test_a_dead_output_is_reused_and_live_ones_are_not_shared():
    x = np.random.default_rng(0).standard_normal((1, 4, 512, 64)).astype(np.float32)  # 512 KiB
    first = linrope.gelu(x)
    where = address(first)
    second = linrope.gelu(x)
    assert address(second) != where  # both alive: two blocks
    np.testing.assert_array_equal(first, second)
    del first
    gc.collect()
    third = linrope.gelu(2 * x)
    assert address(third) == where  # the dead one's block, from the cache
    np.testing.assert_array_equal(third, linrope.gelu(2 * x))
    np.testing.assert_array_equal(second, linrope.gelu(x))  # untouched


def test_an_array_held_by_torch_keeps_its_memory():
    x = np.random.default_rng(1).standard_normal((1024, 128)).astype(np.float32)
    kept = torch.from_numpy(linrope.gelu(x))  # the NumPy array dies; the tensor holds it
    want = kept.clone()
    for _ in range(3):
        linrope.gelu(-x)  # each result dies at once: its block goes back and is taken again
    assert torch.equal(kept, want)


def test_small_arrays_are_plain_numpy_arrays():
    out = linrope.gelu(np.ones((4, 8), dtype=np.float32))
    assert out.base is None and out.flags.owndata
    large = linrope.gelu(np.ones((1024, 128), dtype=np.float32))
    assert large.base is not None and not large.flags.owndata


def test_release_cached_memory_frees_the_dead_arrays_blocks():
    x = np.ones((2048, 256), dtype=np.float32)  # 2 MiB
    out = linrope.gelu(x)
    del out
    gc.collect()
    assert linrope.release_cached_memory() >= x.nbytes
    assert linrope.release_cached_memory() == 0
