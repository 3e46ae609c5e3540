"""Decoder.decode: token by token through the layers' caches (the linear state, softmax's keys and
values) gives the logits of the parallel forward, for every variant."""
import pytest
import torch

from training.model import Decoder
from training.variants import CATALOGUE


@pytest.mark.parametrize("variant", CATALOGUE, ids=lambda v: v.name)
def test_decoding_token_by_token_equals_the_parallel_forward(variant):
    model = Decoder(40, variant, d_model=16, layers=2, heads=2, seed=1).double().eval()
    tokens = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(tokens)
        logits, caches = model.decode(tokens[:, :4])  # a prompt at once, then one at a time
        steps = [logits]
        for t in range(4, 11):
            logits, caches = model.decode(tokens[:, t:t + 1], first_position=t, caches=caches)
            steps.append(logits)
    # float64: the same sums in another order, ~1e-15 relative; 1e-10 leaves room for the
    # stabiliser's rescalings and is far below any wrong position or missing token (~1e-2).
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-10, atol=1e-10)
