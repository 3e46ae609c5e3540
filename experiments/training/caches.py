"""What a model's decoding caches hold (model.Decoder.decode): per layer a LinearState (S, z and
the stabiliser's scale), a KeyValueCache (softmax's keys and values, a row per token) or, with a
short convolution, a ShortConvCache holding one of those and the last k - 1 projected q, k and v.
The state size the report sets recall against is what these hold for one sequence."""
import torch

import linrope


def tensors(cache):
    """Every tensor in a cache or a list of caches (nested tuples of tensors)."""
    if isinstance(cache, torch.Tensor):
        return [cache]
    return [t for part in cache for t in tensors(part)]


def cache_bytes(caches):
    """Bytes held by the layers' caches."""
    return sum(t.numel() * t.element_size() for t in tensors(caches))


@torch.no_grad()
def state_floats(model, length):
    """Values the decoding caches of every layer hold for one sequence after `length` tokens: for
    linear attention the same at every length, for softmax 2 x length x d_model per layer. The
    model is left in the mode it was in; evaluation mode meanwhile, so that nothing counts this
    forward (FAVOR+'s redraws count training forwards). None for a model whose weights are no
    longer finite (a diverged run's), which the kernels refuse to run."""
    training = model.training
    model.eval()
    try:
        with model.alone():
            _, caches = model.decode(torch.zeros(1, length, dtype=torch.long))
    except linrope.NonFiniteError:
        return None
    finally:
        model.train(training)
    return sum(t.numel() for t in tensors(caches))
