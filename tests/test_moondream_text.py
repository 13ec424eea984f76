"""moondream2's text decoder against transformers' Phi with the same
weights, causal and with the bidirectional image prefix."""

from __future__ import annotations

import pytest
import torch

from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.text import additive_mask, prefix_mask, to_phi
from bubblefree.cuda_backend.moondream.weights import random_model


def _written_out_mask(length: int, prefix: int) -> torch.Tensor:
    # The rule, one pair at a time: j is visible from i when it is not in
    # i's future, or when both lie in the prefix.
    return torch.tensor([[j <= i or (i < prefix and j < prefix) for j in range(length)]
                         for i in range(length)])


@pytest.fixture(scope="module")
def decoder():
    return random_model(tiny_config(), seed=7).text


def test_causal_logits_match_phi(decoder):
    phi = to_phi(decoder)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = decoder.logits(decoder(decoder.embed(ids), prefix=0))
        theirs = phi(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length,prefix", [(12, 5), (735, 730)])
def test_prefix_logits_match_phi_under_the_written_out_mask(decoder, length, prefix):
    phi = to_phi(decoder)
    embeds = torch.randn(1, length, 64, generator=torch.Generator().manual_seed(2))
    mask = _written_out_mask(length, prefix)
    assert torch.equal(prefix_mask(torch.arange(length), length, prefix), mask)
    with torch.no_grad():
        ours = decoder.logits(decoder(embeds, prefix=prefix))
        theirs = phi(inputs_embeds=embeds, attention_mask=additive_mask(mask, torch.float32),
                     position_ids=torch.arange(length)[None]).logits
        causal = decoder.logits(decoder(embeds, prefix=0))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # The prefix changes what its first position sees, so a mask dropped on
    # either side fails the comparison above.
    assert not torch.allclose(ours[0, 0], causal[0, 0], atol=1e-3)


def test_the_default_prefix_is_bos_plus_one_crop(decoder):
    assert decoder.config.prefix_attn == 730
    embeds = torch.randn(1, 732, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(decoder(embeds), decoder(embeds, prefix=730))


def test_a_chunk_of_queries_gets_the_rows_of_the_whole_mask():
    whole = _written_out_mask(20, 8)
    for start, stop in [(0, 3), (5, 12), (8, 20), (19, 20)]:
        chunk = prefix_mask(torch.arange(start, stop), 20, 8)
        assert torch.equal(chunk, whole[start:stop])


def test_additive_mask_blocks_what_the_bool_mask_forbids():
    mask = _written_out_mask(4, 2)
    additive = additive_mask(mask, torch.float32)
    assert additive.shape == (1, 1, 4, 4)
    assert torch.equal(additive[0, 0] == 0, mask)
