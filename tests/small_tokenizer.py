"""A small byte-level BPE tokenizer in transformers' clothing, trained in
memory on a few skill phrases: a real ``PreTrainedTokenizerFast`` without a
download."""

from __future__ import annotations


def small_bpe_tokenizer():
    import transformers
    from tokenizers import Tokenizer as Raw, decoders, models, pre_tokenizers, trainers

    raw = Raw(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = ["Question: what is the cat? Answer: a cat on a mat.",
              "M L C Z M 0 L Z yes no Point: Detect: Segment: Describe this image."] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
