"""The region module against its formulas written out."""

from __future__ import annotations

import math

import pytest
import torch

from bubblefree.cuda_backend.moondream.config import tiny_config
from bubblefree.cuda_backend.moondream.region import coordinate_value, size_value
from bubblefree.cuda_backend.moondream.weights import random_model


@pytest.fixture(scope="module")
def region():
    return random_model(tiny_config(), seed=11).region


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _linear(layer, x):
    return x @ layer.weight.T + layer.bias


def test_encode_coordinate_is_a_linear_map_of_fourier_features(region):
    coords = torch.tensor([[0.0], [0.25], [0.731], [1.0]])                 # [4, 1]
    freqs = region.coord_features[0]                                       # [8]
    angles = 2 * math.pi * coords * freqs                                  # [4, 8]
    features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)   # [4, 16]
    with torch.no_grad():
        torch.testing.assert_close(region.encode_coordinate(coords),
                                   _linear(region.coord_encoder, features))


def test_encode_size_mixes_width_and_height_through_the_frequency_matrix(region):
    sizes = torch.tensor([[0.1, 0.5], [1.0, 0.01]])                         # [2, 2] (w, h)
    f = region.size_features                                                # [2, 16]
    angles = 2 * math.pi * (sizes[:, :1] * f[0] + sizes[:, 1:] * f[1])      # [2, 16]
    features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(region.encode_size(sizes), _linear(region.size_encoder, features))


def test_decoders_are_gelu_tanh_mlps_to_bins(region):
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        coord = region.decode_coordinate(hidden)
        size = region.decode_size(hidden)
        d = region.coord_decoder
        expected_coord = _linear(d.fc2, _gelu_tanh(_linear(d.fc1, hidden)))
        s = region.size_decoder
        flat = _linear(s.fc2, _gelu_tanh(_linear(s.fc1, hidden)))           # [3, 2048]
    assert coord.shape == (3, 1024) and size.shape == (3, 2, 1024)
    torch.testing.assert_close(coord, expected_coord, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(size[:, 0], flat[:, :1024], atol=1e-5, rtol=1e-5)   # width
    torch.testing.assert_close(size[:, 1], flat[:, 1024:], atol=1e-5, rtol=1e-5)   # height


def test_bins_map_to_values():
    bins = torch.tensor([0, 512, 1023])
    torch.testing.assert_close(coordinate_value(bins, 1024), torch.tensor([0.0, 0.5, 1023 / 1024]))
    torch.testing.assert_close(size_value(bins, 1024),
                               torch.tensor([2.0 ** -10, 2.0 ** (512 / 1023 * 10 - 10), 1.0]))
