"""A tiny deterministic byte-level BPE tokenizer for the random test checkpoints.

Trained offline (milliseconds) on the little corpus below, so no tokenizer has
to be downloaded. Byte-level means every string encodes and decodes back
exactly, which the tests and the streaming detokenizer of mlx-lm rely on.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Like Qwen3: the thinking markers are added tokens but not "special", so a
# decode keeps them in the text.
THINK_TOKENS = (THINK, END_THINK)

TARGET_VOCAB = 640

# The assistant's turn opens; `enable_thinking=False` pre-fills an empty think block
# the way Qwen3's template does.
GENERATION_PROMPT = (
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
) + GENERATION_PROMPT

# ChatML with tools, in Qwen's format (mlx-lm recognises it as its `json_tools`
# parser): the tool specs in a system block, calls as <tool_call>{json}</tool_call>,
# results as <tool_response> in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' "
    "+ (tool_call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
) + GENERATION_PROMPT

CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes
every token to a few of its many experts, so only a small part of the weights
is needed for each step. When the experts do not fit in memory, they can be
read from the disk as they are needed, and the ones used most often are kept
in a cache.

Once upon a time there was a little town by the sea. The people of the town
went out in their boats every morning and came back in the evening with fish,
stories and songs. The children played on the beach and watched the ships
sail past the lighthouse, and they wondered where the ships were going.

To make a cup of tea, boil some water, put the tea in the pot and pour the
water over it. Wait for three or four minutes, then pour the tea into a cup.
Some people like to add milk or sugar; others drink it just as it is.

The weather today will be sunny in the morning, with clouds coming in from the
west during the afternoon. There is a chance of rain in the evening, and the
wind will be light. Tomorrow should be warmer, with temperatures reaching
twenty degrees.

Python is a programming language that is easy to read and write. A function
is defined with def, and a class with class. Lists, dictionaries and sets are
built in, and there is a large standard library for files, networks, numbers,
text and much more. Tests are written with assert statements.

Question: What is the capital of France? Answer: The capital of France is
Paris. Question: How many days are there in a week? Answer: There are seven
days in a week. Question: What colour is the sky? Answer: The sky is blue.

She opened the window and looked at the garden. The flowers were red, yellow
and white, and a small bird was singing in the tree next to the wall. "What a
lovely day," she said to herself, and she went down the stairs to make some
breakfast: bread, butter, an egg and a glass of orange juice.

Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 1 + 1 = 2,
2 * 3 = 6, 10 - 4 = 6, 100 / 4 = 25. The year has twelve months and the day
has twenty-four hours; an hour has sixty minutes.
"""


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """Train the BPE and return its `tokenizer.json` text (cached in-process only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB - len(SPECIAL_TOKENS) - len(THINK_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok.to_str()


def token_ids() -> dict:
    """Vocabulary size and the ids of the special / added tokens."""
    data = json.loads(tokenizer_json())
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    size = max(max(data["model"]["vocab"].values()), max(ids.values())) + 1
    return {"size": size, **ids}


def _byte_decoder() -> dict:
    """The GPT-2 byte-level map from vocab characters back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@functools.lru_cache(maxsize=1)
def unprintable_ids() -> tuple:
    """Ids of vocab tokens that are not printable text on their own.

    These are the single bytes of a multi-byte UTF-8 character and control
    characters. A random model that emitted them would produce replacement
    characters and terminal junk, so the factory keeps the model from choosing
    them (real text still encodes and decodes through them).
    """
    decoder = _byte_decoder()
    bad = []
    for token, i in json.loads(tokenizer_json())["model"]["vocab"].items():
        try:
            text = bytes(decoder[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:
            bad.append(i)
            continue
        if any(not (ch.isprintable() or ch in "\n") for ch in text):
            bad.append(i)
    return tuple(sorted(bad))


def tokenizer_config(tool_template: bool = False) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": TOOL_CHAT_TEMPLATE if tool_template else CHAT_TEMPLATE,
    }


def write_tokenizer(path: Path, tool_template: bool = False) -> None:
    """Write tokenizer.json and tokenizer_config.json into `path`."""
    path = Path(path)
    (path / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    with open(path / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(tool_template), f, indent=2, ensure_ascii=False)
