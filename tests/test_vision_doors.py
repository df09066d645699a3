"""One image through every door of a tiny MoE vision-language model (issue #37, end to
end): `llm -a` (in-process and through a running server), `llm -c` after it, and the
server's OpenAI chat, Responses, Anthropic and Ollama APIs through their own SDKs, all
greedy: the same reply as the reply core's for the same image and words. What cannot
be taken is one line at each door, nothing is logged, and the server goes on.

One checkpoint (qwen3_vl_moe, fixtures/vision.py) and one server serve the module.
"""

from __future__ import annotations

import base64
import io
import sqlite3

import pytest

from fixtures.vision import build_vision_checkpoint
from plugin_support import LlmEnv, assert_ok, assert_one_line_error, serving
from server_support import call

PROMPT = "Describe the picture"
TOKENS = 6
IMAGE_END = 11  # the prompt's tokens up to its image's last placeholder (a 32x32 picture: 4)


def picture(fmt="PNG", seed=7) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


PNG = picture()
CORRUPT = b"\x89PNG\r\n\x1a\n" + b"garbage" * 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The VLM added with `llm mlxs add` as 'seer' (the default model), and a server."""
    root = tmp_path_factory.mktemp("doors")
    checkpoint = build_vision_checkpoint(root / "seer", "qwen3_vl_moe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(root / "llm"))
        env = LlmEnv(root / "llm", checkpoint)
        assert_ok(env.run("mlxs", "add", str(checkpoint), "--name", "seer"))
        assert_ok(env.run("mlxs", "default", "seer"))
        assert_ok(env.run("mlxs", "config", "max_tokens", str(TOKENS)))
        env.png = root / "img.png"
        env.png.write_bytes(PNG)
        with serving(env, max_queue=8):
            yield env


def core_reply(pictures: list[bytes], words: str) -> str:
    """The reply core's greedy reply for the pictures and words, with no door in between."""
    import llm
    from llm.parts import AttachmentPart, Message, TextPart

    from llm_mlx_streaming.options.settings import Options
    from llm_mlx_streaming.reply.build import Ask
    from llm_mlx_streaming.reply.core import reply
    from llm_mlx_streaming.reply.events import Chunk

    message = Message(role="user", parts=[*(AttachmentPart(attachment=llm.Attachment(content=p)) for p in pictures),
                                          TextPart(text=words)])
    events = reply(Ask("seer", [message], Options(max_tokens=TOKENS, temperature=0)))
    text = "".join(e.text for e in events if isinstance(e, Chunk) and e.kind == "text")
    assert text
    return text


@pytest.fixture(scope="module")
def expected(served) -> str:
    return core_reply([PNG], PROMPT)


def logged(env) -> list[tuple]:
    """(reply text, its prompt's attachment type, path) of each turn in llm's log: llm 0.36
    keeps a turn's messages as parts, an attachment part linked to `attachments` by
    `part_attachments` (its older `prompt_attachments` stays empty)."""
    conn = sqlite3.connect(env.user_dir / "logs.db")
    try:
        return conn.execute(
            "select reply.text, a.type, a.path from turns t"
            " join messages tip on tip.hash = t.tip_message_hash"
            " join parts reply on reply.message_hash = tip.hash and reply.type = 'text'"
            " left join parts asked on asked.message_hash = tip.parent_hash and asked.type = 'attachment'"
            " left join part_attachments pa on pa.part_id = asked.id"
            " left join attachments a on a.id = pa.attachment_id order by t.datetime_utc, t.id").fetchall()
    except sqlite3.OperationalError:  # no log yet
        return []
    finally:
        conn.close()


# -- llm -a ------------------------------------------------------------------------------

@pytest.mark.parametrize("server", ["off", "auto"])
def test_llm_a_answers_as_the_core_and_logs_the_attachment(served, expected, server):
    before = len(logged(served))
    result = assert_ok(served.run("-m", "mlx-stream/seer", "-a", str(served.png), PROMPT,
                                  "-o", "temperature", "0", "-o", "server", server))
    assert result.stdout.strip() == expected.strip()
    (row,) = logged(served)[before:]
    assert row == (expected, "image/png", str(served.png.resolve()))
    stats = served.turns()[-1]["stats"]
    assert ("served_by" in stats) == (server == "auto")


