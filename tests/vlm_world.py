"""Tiny random vision-language checkpoints written to a directory, as a
user's would be: weights, a word-level tokenizer with BOS, EOS and the
image token, the architecture's style of chat template, and its processor.

``llava``: a CLIP tower, one 28-px image of 16 features. ``llava_next``:
the same tower over a grid of 28-px crops the image's shape chooses (1 x 2,
2 x 1 or 2 x 2) and the whole, with a newline feature a row. ``qwen2_vl``
and ``qwen2_5_vl``: 14-px patches merged 2 x 2, a grid by the image's size,
3-D rotary positions. ``idefics3``
(SmolVLM's architecture): a SigLIP-style tower over 56-px tiles, 4 features
a tile after the pixel shuffle, an image split into up to 2 x 2 tiles by
its size plus the whole, each tile's block wrapped in its row and column
tokens. The processor transformers pairs with each is the reference's
input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

WORDS = ("<unk>", "<s>", "</s>", "<image>", "USER", "ASSISTANT", ":", "?", ".", ",", "what", "is",
         "in", "this", "image", "the", "a", "cat", "dog", "sky", "red", "blue", "describe", "Describe",
         "one", "sentence", "detail", "how", "many", "are", "there", "yes", "no")
# LLaVA-1.5's shape: "<s>USER: <image>\nquestion ASSISTANT:" (images before the text).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'].upper() }}: "
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
            "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
            "{% endif %} {% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
IMAGE_SIZE, PATCH = 28, 7  # 16 patches, 16 features per image (the CLS is dropped)
QUESTIONS = ("what is in this image ?", "how many cat are there ?", "is the sky blue ?")


def picture(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


# Three shapes: tall, wide and square, each choosing another grid or tiling.
IMAGES = (picture(40, 60, 0), picture(90, 30, 1), picture(28, 28, 2))


# SmolVLM's: "<|im_start|>User:<image>question<end_of_utterance>\nAssistant:".
IDEFICS_SPECIAL = ("<|im_start|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>",
                   "<global-img>", *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)))


def vocabulary(special: tuple[str, ...], *roles: str) -> tuple[str, ...]:
    """An architecture's words: its special tokens, its roles, then the rest of ``WORDS``."""
    return ("<unk>", *special, *roles, *WORDS[6:])


IDEFICS_WORDS = vocabulary(IDEFICS_SPECIAL, "User", "Assistant")
IDEFICS_TEMPLATE = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}"
                    "{% if m['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
                    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}"
                    "{% elif c['type'] == 'image' %}<image>{% endif %}{% endfor %}<end_of_utterance>\n"
                    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
TILE = 56  # Idefics3's tiles: 16 patches of 14, 4 features after the 2 x 2 pixel shuffle
# PaliGemma's (Gemma's) specials; its processor adds the <loc####> and <seg###> tokens.
PALI_WORDS = ("<pad>", "<eos>", "<bos>", "<unk>", "<image>", *WORDS[6:])


def tokenizer(arch: str = "llava"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words, special = {"llava": (WORDS, ("<s>", "</s>", "<image>")), "llava_next": (WORDS, ("<s>", "</s>", "<image>")),
                      "idefics3": (IDEFICS_WORDS, IDEFICS_SPECIAL), "qwen2_vl": (QWEN_WORDS, QWEN_SPECIAL),
                      "paligemma": (PALI_WORDS, PALI_WORDS[:5])}[arch]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(list(special))
    if arch in ("llava", "llava_next"):
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    elif arch == "qwen2_vl":  # no BOS
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", unk_token="<unk>",
                                      pad_token="<|endoftext|>")
        tok.chat_template = QWEN_TEMPLATE
        return tok
    elif arch == "paligemma":  # no chat template: the engine writes the processor's layout
        return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                                       unk_token="<unk>", pad_token="<pad>",
                                       extra_special_tokens={"image_token": "<image>"})
    else:
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|im_start|>",
                                      eos_token="<end_of_utterance>", unk_token="<unk>")
    tok.chat_template = IDEFICS_TEMPLATE if arch == "idefics3" else TEMPLATE
    return tok


def config(text_type: str = "llama"):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2Config

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH,
                              projection_dim=32)
    text_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[text_type]
    text = text_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(WORDS), max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=WORDS.index("<image>"),
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="default")


