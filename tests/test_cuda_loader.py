"""The embedded SmolLM2 (a GGUF file inside a package) loads through
transformers, is cached as safetensors, and greedy-decodes through the
backend exactly as transformers' ``generate`` does."""

from __future__ import annotations

import pytest
import torch

from bubblefree.cuda_backend.backend import CudaBackend
from bubblefree.cuda_backend.drive import generate
from bubblefree.cuda_backend.loader import default_model_path, load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW = 8


@pytest.fixture(scope="module")
def smollm2():
    return load_model(device="cpu")


def test_default_model_is_found_without_importing_its_package():
    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()


def test_loaded_model_exposes_tokenizer_stop_ids_and_sizes(smollm2):
    assert smollm2.model.config.model_type == "llama"
    assert smollm2.hidden_size == 576
    assert smollm2.vocab_size == 49152
    eos = smollm2.tokenizer.eos_token_id
    assert eos in smollm2.stop_ids
    assert smollm2.tokenizer.decode(smollm2.tokenizer("hello world").input_ids) == "hello world"


def test_gguf_conversion_is_cached(smollm2):
    again = load_model(device="cpu")  # the second load reads the cache
    assert again.source == smollm2.source and "gguf" in again.source


def test_greedy_matches_transformers_generate(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    prompts = [tok(p).input_ids for p in PROMPTS]
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.eos_token_id)
            want.append(out[0, len(ids):].tolist())
    be = CudaBackend(smollm2, page_size=16, num_pages=16, max_rows=4, max_seqs=4,
                     max_prefill_tokens=64, max_context=128)
    got = generate(be, prompts, NEW, row_slots=[3, 1])
    assert got == want
    assert "Paris" in tok.decode(got[0])
    assert be.vocab_size == smollm2.vocab_size


def test_add_tokens_grows_the_vocabulary_before_the_backend():
    loaded = load_model(device="cpu")
    ids = loaded.add_tokens(["<loc_0>", "<loc_1>"])
    assert ids == [49152, 49153]
    assert loaded.tokenizer.convert_ids_to_tokens(ids) == ["<loc_0>", "<loc_1>"]
    be = CudaBackend(loaded, page_size=16, num_pages=4, max_rows=2, max_seqs=2,
                     max_prefill_tokens=32, max_context=64)
    assert be.vocab_size == 49154
    assert be.register_mask(frozenset(ids)) >= 1
    with pytest.raises(RuntimeError, match="before building the backend"):
        loaded.add_tokens(["<loc_2>"])


def _drop_tensor(path, name: str) -> None:
    """``path``'s safetensors without the tensor ``name``."""
    from safetensors.torch import load_file, save_file
    file = path / "model.safetensors"
    tensors = load_file(file)
    assert name in tensors, sorted(tensors)[:5]
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})