def test_two_images_one_given_by_at_with_its_type_answer_as_the_core(served):
    """`-a` and `--at FILE TYPE` together (a file whose name says nothing of its type)."""
    second = served.png.parent / "second.bin"
    second.write_bytes(picture(seed=8))
    words = "Compare the pictures"
    result = assert_ok(served.run("-m", "mlx-stream/seer", "-a", str(served.png), "--at", str(second), "image/png",
                                  words, "-o", "temperature", "0", "-o", "server", "off"))
    assert result.stdout.strip() == core_reply([PNG, picture(seed=8)], words).strip()


def test_a_continued_conversation_keeps_the_image(served):
    """`llm -c` after `llm -a`, in-process and through the server: the same reply, to a
    prompt that still holds the image (more than the words alone)."""
    words = assert_ok(served.run("-m", "mlx-stream/seer", "And its colours?", "-o", "server", "off"))
    alone = served.turns()[-1]["stats"]["prompt_tokens"]
    # mlx-vlm's caches cannot be saved for mlx-lm to load: off by name, not a warning each time
    assert served.turns()[-1]["stats"]["disk_cache_off"] == "a vision-language model"
    replies = {}
    for server in ("off", "auto"):
        assert_ok(served.run("-m", "mlx-stream/seer", "-a", str(served.png), PROMPT, "-o", "server", server))
        replies[server] = assert_ok(served.run("-c", "And its colours?", "-o", "server", server)).stdout
        assert served.turns()[-1]["stats"]["prompt_tokens"] > alone + IMAGE_END
    assert replies["off"] == replies["auto"] != words.stdout


def test_llm_chat_goes_on_from_a_prompt_with_an_image(served):
    """`llm chat` takes no -a: it continues (-c) a conversation whose first turn had one."""
    assert_ok(served.run("-m", "mlx-stream/seer", "-a", str(served.png), PROMPT, "-o", "server", "off"))
    result = assert_ok(served.run("chat", "-c", "-o", "server", "off", input="And its colours?\nquit\n"))
    first, second = served.turns()[-2:]
    assert second["stats"]["prompt_tokens"] > first["stats"]["prompt_tokens"]  # the image is still there
    # the image's KV is reused (not all of the first turn: thinking off, mlx-vlm's default, its prompt
    # opened an empty think block the template leaves out of the history)
    assert second["stats"]["reused_tokens"] > IMAGE_END
    assert "Traceback" not in result.output


# -- the server's APIs, each through its own SDK -------------------------------------------

def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_every_api_gives_the_same_reply_as_llm_a(served, expected):
    import anthropic
    import ollama
    import openai

    url = served.server.url
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    b64 = base64.b64encode(PNG).decode()
    replies = {
        "chat": chat.chat.completions.create(model="seer", max_tokens=TOKENS, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                         {"type": "text", "text": PROMPT}]}]).choices[0].message.content,
        "responses": chat.responses.create(model="seer", max_output_tokens=TOKENS, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)},
                                         {"type": "input_text", "text": PROMPT}]}]).output_text,
        "anthropic": anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
        .messages.create(model="seer", max_tokens=TOKENS, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": PROMPT}]}]).content[0].text,
        "ollama": ollama.Client(host=url, timeout=120).chat(
            model="seer", options={"num_predict": TOKENS, "temperature": 0},
            messages=[{"role": "user", "content": PROMPT, "images": [PNG]}]).message.content,
    }
    assert replies == dict.fromkeys(replies, expected)


# -- what cannot be taken: one line, nothing logged, the server goes on ------------------

