"""Transformers vision-language models (LLaVA with Llama and Qwen2 text,
LLaVA-NeXT, Idefics3, SmolVLM2, PaliGemma, Qwen2-VL, Qwen2.5-VL; tiny and random, from a
checkpoint directory as a user's)
through the public Engine on the CPU:
greedy answers about images equal transformers' ``generate`` with the
model's own processor, alone and batched, pipelined and blocking; text-only
questions too; every bad image and a question spelling the image token are
refused naming the field while the engine keeps serving; cancels free
every page; what is not served is refused naming why."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import moondream
import openai
import pytest
import torch

from bubblefree import Engine, InvalidRequest, Status
from bubblefree.cuda_backend.errors import ModelLoadError, UnsupportedModel
from tests import vlm_world
from tests.image_world import png
from tests.server_support import serving
from tests.serving_world import WAIT, wait_idle
from tests.test_images import BAD

OPTIONS = dict(device="cpu", page_size=16, num_pages=64, max_rows=4, max_seqs=8)
IMAGES, QUESTIONS = vlm_world.IMAGES, vlm_world.QUESTIONS


@pytest.fixture(scope="module", params=[("llava", "llama"), ("llava", "qwen2"), ("llava_next", "llama"),
                                        ("idefics3", "llama"), ("smolvlm", "llama"), ("paligemma", "gemma"),
                                        ("qwen2_vl", "qwen2"), ("qwen2_5_vl", "qwen2")],
                ids=lambda p: "-".join(p))
def world(request, tmp_path_factory):
    arch, text = request.param
    path = vlm_world.checkpoint(tmp_path_factory.mktemp(arch + text), seed=3, text_type=text, arch=arch)
    model, processor = vlm_world.reference(path, arch)
    engine = Engine.from_pretrained(str(path), **OPTIONS)
    yield engine, model, processor
    engine.close()


def test_answers_about_images_equal_generate_alone_and_batched_in_both_modes(world):
    engine, model, processor = world
    cases = [(image, question) for image in IMAGES for question in QUESTIONS[:2]]
    expected = [vlm_world.generate(model, processor, image, q, 10) for image, q in cases]
    assert sum(map(len, expected)) > 3 * len(cases)  # answers, not just an end token
    for pipelined in (False, True, "auto"):
        engine.pipelined = pipelined
        alone = [engine.submit("query", image=image, question=q, max_tokens=10).result(WAIT).tokens
                 for image, q in cases]
        together = [h.result(WAIT).tokens for h in engine.submit_many(
            [("query", dict(image=image, question=q, max_tokens=10)) for image, q in cases])]
        assert [list(t) for t in alone] == expected, pipelined
        assert [list(t) for t in together] == expected, pipelined
    wait_idle(engine)


def test_threads_submitting_images_at_once_get_the_answers_they_get_alone(world):
    import threading

    engine, _, _ = world
    cases = [(image, q) for image in IMAGES for q in QUESTIONS]
    alone = [engine.submit("query", image=image, question=q, max_tokens=6).result(WAIT).tokens
             for image, q in cases]
    got: dict[int, tuple] = {}

    def ask(i: int) -> None:
        image, q = cases[i]
        got[i] = engine.submit("query", image=image, question=q, max_tokens=6).result(WAIT).tokens

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert [got[i] for i in range(len(cases))] == alone
    wait_idle(engine)


def test_a_text_question_on_the_vision_model_equals_generate_without_an_image(world):
    import torch

    engine, model, processor = world
    tokenizer = processor.tokenizer
    if model.config.model_type == "paligemma":
        # Its layout without an image, BOS, the text and a newline, all of it a
        # prefix attended both ways (token type 0).
        ids = tokenizer(tokenizer.bos_token + QUESTIONS[2] + "\n", add_special_tokens=False,
                        return_tensors="pt")["input_ids"]
        extra = {"token_type_ids": torch.zeros_like(ids)}
    else:
        turn = [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[2]}]}]
        ids = tokenizer(processor.apply_chat_template(turn, add_generation_prompt=True),
                        add_special_tokens=False, return_tensors="pt")["input_ids"]
        extra = {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, **extra)
    expected = out[0, ids.shape[1]:].tolist()
    assert list(engine.submit("query", question=QUESTIONS[2], max_tokens=8).result(WAIT).tokens) == expected


def test_the_tower_runs_by_image_count_where_its_input_has_one_shape(world):
    """LLaVA's and PaliGemma's images all have one shape: their tower runs as
    a graph per image count (here eagerly, the same buckets), up to the
    rows a step can hold; the others' shapes follow the image, so theirs
    runs eagerly. The parity tests above then prove the bucketed path."""
    from bubblefree.cuda_backend.vlm.tower_graphs import FIXED

    engine, model, _ = world
    tower = engine.backend._tower
    if model.config.model_type in FIXED:
        assert tower is not None and tower.chunk == OPTIONS["max_rows"]
        assert str(tower) in engine.backend.prefill_path
        assert tower.takes(engine.images.ref(IMAGES[1]).source.tensors)
    else:
        assert tower is None and "vision tower eager" in engine.backend.prefill_path


@pytest.mark.parametrize("arch, text", [("llava", "llama"), ("paligemma", "gemma")])
def test_more_images_than_a_replay_holds_run_in_chunks_in_order(tmp_path, arch, text):
    """Five images through a tower of two images a replay (2, 2, 1): each
    image's features equal the tower's on that image alone, in order."""
    from bubblefree.cuda_backend.graphs import GraphSet
    from bubblefree.cuda_backend.vlm.tower_graphs import TowerGraphs

    path = vlm_world.checkpoint(tmp_path, seed=5, text_type=text, arch=arch)
    engine = Engine.from_pretrained(str(path), **OPTIONS)
    try:
        vl = engine.backend.vl
        pixels = [engine.images.ref(vlm_world.picture(20 + 9 * i, 50 - 5 * i, i)).source.tensors
                  for i in range(5)]
        tower = TowerGraphs.make(vl, pixels[0], 2, GraphSet(engine.backend.device, False),
                                 engine.backend.device, engine.backend.dtype)
        assert tower is not None and tower.chunk == 2
        with torch.no_grad():
            got = tower.features(pixels)
            alone = [vl.image_features(pixel_values=t["pixel_values"][None])[0] for t in pixels]
        assert len(got) == 5
        for g, a in zip(got, alone):
            torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got[0], got[1])  # five images, five answers
    finally:
        engine.close()


def test_the_prefix_is_the_head_and_the_processors_block(world):
    """The chat template's ids before the image, then what the model's
    processor expands the image token into: LLaVA's a placeholder per
    feature whatever the image; Idefics3's tiles by the image's size, each
    wrapped in its row and column tokens, and the whole image last."""
    engine, model, processor = world
    tokenizer = processor.tokenizer
    token = model.config.image_token_id
    if model.config.model_type == "paligemma":  # the image first, then BOS, then the question
        head = ()
        inputs = processor(text=QUESTIONS[0], images=[IMAGES[0]])["input_ids"][0]
        after = list(engine.skills.request("query", image=engine.images.ref(IMAGES[0]),
                                           question=QUESTIONS[0]).prompt)
        assert list(inputs) == list(engine.images.ref(IMAGES[0]).source.block) + after
    else:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}]
        rendered = tokenizer.encode(processor.apply_chat_template(turn, add_generation_prompt=True),
                                    add_special_tokens=False)
        head = tuple(rendered[:rendered.index(token)])
    assert engine.skills.tokenizer.image_turn.head == head
    lengths = set()
    for image in IMAGES:
        ref = engine.images.ref(image)
        if model.config.model_type == "paligemma":
            expanded = [token] * processor.image_seq_length + [tokenizer.bos_token_id]
        else:
            expanded = processor(text=tokenizer.convert_ids_to_tokens(token), images=[image],
                                 add_special_tokens=False)["input_ids"][0]
        assert ref.source.block == tuple(expanded) and ref.length == len(head) + len(expanded)
        lengths.add(ref.length)
    if model.config.model_type == "paligemma":
        assert lengths == {processor.image_seq_length + 1}
    elif model.config.model_type == "llava":
        assert lengths == {len(head) + (vlm_world.IMAGE_SIZE // vlm_world.PATCH) ** 2}
    else:
        assert len(lengths) > 1  # the grid follows the image's size
        if model.config.model_type in ("idefics3", "smolvlm"):
            assert "<row_2_col_2>" in tokenizer.convert_ids_to_tokens(engine.images.ref(IMAGES[0]).source.block)
    assert engine.takes_images


@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_tiles_as_rows_as_older_transformers_give_them_answer_as_images(tmp_path, monkeypatch, arch):
    """transformers 5.17's Idefics3 returns an image call's features as one
    row per tile, ``[tiles, tokens, D]``, where later ones split them per
    image: the engine splits them itself, so answers, batched images of
    the same shape included, still equal ``generate``."""
    from bubblefree.cuda_backend.vlm.model import tile_features

    path = vlm_world.checkpoint(tmp_path, seed=3, text_type="llama", arch=arch)
    model, processor = vlm_world.reference(path, arch)
    engine = Engine.from_pretrained(str(path), **OPTIONS)
    inner = engine.backend.vl.vlm.model
    own, calls = inner.get_image_features, []

    def as_rows(**pixels):
        out = own(**pixels)
        calls.append(pixels["pixel_values"].shape[0])
        if isinstance(out.pooler_output, (list, tuple)):  # this transformers splits them: 5.17's form
            rows = torch.cat(list(out.pooler_output))
            out.pooler_output = rows.view(-1, tile_features(model.config), rows.shape[-1])
        assert out.pooler_output.shape[1:] == (tile_features(model.config), model.config.text_config.hidden_size)
        return out

    monkeypatch.setattr(inner, "get_image_features", as_rows)
    try:
        cases = [(image, q) for image in IMAGES for q in QUESTIONS[:2]]
        expected = [vlm_world.generate(model, processor, image, q, 8) for image, q in cases]
        got = [h.result(WAIT).tokens for h in engine.submit_many(
            [("query", dict(image=image, question=q, max_tokens=8)) for image, q in cases])]
        assert [list(t) for t in got] == expected
        assert max(calls) == 2  # the same image twice in one tower call
        wait_idle(engine)
    finally:
        engine.close()


def test_an_encoded_image_is_encoded_once_and_answers_as_the_image_does(world):
    """The tower runs once for an encoded image; after its first step, a
    row about it prefills its prompt alone over the kept prefix KV (but on
    a prefix LM, PaliGemma, whose image attends to the question)."""
    engine, model, _ = world
    tower, text = engine.backend.vl.vision_parts[0], engine.backend.vl.text
    images_seen: list[int] = []
    prefilled: list[int] = []  # tokens each image prefill's text forward ran over
    def seen(mod, args, kwargs, out):  # the first dimension of the tower's pixels, per call
        images_seen.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    hooks = [tower.register_forward_hook(seen, with_kwargs=True),
             text.register_forward_pre_hook(lambda mod, args, kwargs: prefilled.append(
                 kwargs["inputs_embeds"].shape[1]) if kwargs.get("inputs_embeds") is not None else None,
                 with_kwargs=True)]
    try:
        encoded = engine.encode_image(IMAGES[1])
        calls = [("query", dict(image=image, question=q, max_tokens=8))
                 for image in (IMAGES[1], encoded) for q in QUESTIONS]
        direct = [h.result(WAIT).tokens for h in engine.submit_many(calls[:3])]
        assert len(images_seen) == 1  # three rows, one batch through the tower
        first = [h.result(WAIT).tokens for h in engine.submit_many(calls[3:])]
        assert len(images_seen) == 2  # the encoded image, once for its three rows
        assert images_seen[0] == 3 * images_seen[1]  # and one image's pixels, not three copies
        prefilled.clear()
        again = [engine.submit(skill, **args).result(WAIT).tokens for skill, args in calls[3:]]
        prompts = [len(engine.skills.request(skill, **dict(args, image=engine.images.ref(encoded))).prompt)
                   for skill, args in calls[3:]]
        prefix = engine.images.ref(encoded).length
        mixed = [h.result(WAIT).tokens for h in engine.submit_many([calls[3], calls[0], calls[4]])]
    finally:
        for hook in hooks:
            hook.remove()
    assert first == direct and again == direct and mixed == [direct[0], direct[0], direct[1]]
    assert len(images_seen) == 3  # only the mixed step's plain image ran the tower again
    if engine.backend.vl.prefix_lm:
        assert prefilled[:3] == [prefix + n for n in prompts]
    else:
        assert prefilled[:3] == prompts  # the prompt alone: its prefix's KV was kept
    assert engine.encode_image(encoded) is encoded
    other = Engine.from_pretrained(model.name_or_path, **OPTIONS)  # the same checkpoint
    try:
        with pytest.raises(InvalidRequest, match="another engine"):
            other.query(encoded, QUESTIONS[0])
    finally:
        other.close()


def test_a_vision_tower_that_fails_fails_its_rows_only_and_an_encoded_image_encodes_again(world):
    engine, _, _ = world
    expected = engine.submit("query", image=IMAGES[2], question=QUESTIONS[1], max_tokens=6).result(WAIT).tokens
    encoded = engine.encode_image(IMAGES[2])
    text = engine.submit("query", question=QUESTIONS[2], max_tokens=30)  # decoding through the failure
    fail = [True]

    def once(module, args):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("the tower broke")

    hook = engine.backend.vl.vision_parts[0].register_forward_pre_hook(once)
    try:
        failed = engine.submit("query", image=encoded, question=QUESTIONS[1], max_tokens=6).result(WAIT)
    finally:
        hook.remove()
    assert failed.status is Status.FAILED and "the tower broke" in failed.finish_reason
    assert encoded.ref.source.features is None  # forgotten: the next step encodes it
    assert engine.submit("query", image=encoded, question=QUESTIONS[1],
                         max_tokens=6).result(WAIT).tokens == expected
    assert text.result(WAIT).status is Status.COMPLETED
    wait_idle(engine)


@pytest.mark.parametrize("kind", sorted(set(BAD) - {"none"}))  # None: a question without an image
def test_a_bad_image_is_refused_naming_image_and_the_engine_serves_on(world, kind, tmp_path):
    engine, _, _ = world
    with pytest.raises(InvalidRequest, match=r"image"):
        engine.query(BAD[kind](tmp_path), QUESTIONS[0])
    assert engine.submit("query", image=IMAGES[0], question=QUESTIONS[0],
                         max_tokens=4).result(WAIT).status is Status.COMPLETED


@pytest.mark.parametrize("question", ["what is {} ?", "{}"])
def test_a_question_that_spells_the_image_token_is_refused(world, question):
    engine, _, _ = world
    token = engine.skills.tokenizer.image_turn.token
    question = question.format(token)
    with pytest.raises(InvalidRequest, match=rf"^prompt: holds the model's image token '{re.escape(token)}' 2 times"):
        engine.submit("query", image=IMAGES[0], question=question)
    with pytest.raises(InvalidRequest, match=rf"image token '{re.escape(token)}' without an image"):
        engine.submit("query", question=question)
    assert engine.submit("query", image=IMAGES[0], question=QUESTIONS[0],
                         max_tokens=4).result(WAIT).status is Status.COMPLETED


def test_cancels_mid_image_request_free_every_page(world):
    engine, _, _ = world
    handles = engine.submit_many([("query", dict(image=image, question=q, max_tokens=40))
                                  for image in IMAGES for q in QUESTIONS])
    for h in handles[::2]:
        h.cancel()
    for h in handles:
        assert h.result(WAIT).status in (Status.COMPLETED, Status.CANCELLED)
    wait_idle(engine)


def test_the_spatial_skills_are_refused_without_location_tokens(world):
    engine, _, _ = world
    with pytest.raises(InvalidRequest, match=r"^skill: this model has no location tokens or region head"):
        engine.point(IMAGES[0], "cat")


def test_an_image_from_another_backend_is_refused(world):
    """Refused at submit, naming the image, since the engine takes only refs
    it made; the backend's own check at launch (which fails the request
    alone, here) is its second line, for a ref the engine would pass."""
    from bubblefree.core.values import ImageRef

    engine, _, _ = world
    foreign = ImageRef(length=engine.images.ref(IMAGES[0]).length, source=object())
    with pytest.raises(InvalidRequest, match="^image: an ImageRef this engine did not make"):
        engine.submit("query", image=foreign, question=QUESTIONS[0], max_tokens=4)
    engine.images._made.add(foreign)  # past the intake, as a ref it made: the backend refuses it at launch
    handle = engine.submit("query", image=foreign, question=QUESTIONS[0], max_tokens=4)
    assert handle.result(WAIT).status is Status.FAILED
    assert "did not make" in handle.result(WAIT).finish_reason
    assert engine.submit("query", image=IMAGES[0], question=QUESTIONS[0],
                         max_tokens=4).result(WAIT).status is Status.COMPLETED


def test_streams_asyncio_and_the_clients_over_http_give_the_same_answers(world):
    engine, _, _ = world
    image, question = IMAGES[0], QUESTIONS[0]
    answer = engine.query(image, question, max_tokens=8)["answer"]
    assert "".join(engine.stream("query", image=image, question=question, max_tokens=8)) == answer

    async def both():
        pieces = [p async for p in engine.astream("query", image=image, question=question, max_tokens=8)]
        return "".join(pieces), (await engine.arun("query", image=image, question=question, max_tokens=8))
    streamed, ran = asyncio.run(both())
    assert streamed == answer and ran["answer"] == answer
    caption = engine.submit("caption", image=image, length="short", max_tokens=6).result(WAIT)
    assert caption.status is Status.COMPLETED and isinstance(caption.output["caption"], str)  # random: any text
    with serving(engine) as url:
        md = moondream.vl(endpoint=f"{url}/v1")
        sent = base64.b64decode(md.encode_image(image).image_url.partition(",")[2])
        assert md.query(image, question, settings={"max_tokens": 8}) == engine.query(sent, question, max_tokens=8)
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        uri = "data:image/png;base64," + base64.b64encode(png(image)).decode()
        reply = oa.chat.completions.create(model="any", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": uri}}]}])
        assert reply.choices[0].message.content.strip() == engine.query(png(image), question,
                                                                         max_tokens=8)["answer"].strip()
        # The image opens the conversation: its prefix holds the template's tokens before it.
        with pytest.raises(openai.UnprocessableEntityError, match="the image must open the conversation"):
            oa.chat.completions.create(model="any", max_tokens=4, messages=[
                {"role": "user", "content": "what"}, {"role": "assistant", "content": "a cat"},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}])
        token = engine.skills.tokenizer.image_turn.token
        with pytest.raises(openai.UnprocessableEntityError, match=re.escape(f"image token '{token}'")):
            oa.chat.completions.create(model="any", max_tokens=4, messages=[
                {"role": "user", "content": f"what is {token} ?"}])
        assert engine.query(image, question, max_tokens=8)["answer"] == answer  # served on
    wait_idle(engine)


# -- what is refused at load ------------------------------------------------------

def _edit(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type, why", [("mllama", "served: llava, llava_next"),
                                             ("gemma3", "no vision-language path here")])
def test_architectures_not_served_are_refused_naming_why(tmp_path, model_type, why):
    from bubblefree.cuda_backend.vlm.model import supported

    assert why in supported(model_type)
    path = vlm_world.checkpoint(tmp_path)
    _edit(path, model_type=model_type)
    with pytest.raises((UnsupportedModel, ModelLoadError), match=rf"model type '{model_type}'|{model_type}"):
        Engine.from_pretrained(str(path), **OPTIONS)


def test_a_checkpoint_without_a_chat_template_is_refused_naming_it(tmp_path):
    path = vlm_world.checkpoint(tmp_path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="chat template"):
        Engine.from_pretrained(str(path), **OPTIONS)