def test_a_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path):
    """transformers filled it with random values, said so only in a warning
    the server's quiet log hides, and the model served them."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    load_model(tmp_path, device="cpu")  # whole: loads
    _drop_tensor(tmp_path, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ModelLoadError, match=r"its weights lack model\.layers\.1\.mlp\.down_proj\.weight; "
                                             "they would be random"):
        load_model(tmp_path, device="cpu")


def test_a_vision_language_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path):
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.vlm.load import load_vision_language
    from tests.vlm_world import checkpoint
    checkpoint(tmp_path)
    load_vision_language(tmp_path, device="cpu")  # whole: loads
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        name = next(k for k in f.keys() if "vision" in k and k.endswith("weight"))
    _drop_tensor(tmp_path, name)
    with pytest.raises(ModelLoadError, match="its weights lack .*; they would be random"):
        load_vision_language(tmp_path, device="cpu")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    """Two checkpoints' parts in one directory: the embeddings were grown
    to the tokenizer, quietly, and the model answered with the new rows."""
    from bubblefree import Engine
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    from tests.small_tokenizer import small_bpe_tokenizer
    tokenizer = small_bpe_tokenizer()
    tiny_model("llama", vocab_size=64, eos_token_id=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=rf"its tokenizer has {len(tokenizer)} tokens and its model "
                                             "64 embeddings: they are not one checkpoint's"):
        Engine.from_pretrained(tmp_path, device="cpu")


def test_a_model_directory_without_a_tokenizer_is_a_load_error(tmp_path):
    """A bare ValueError, which the CLI showed as a traceback."""
    from bubblefree import Engine
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer; skills need one"):
        Engine.from_pretrained(tmp_path, device="cpu")


def test_a_model_directory_named_like_a_gguf_file_loads_as_a_directory(tmp_path):
    """It was reported as a GGUF file that does not exist."""
    from bubblefree.cuda_backend.tiny import tiny_model
    path = tmp_path / "model.gguf"
    tiny_model("llama", seed=1).save_pretrained(path)
    assert load_model(path, device="cpu").source == str(path)


def _edit_config(path, update) -> None:
    import json
    config = json.loads((path / "config.json").read_text())
    update(config)
    (path / "config.json").write_text(json.dumps(config))


def test_a_custom_code_checkpoint_is_refused_before_transformers_asks(tmp_path, monkeypatch):
    """transformers prompted on stdin and, answered "y", ran the checkpoint's
    own Python files."""
    import io

    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    from bubblefree.cuda_backend.vlm.load import load_vision_language
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(model_type="mycustom", auto_map={
        "AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}))
    (tmp_path / "configuration_my.py").write_text("raise SystemExit('the checkpoint code ran')\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))
    for load in (load_model, load_vision_language):
        with pytest.raises(ModelLoadError, match=f"^model directory {tmp_path}: its config.json has auto_map "
                                                 r"\(the checkpoint's own Python code\); custom-code "
                                                 "checkpoints are not supported$"):
            load(tmp_path, device="cpu")


def test_a_known_model_type_with_an_auto_map_left_over_loads_as_its_own(tmp_path, monkeypatch):
    """Checkpoints of architectures transformers now has often keep the
    ``auto_map`` of their custom-code days: they load as transformers' own,
    their files never run, and nothing asks on stdin."""
    import io

    from bubblefree.cuda_backend.tiny import tiny_model
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(auto_map={"AutoModelForCausalLM": "modeling_my.MyModel"}))
    (tmp_path / "modeling_my.py").write_text("raise SystemExit('the checkpoint code ran')\n")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert load_model(tmp_path, device="cpu").model.config.model_type == "llama"


def test_config_shapes_disagreeing_with_the_weights_are_refused_naming_them(tmp_path):
    """transformers said "look at the above report" and the report was quiet."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    tiny_model("llama", seed=1, hidden_size=64).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(hidden_size=128))
    with pytest.raises(ModelLoadError, match=r"config.json disagrees with the weights' shapes: "
                                             r"lm_head.weight \(checkpoint \(\d+, 64\), "
                                             r"model \(\d+, 128\)\), "
                                             r".* and \d+ more; they would be random$"):
        load_model(tmp_path, device="cpu")


def test_weights_the_config_has_no_place_for_are_refused_naming_them(tmp_path):
    """A config of one layer over two layers' weights loaded one, silently."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.tiny import tiny_model
    tiny_model("llama", seed=1).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(ModelLoadError, match=r"has no place for the weights model\.layers\.1\..*; "
                                             "they would be dropped$"):
        load_model(tmp_path, device="cpu")


def test_a_vision_language_config_disagreeing_with_its_weights_is_refused(tmp_path):
    from bubblefree.cuda_backend.errors import ModelLoadError
    from bubblefree.cuda_backend.vlm.load import load_vision_language
    from tests.vlm_world import checkpoint
    fewer, wider = checkpoint(tmp_path / "fewer"), checkpoint(tmp_path / "wider")
    _edit_config(fewer, lambda c: c["text_config"].update(num_hidden_layers=1))
    with pytest.raises(ModelLoadError, match=r"has no place for the weights .*layers\.1\."):
        load_vision_language(fewer, device="cpu")
    _edit_config(wider, lambda c: c["text_config"].update(
        intermediate_size=2 * c["text_config"].get("intermediate_size", 64)))
    with pytest.raises(ModelLoadError, match=r"disagrees with the weights' shapes: .*mlp.*\(checkpoint"):
        load_vision_language(wider, device="cpu")


def test_a_load_error_names_the_whole_path(tmp_path):
    """It was cut to 80 characters, losing the file's name."""
    from bubblefree.cuda_backend.errors import ModelLoadError
    path = tmp_path / ("a" * 300)  # a name too long for the file system
    with pytest.raises(ModelLoadError) as err:
        load_model(path, device="cpu")
    assert str(err.value) == f"model path {path}: File name too long"
