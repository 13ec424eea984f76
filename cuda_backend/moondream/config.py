"""moondream2's shapes as one frozen value, and a tiny variant for tests.

Every module in this package takes its sizes from a ``MoondreamConfig``;
nothing reads a checkpoint to learn a shape, so the random-weight models of
tests and benchmarks are built from the same code as the real one.

The prompt templates are token ids in moondream2's tokenizer (GPT-2's BPE,
whose ``<|endoftext|>`` 50256 is both BOS and EOS): "\\n\\nQuestion:" and
"\\n\\nAnswer:" around a query, "\\n\\nShort caption:" and friends for a
caption, "\\n\\nDetect:" or "\\n\\nPoint:" and "\\n\\n" around the object
name (" " + the name, as the reference tokenizes it) for detect and point.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class VisionConfig:
    dim: int = 1152            # encoder width
    n_layers: int = 27
    n_heads: int = 16
    ff_dim: int = 4304
    patch_size: int = 14
    crop_size: int = 378       # pixels per side of every crop, global or local
    in_channels: int = 3
    max_crops: int = 12        # local crops; the global view is one more
    overlap_margin: int = 4    # patches shared by neighbouring local crops
    proj_inner_dim: int = 8192
    proj_out_dim: int = 2048   # the text width
    ln_eps: float = 1e-5

    @property
    def grid(self) -> int:
        """Patches per side of one crop: 27."""
        return self.crop_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid * self.grid

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@attrs.frozen
class TextConfig:
    """Phi-1.5's shape: parallel attention + MLP from one LayerNorm, partial
    rotary (half of each head), biases everywhere, GELU-tanh MLP."""

    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    n_heads: int = 32
    vocab_size: int = 51200
    max_context: int = 2048
    rotary_fraction: float = 0.5
    rope_theta: float = 10000.0
    ln_eps: float = 1e-5
    # BOS and the 729 image positions attend to each other both ways.
    prefix_attn: int = 730

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@attrs.frozen
class RegionConfig:
    dim: int = 2048              # the text width the region module reads and writes
    coord_feat_dim: int = 256    # Fourier features of one coordinate (cos + sin halves)
    coord_out_dim: int = 1024    # bins over [0, 1]
    size_feat_dim: int = 512     # Fourier features of (width, height)
    size_out_dim: int = 2048     # 1024 bins for width, then 1024 for height
    inner_dim: int = 8192


def _templates() -> dict:
    return {
        "caption": {"short": (198, 198, 16438, 8305, 25),
                    "normal": (198, 198, 24334, 1159, 25),
                    "long": (198, 198, 14617, 8305, 25)},
        "query": {"prefix": (198, 198, 24361, 25), "suffix": (198, 198, 33706, 25)},
        "detect": {"prefix": (198, 198, 47504, 25), "suffix": (628,)},
        "point": {"prefix": (198, 198, 12727, 25), "suffix": (628,)},
    }


@attrs.frozen
class TokenizerConfig:
    bos_id: int = 50256
    eos_id: int = 50256
    # Placeholders of spatial references (skills.spatial_refs), in configs
    # that have them; moondream2's GPT-2 vocabulary configs name none.
    coord_id: int | None = None
    size_id: int | None = None
    # Nested dicts are not hashable, so the frozen value holds tuples of ids
    # and compares by value; ``template`` reads one.
    templates: dict = attrs.field(factory=_templates, eq=False, hash=False)

    def template(self, skill: str, part: str) -> tuple[int, ...]:
        return self.templates[skill][part]


@attrs.frozen
class MoondreamConfig:
    vision: VisionConfig = VisionConfig()
    text: TextConfig = TextConfig()
    region: RegionConfig = RegionConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()

    def __attrs_post_init__(self):
        # The projection writes text embeddings and the region module reads
        # text hidden states: both widths must be the text width, and the
        # prefix is BOS plus one crop's patches.
        if self.vision.proj_out_dim != self.text.dim or self.region.dim != self.text.dim:
            raise ValueError("vision.proj_out_dim and region.dim must equal text.dim")
        if self.text.prefix_attn != 1 + self.vision.n_patches:
            raise ValueError("text.prefix_attn must be 1 + vision.n_patches")
        self._check_crop_geometry()

    def _check_crop_geometry(self):
        # A crop is cut into whole patches, and neighbouring local crops share
        # overlap_margin patches on each side: a crop whose margins meet or
        # cross leaves nothing of its own, so tiling an image would fail at
        # the first image rather than here, at load.
        v = self.vision
        if v.patch_size <= 0 or v.crop_size % v.patch_size:
            raise ValueError(f"vision.crop_size {v.crop_size} must be a multiple of vision.patch_size "
                             f"{v.patch_size}")
        if not 0 <= 2 * v.overlap_margin < v.grid:
            raise ValueError(f"vision.overlap_margin {v.overlap_margin}: twice it must be under the "
                             f"{v.grid} patches of a crop's side (vision.crop_size / vision.patch_size)")


MOONDREAM2 = MoondreamConfig()


def tiny_config() -> MoondreamConfig:
    """A model small enough for CPU tests that keeps the real geometry where
    the code branches on it: patch 14, 378-px crops of 27 x 27 patches,
    12 crops, margin 4, prefix 730. Only widths, depths and the vocabulary
    shrink."""
    vision = VisionConfig(dim=32, n_layers=2, n_heads=4, ff_dim=48, proj_inner_dim=64,
                          proj_out_dim=64)
    text = TextConfig(dim=64, ff_dim=128, n_layers=2, n_heads=4, vocab_size=128,
                      max_context=1024)
    region = RegionConfig(dim=64, coord_feat_dim=16, coord_out_dim=1024, size_feat_dim=32,
                          size_out_dim=2048, inner_dim=96)
    return MoondreamConfig(vision=vision, text=text, region=region,
                           tokenizer=TokenizerConfig(bos_id=1, eos_id=2))
