"""A tiny random LLaVA checkpoint written to a directory, as a user's would
be: weights, a word-level tokenizer with BOS, EOS and the image token, a
LLaVA-style chat template, and a CLIP image processor. The processor that
transformers pairs with it (``LlavaProcessor``) is the reference's input."""

from __future__ import annotations

from pathlib import Path

import torch

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


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>", "<image>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    tok.chat_template = TEMPLATE
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


def image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                              crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def checkpoint(path: Path, seed: int = 0, text_type: str = "llama") -> Path:
    """A tiny LLaVA with random weights from ``seed``, saved to ``path``."""
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config(text_type)).eval()
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    processor().save_pretrained(path)
    return path


def processor():
    """LLaVA's processor: it expands the image token to one per feature."""
    from transformers import LlavaProcessor

    return LlavaProcessor(image_processor=image_processor(), tokenizer=tokenizer(), patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=TEMPLATE)


def reference(path: Path):
    """transformers' own model and processor for ``path``."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return model, processor()


def generate(model, processor, image, question: str, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' ``generate``, the prompt through the
    processor (which expands the image token to one per feature)."""
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True)
    inputs = processor(images=image, text=text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
