"""A character tokenizer for data-loader tests: exact token counts by hand (one token per character)."""

EOS = 1


class CharTok:
    """Token id = code point + 10; EOS = 1; no chat template."""

    eos_token_id = EOS
    eos_token = "<eos>"
    chat_template = None
    name_or_path = "char"

    def __call__(self, text, add_special_tokens=False, verbose=False, **kw):
        return {"input_ids": [ord(c) + 10 for c in text]}

    def get_vocab(self):
        return {"<eos>": EOS}
