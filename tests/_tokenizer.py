"""A real (tiny) HF fast tokenizer for tests that need text: prompts, chat templates, the rollout pipeline."""

import string

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_char_tokenizer(path, chat_template=CHAT_TEMPLATE):
    """A real (tiny) HF fast tokenizer: one token per printable character, ids < 110, saved to ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_rl.rollout.base import checked_tokenizer

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=SPECIAL[3:])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    # loaded as the product loads a model dir's tokenizer (AutoTokenizer, then the class tokenizer_config.json
    # names where transformers swaps it: rollout/base.py checked_tokenizer)
    return checked_tokenizer(AutoTokenizer.from_pretrained(str(path)), str(path))
