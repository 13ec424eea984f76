"""``bench.read_chain``: a step's chain of kernels that only read. Its
kernels stand for the step's bytes (checked against the transformers
models' own weights), its launches cover every word once, its command
refuses bad values by name; on a Hopper GPU its kernels read the words
they stand for and its check catches a chain that does not."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st

from bubblefree.bench import read_chain as rc
from bubblefree.bench.speed_setup import SHAPES
from bubblefree.cuda_backend import pdl

HOPPER = pytest.mark.skipif(not pdl.supported("cuda"),
                            reason="needs CUDA, Triton and an sm_90 GPU: dependent launches")


def meta_model(shape: str):
    with torch.device("meta"):
        return getattr(transformers, SHAPES[shape]["cls"])(SHAPES[shape]["config"]())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_layers_gemms_read_the_layers_linear_weights_in_bf16(shape):
    model = meta_model(shape)
    first = model.model.layers[0]
    linear = sum(m.weight.numel() * 2 for m in first.modules() if isinstance(m, torch.nn.Linear))
    names = {"norm", "attention"}
    gemm_bytes = sum(k.nbytes for k in rc.layer(shape, 128) if k.name not in names)
    assert gemm_bytes == linear


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_step_is_every_layer_then_the_head_and_greedy(shape):
    model = meta_model(shape)
    cfg = model.config
    ks = rc.step(shape, 128)
    per_layer = 4 if cfg.model_type == "phi" else 7
    assert len(ks) == per_layer * cfg.num_hidden_layers + 2
    head = model.lm_head.weight
    assert ks[-2] == rc.Kernel("head", head.numel() * 2)
    assert ks[-1] == rc.Kernel("greedy", cfg.vocab_size * 4)
    whole = rc.step(shape, 128, one_a_layer=True)
    assert len(whole) == cfg.num_hidden_layers + 2
    assert sum(k.nbytes for k in whole) == sum(k.nbytes for k in ks)


def test_attention_reads_every_key_and_value_of_the_context():
    cfg = SHAPES["qwen05b"]["config"]()
    at = {k.name: k.nbytes for k in rc.layer("qwen05b", 300)}
    assert at["attention"] == 300 * cfg.num_key_value_heads * 64 * 2 * 2


@given(words=st.integers(1, 1 << 26).map(lambda n: n * rc.ALIGN),
       how=st.sampled_from(rc.SUMMED + rc.HOLDING))
def test_a_launch_covers_every_word_once_with_no_empty_program(words, how):
    programs, share = how.grid(words)
    assert programs >= 1 and share % rc.ALIGN == 0
    if how.programs:  # summed: at most the launch's programs
        assert programs <= how.programs
    else:  # held: one load a program, as many programs as that takes
        assert share == how.block and programs == -(-words // how.block)
    assert programs * share >= words > (programs - 1) * share


@pytest.mark.parametrize("mode", rc.MODES)
def test_a_held_mode_is_launched_one_load_a_program_and_the_others_summed(mode):
    assert all(bool(how.programs) == (mode not in rc.HELD) for how in rc.launches(mode))


@pytest.mark.parametrize("nbytes,words", [(1, 16), (64, 16), (65, 32), (4096, 1024)])
def test_a_kernels_words_are_whole_aligned_groups(nbytes, words):
    assert rc.Kernel("k", nbytes).words == words


@pytest.mark.parametrize("argv,why", [
    (["--models", "gpt2"], "'gpt2' is not a shape"),
    (["--models", "qwen05b,nope"], "'nope' is not a shape"),
    (["--context", "0"], "--context: at least 1 key, not 0"),
])
def test_the_command_refuses_bad_values_by_name(capsys, argv, why):
    with pytest.raises(SystemExit) as exit_:
        rc.main(argv)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err


def test_without_a_hopper_gpu_the_command_says_what_it_needs(capsys, monkeypatch):
    monkeypatch.setattr(rc.pdl, "supported", lambda device: False)
    with pytest.raises(SystemExit):
        rc.main(["--models", "qwen05b"])
    assert "needs a Hopper-class CUDA GPU and Triton" in capsys.readouterr().err


@HOPPER
@pytest.mark.parametrize("mode", rc.MODES)
def test_the_chain_reads_every_word_it_stands_for(mode):
    rc.check(mode)


@HOPPER
def test_the_check_catches_a_chain_that_skips_a_kernel(monkeypatch):
    real = rc.launch_chain
    monkeypatch.setattr(rc, "launch_chain", lambda buffer, kernels, launches, mode, carry: real(
        buffer, kernels[:-1] + kernels[-1:] * 0, launches, mode, carry))
    with pytest.raises(RuntimeError, match="summed other words"):
        rc.check("release")


@HOPPER
def test_a_chain_is_timed_and_the_fastest_launch_is_cached():
    kernel = rc.Kernel("k", 1 << 20)
    cache: dict = {}
    how, us = rc.fastest(kernel, "after", cache)
    assert how in rc.SUMMED and 0 < us < 1e3
    held, _ = rc.fastest(kernel, "hold", cache)
    assert held in rc.HOLDING
    assert rc.fastest(kernel, "after", cache) == (how, us)
