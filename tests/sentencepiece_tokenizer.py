"""A small SentencePiece-style tokenizer built offline, for tests of what the default model's byte-level BPE never
shows: a token's text that depends on its neighbours, and encodings that do not round-trip.

Its shape is the one transformers gives Llama 2 and Mistral (`LlamaTokenizer`, also from a GGUF): a `Metaspace`
pre-tokenizer that writes spaces as "▁" and puts one before the first word of an encode (but not after a special
token), and a decoder that turns "▁" back into spaces and strips the first one. Its normalization is
SentencePiece's default (`nmt_nfkc` with extra whitespace removed: NFKC, runs of spaces collapsed) and it has no
byte fallback, so `decode(encode(s)) != s` for "a  b" (-> "a b"), "ﬁ" (-> "fi") or a character it never saw
(-> "<unk>"). BPE trained on a few sentences: deterministic, ~150 tokens, built in milliseconds.
"""

from __future__ import annotations

from functools import cache

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

TRAINING_TEXT = [
    "Paris is the capital of France.",
    '{"name": "Paris", "age": 27, "city": "Rome"}',
    "The quick brown fox jumps over the lazy dog.",
    "John and Mary live in Oslo and Bergen.",
    'Answer in JSON: {"answer": "yes"}',
]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


@cache
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.train_from_iterator(TRAINING_TEXT * 4, trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