def image_body(api: str, url: str) -> tuple[str, dict]:
    """(path, body) of a greedy request with the image at `url` (a data URL, or http)."""
    if api == "openai":
        return "/v1/chat/completions", {"model": "seer", "max_tokens": TOKENS, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}]}
    if api == "responses":
        return "/v1/responses", {"model": "seer", "max_output_tokens": TOKENS, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}, {"type": "input_text", "text": PROMPT}]}]}
    if api == "anthropic":
        head, _, data = url.partition(",")
        source = ({"type": "base64", "media_type": head[5:].split(";")[0], "data": data} if url.startswith("data:")
                  else {"type": "url", "url": url})
        return "/v1/messages", {"model": "seer", "max_tokens": TOKENS, "messages": [{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": PROMPT}]}]}
    return "/api/chat", {"model": "seer", "stream": False, "options": {"num_predict": TOKENS}, "messages": [
        {"role": "user", "content": PROMPT, "images": [url.partition(",")[2]]}]}


def error_line(api: str, reply: dict) -> str:
    """The one line of an error in the API's own shape."""
    if api == "anthropic":
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
        message = reply["error"]["message"]
    elif api == "ollama":
        assert set(reply) == {"error"}, reply
        message = reply["error"]
    else:
        assert set(reply) == {"error"} and reply["error"]["type"] == "invalid_request_error", reply
        message = reply["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return message


def other_picture(fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 200, 10)).save(out, fmt)
    return out.getvalue()


SMALL_LIMIT = 1000  # max_image_bytes for the too-large case: PNG is larger
BAD = {
    "corrupt": (data_url(CORRUPT), "image 1 (image/png) cannot be decoded"),
    "bmp": (data_url(other_picture("BMP"), "image/bmp"), "image/bmp images are not supported"),
    "tiff": (data_url(other_picture("TIFF"), "image/tiff"), "image/tiff images are not supported"),
    "too-large": (data_url(PNG), f"larger than max_image_bytes ({SMALL_LIMIT})"),
    "url-off": ("http://127.0.0.1:9/red.png", "image_urls setting is off"),
}
UNTYPED = {"bmp": "are not a PNG, JPEG, WebP or GIF image", "tiff": "are not a PNG, JPEG, WebP or GIF image"}


@pytest.fixture
def low_limit(served):
    assert_ok(served.run("mlxs", "config", "max_image_bytes", f"{SMALL_LIMIT}B"))
    yield
    assert_ok(served.run("mlxs", "config", "--unset", "max_image_bytes"))


@pytest.mark.parametrize("api", ["openai", "responses", "anthropic", "ollama"])
@pytest.mark.parametrize("case", BAD)
def test_an_image_that_cannot_be_taken_is_one_line_and_the_server_goes_on(served, request, api, case):
    url, needle = BAD[case]
    if api == "ollama":
        if case == "url-off":
            pytest.skip("Ollama's images are base64 alone")
        needle = UNTYPED.get(case, needle)  # Ollama's images carry no type: their bytes are read
    if case == "too-large":
        request.getfixturevalue("low_limit")
    before = call(served, "GET", "/api/stats")[2]["server"]["served"], len(served.turns())
    status, _, reply = call(served, "POST", *image_body(api, url))
    assert status == 400 and needle in error_line(api, reply)
    assert (call(served, "GET", "/api/stats")[2]["server"]["served"], len(served.turns())) == before
    status, _, reply = call(served, "POST", *image_body(api, data_url(other_picture("PNG"))))  # under SMALL_LIMIT
    assert status == 200, reply


@pytest.mark.parametrize("server", ["off", "auto"])
def test_llm_a_with_a_corrupt_image_is_one_line_and_no_turn(served, tmp_path, server):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(CORRUPT)
    before = len(served.turns())
    assert_one_line_error(served.run("-m", "mlx-stream/seer", "-a", str(corrupt), PROMPT, "-o", "server", server),
                          "cannot be decoded")
    assert len(served.turns()) == before


def test_the_body_cap_leaves_room_for_an_image_of_max_image_bytes(served, low_limit):
    """A 9 MiB image, base64'd in a request, passes the body cap: max_image_bytes is what
    bounds it, and the cap grows with a larger setting."""
    from llm_mlx_streaming.server.errors import REQUEST_ROOM, max_body_bytes

    big = CORRUPT + bytes(9 * 2**20)  # a PNG by its header
    status, _, reply = call(served, "POST", *image_body("openai", data_url(big)))
    assert status == 400 and f"larger than max_image_bytes ({SMALL_LIMIT})" in error_line("openai", reply)
    assert_ok(served.run("mlxs", "config", "max_image_bytes", "30MiB"))
    assert max_body_bytes() == REQUEST_ROOM + 40 * 2**20
    status, _, reply = call(served, "POST", *image_body("openai", data_url(big)))
    assert status == 400 and "image 1 (image/png) cannot be decoded" in error_line("openai", reply)