PINPOINTS = [[28, 56], [56, 28], [56, 56]]  # LLaVA-NeXT's grids: 1 x 2, 2 x 1, 2 x 2 crops
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>")
QWEN_WORDS = vocabulary(QWEN_SPECIAL, "user", "assistant")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen2_vl_config():
    from transformers import Qwen2VLConfig, Qwen2VLTextConfig, Qwen2VLVisionConfig

    vision = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    text = Qwen2VLTextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=len(QWEN_WORDS), max_position_embeddings=512,
                             bos_token_id=None, eos_token_id=QWEN_WORDS.index("<|im_end|>"),
                             rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "rope_theta": 10000.0}, initializer_range=0.5)
    # Wide weights: sharp attention, so the answers follow the rotary positions.
    ids = {name: QWEN_WORDS.index(f"<|{token}|>") for name, token in (
        ("image_token_id", "image_pad"), ("video_token_id", "video_pad"),
        ("vision_start_token_id", "vision_start"), ("vision_end_token_id", "vision_end"))}
    return Qwen2VLConfig(vision_config=vision, text_config=text, initializer_range=0.5, **ids)


def qwen2_5_vl_config():
    """Qwen2-VL's text and ids, Qwen2.5-VL's tower: window attention over
    56-px windows in its first block, full attention in its second."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLTextConfig, Qwen2_5_VLVisionConfig

    base = qwen2_vl_config()
    vision = Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                                    window_size=56, fullatt_block_indexes=[1])
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "eos_token_id", "rope_parameters", "initializer_range")
    text = Qwen2_5_VLTextConfig(**{k: v for k, v in base.text_config.to_dict().items() if k in keep})
    ids = {k: getattr(base, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id")}
    return Qwen2_5_VLConfig(vision_config=vision, text_config=text, initializer_range=0.5, **ids)


def qwen2_vl_images():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56 * 4, patch_size=14, merge_size=2,
                                 temporal_patch_size=2)


def llava_next_config():
    from transformers import LlavaNextConfig

    base = config()
    return LlavaNextConfig(vision_config=base.vision_config, text_config=base.text_config,
                           image_token_index=WORDS.index("<image>"), image_grid_pinpoints=PINPOINTS,
                           projector_hidden_act="gelu", vision_feature_layer=-2,
                           vision_feature_select_strategy="default")


def idefics3_config():
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, image_size=TILE, patch_size=14)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=len(IDEFICS_WORDS), max_position_embeddings=512,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                          image_token_id=IDEFICS_WORDS.index("<image>"))


def paligemma_config(vocab: int):
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH)
    text = GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=16, vocab_size=vocab, max_position_embeddings=512,
                       bos_token_id=2, eos_token_id=1, pad_token_id=0, initializer_range=0.5)
    # Wide weights: at the usual 0.02 a tiny random Gemma says one token for ever.
    return PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=64,
                           image_token_index=PALI_WORDS.index("<image>"), initializer_range=0.5)


def smolvlm_config():
    """Idefics3's tiny shapes as SmolVLM2's classes."""
    from transformers import SmolVLMConfig, SmolVLMVisionConfig

    base = idefics3_config()
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
            "patch_size")
    vision = SmolVLMVisionConfig(**{k: v for k, v in base.vision_config.to_dict().items() if k in keep})
    return SmolVLMConfig(vision_config=vision, text_config=base.text_config, scale_factor=2,
                         image_token_id=base.image_token_id)


def smolvlm_images():
    from transformers import SmolVLMImageProcessor

    return SmolVLMImageProcessor(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
                                 do_image_splitting=True)


def image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def checkpoint(path: Path, seed: int = 0, text_type: str = "llama", arch: str = "llava") -> Path:
    """A tiny ``arch`` model with random weights from ``seed``, saved to ``path``."""
    from transformers import (Idefics3ForConditionalGeneration, LlavaForConditionalGeneration,
                              LlavaNextForConditionalGeneration, PaliGemmaForConditionalGeneration,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration,
                              SmolVLMForConditionalGeneration)

    torch.manual_seed(seed)
    if arch in ("qwen2_vl", "qwen2_5_vl"):  # its processor needs torchvision (a video processor): its parts
        model = (Qwen2VLForConditionalGeneration(qwen2_vl_config()) if arch == "qwen2_vl"
                 else Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config())).eval()
        model.generation_config.eos_token_id = QWEN_WORDS.index("<|im_end|>")
        model.save_pretrained(path)
        tokenizer("qwen2_vl").save_pretrained(path)
        qwen2_vl_images().save_pretrained(path)
        return path
    if arch == "smolvlm":  # its processor needs num2words and torchvision (a video processor): its parts
        model = SmolVLMForConditionalGeneration(smolvlm_config()).eval()
        model.generation_config.eos_token_id = IDEFICS_WORDS.index("<end_of_utterance>")
        model.save_pretrained(path)
        tokenizer("idefics3").save_pretrained(path)
        smolvlm_images().save_pretrained(path)
        return path
    made = processor(arch)
    if arch == "llava":
        model = LlavaForConditionalGeneration(config(text_type)).eval()
    elif arch == "llava_next":
        model = LlavaNextForConditionalGeneration(llava_next_config()).eval()
    elif arch == "paligemma":
        model = PaliGemmaForConditionalGeneration(paligemma_config(len(made.tokenizer))).eval()
    else:
        model = Idefics3ForConditionalGeneration(idefics3_config()).eval()
    model.generation_config.eos_token_id = made.tokenizer.eos_token_id
    model.save_pretrained(path)
    made.save_pretrained(path)
    return path


def processor(arch: str = "llava"):
    """The architecture's processor: it expands the image token into the image's block."""
    from transformers import (Idefics3ImageProcessor, Idefics3Processor, LlavaNextImageProcessor,
                              LlavaNextProcessor, LlavaProcessor, PaliGemmaProcessor, SiglipImageProcessor)

    if arch == "paligemma":
        images = SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        images.image_seq_length = (IMAGE_SIZE // PATCH) ** 2
        return PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer(arch))
    if arch == "llava":
        return LlavaProcessor(image_processor=image_processor(), tokenizer=tokenizer(), patch_size=PATCH,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=TEMPLATE)
    if arch == "llava_next":
        images = LlavaNextImageProcessor(size={"shortest_edge": IMAGE_SIZE}, image_grid_pinpoints=PINPOINTS,
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer(), patch_size=PATCH,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=TEMPLATE)
    images = Idefics3ImageProcessor(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
                                    do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer(arch), image_seq_len=4,
                             chat_template=IDEFICS_TEMPLATE)


def saved_images(path: Path):
    """The checkpoint's image processor, loaded as the engine loads it."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, local_files_only=True)


class Rendered:
    """A stand-in processor's chat side: the tokenizer's template, as text."""

    def __init__(self, tokenizer_of: str, images, template: str):
        self.tokenizer, self.image_processor, self.chat_template = tokenizer(tokenizer_of), images, template

    def apply_chat_template(self, turn, add_generation_prompt=True):
        return self.tokenizer.apply_chat_template(turn, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)


class QwenReference(Rendered):
    """Qwen2-VL's processor, as transformers' would expand a turn (it cannot
    be built without torchvision): the image processor's patches, the
    single image token repeated once per merged patch, and the token types
    (1 for the image's) from which the model computes its 3-D positions."""

    def __init__(self, path: Path):
        super().__init__("qwen2_vl", saved_images(path), QWEN_TEMPLATE)

    def __call__(self, images=None, text="", return_tensors="pt", add_special_tokens=False):
        if images is not None and not isinstance(images, list):
            images = [images]
        out = dict(self.image_processor(images=images, return_tensors="pt")) if images is not None else {}
        if isinstance(text, list):
            text = text[0]
        if images is not None:
            count = int(out["image_grid_thw"].prod()) // 4
            text = text.replace("<|image_pad|>", "<|image_pad|>" * count)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        kinds = (ids["input_ids"] == QWEN_WORDS.index("<|image_pad|>")).to(torch.int)  # 1: image
        return {**out, "input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
                "mm_token_type_ids": kinds}


class SmolReference(Rendered):
    """SmolVLM2's processor, as transformers' would expand a turn (it cannot
    be built without num2words and torchvision): its image processor's
    tiles and SmolVLM's own prompt string for their rows and columns."""

    def __init__(self, path: Path):
        super().__init__("idefics3", saved_images(path), IDEFICS_TEMPLATE)

    def __call__(self, images=None, text="", return_tensors="pt", add_special_tokens=False):
        from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

        if isinstance(text, list):
            text = text[0]
        out = {}
        if images is not None:
            images = images if isinstance(images, list) else [images]
            out = dict(self.image_processor(images=[images], return_tensors="pt", return_row_col_info=True))
            rows, cols = out.pop("rows")[0][0], out.pop("cols")[0][0]
            text = text.replace("<image>", get_image_prompt_string(rows, cols, 4, "<fake_token_around_image>",
                                                                   "<image>", "<global-img>"))
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        return {**out, "input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}


def reference(path: Path, arch: str = "llava"):
    """transformers' own model and processor for ``path``, both loaded from
    it as a user's ``generate`` would (a processor class can pick another
    image backend than the one it was saved from: with torchvision,
    transformers 5.17's Idefics3 resizes by another filter); the stand-ins
    where the processor cannot load here."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    if arch == "smolvlm":
        return model, SmolReference(path)
    if arch.startswith("qwen"):
        return model, QwenReference(path)
    return model, AutoProcessor.from_pretrained(path, local_files_only=True)


def generate(model, processor, image, question: str, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' ``generate``, the prompt through the
    processor (which expands the image token into the image's block;
    PaliGemma's writes its own layout around the question)."""
    if model.config.model_type == "paligemma":
        inputs = processor(images=image, text=question, return_tensors="pt")
        inputs.pop("labels", None)
    else:
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(turn, add_generation_prompt=True)
        inputs = processor(images=image, text=text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
