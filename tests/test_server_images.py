"""Images in every API of `llm mlxs serve` (issue #37, the surface half): each API's image
form becomes the same llm AttachmentPart; what cannot be taken (an image on a text-only
model, data that is no image, one too large, a URL while image_urls is off, a fetch that
fails) is a 400 with one line in that API's own error shape, and the server goes on.

The server serves the tiny text-only checkpoint as 'small' and a copy of it whose config
has a vision_config as 'seer': a seer request's images are read and checked before
anything is loaded, so every refusal here runs without a vision engine.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import threading

import pytest

from plugin_support import LlmEnv, serving
from server_support import call

MAX_IMAGE = 4096  # max_image_bytes here
IMAGE_TYPES = {"image/png", "image/jpeg", "image/webp", "image/gif"}


def picture(fmt="PNG", size=(8, 8)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, fmt)
    return out.getvalue()


def noise_png() -> bytes:
    """A PNG larger than MAX_IMAGE (noise does not compress)."""
    import os

    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)).save(out, "PNG")
    assert len(out.getvalue()) > MAX_IMAGE
    return out.getvalue()


def data_url(data: bytes, media_type="image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = picture()


def write_settings(env, **more) -> None:
    env.write_settings(default_model="small", max_context=96, max_image_bytes=MAX_IMAGE, **more, models={
        "small": {"path": str(env.checkpoint), "expert_slots": 4},
        "seer": {"path": str(env.seer), "expert_slots": 4}})


@pytest.fixture(scope="module")
def served(tmp_path_factory, plugin_checkpoint):
    root = tmp_path_factory.mktemp("images")
    seer = root / "seer"
    seer.mkdir()
    for file in plugin_checkpoint.iterdir():
        if file.name != "config.json":
            (seer / file.name).symlink_to(file)
    config = json.loads((plugin_checkpoint / "config.json").read_text())
    (seer / "config.json").write_text(json.dumps({**config, "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_USER_PATH", str(root / "llm"))
        env = LlmEnv(root / "llm", plugin_checkpoint)
        env.seer = seer
        write_settings(env)
        with serving(env, max_queue=8):
            yield env


# -- each API's image form, and its error shape ---------------------------------------

def openai_body(model, url, detail=None):
    image = {"url": url, **({"detail": detail} if detail else {})}
    return "/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": image}]}]}


def responses_body(model, url, detail=None):
    image = {"type": "input_image", "image_url": url, **({"detail": detail} if detail else {})}
    return "/v1/responses", {"model": model, "max_output_tokens": 2, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is it"}, image]}]}


def anthropic_body(model, url, detail=None):
    if url.startswith("data:"):
        head, data = url.split(",", 1)
        source = {"type": "base64", "media_type": head[5:].split(";")[0], "data": data}
    else:
        source = {"type": "url", "url": url}
    return "/v1/messages", {"model": model, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "what is it"}]}]}


def ollama_body(model, url, detail=None):
    return "/api/chat", {"model": model, "stream": False, "messages": [
        {"role": "user", "content": "what is it", "images": [url.split(",", 1)[1]]}]}


def ollama_generate_body(model, url, detail=None):
    return "/api/generate", {"model": model, "stream": False, "prompt": "what is it", "images": [url.split(",", 1)[1]]}


def openai_error(reply) -> str:
    assert set(reply) == {"error"} and reply["error"]["type"] == "invalid_request_error", reply
    return reply["error"]["message"]


def anthropic_error(reply) -> str:
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
    return reply["error"]["message"]


def ollama_error(reply) -> str:
    assert set(reply) == {"error"} and isinstance(reply["error"], str), reply
    return reply["error"]


APIS = {"openai": (openai_body, openai_error), "responses": (responses_body, openai_error),
        "anthropic": (anthropic_body, anthropic_error), "ollama": (ollama_body, ollama_error),
        "ollama-generate": (ollama_generate_body, ollama_error)}
BASE64_ONLY = ("ollama", "ollama-generate")  # no media type, no URL


def refusal(served, api, model, url) -> str:
    body, error = APIS[api]
    status, _, reply = call(served, "POST", *body(model, url))
    assert status == 400, reply
    message = error(reply)
    assert "\n" not in message
    return message


def served_count(served) -> int:
    return call(served, "GET", "/api/stats")[2]["server"]["served"]


@pytest.mark.parametrize("api", APIS)
def test_an_image_on_a_text_only_model_is_refused_in_the_apis_shape(served, api):
    before = served_count(served)
    assert refusal(served, api, "small", data_url(PNG)) == "mlx-stream/small takes no images: it is a text-only model"
    assert served_count(served) == before  # nothing was answered


CASES = [
    ("data:image/png;base64,@@not base64@@", "not base64"),
    (data_url(b"just text", "text/plain"), "'text/plain', not an image type"),
    (data_url(b"<svg/>", "image/svg+xml"), "image/svg+xml images are not supported"),
    (data_url(b"not an image at all"), "are not a PNG, JPEG, WebP or GIF image"),
    (data_url(noise_png()), f"larger than max_image_bytes ({MAX_IMAGE})"),
    ("http://127.0.0.1:9/red.png", "image_urls setting is off"),
]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("url,needle", CASES, ids=["base64", "text-type", "svg", "no-image", "too-large", "url-off"])
def test_an_image_that_cannot_be_taken_is_one_line_in_the_apis_shape(served, api, url, needle):
    if api in BASE64_ONLY and not url.startswith("data:image/png;base64,"):
        pytest.skip("Ollama's images are base64 without a type")
    assert needle in refusal(served, api, "seer", url)


def test_a_data_url_that_is_not_base64_is_refused(served):
    path, body = openai_body("seer", "data:image/png,rawbytes")
    status, _, reply = call(served, "POST", path, body)
    assert status == 400 and "not base64" in openai_error(reply)


@pytest.mark.parametrize("body,needle", [
    (responses_body("seer", "x")[1] | {"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file_1"}]}]}, "input.0.content.0.file_id: no file is kept"),
    (responses_body("seer", "x")[1] | {"input": [{"role": "assistant", "content": [
        {"type": "input_image", "image_url": data_url(PNG)}]}]}, "taken only in a user message"),
])
def test_the_responses_api_refuses_file_ids_and_assistant_images(served, body, needle):
    status, _, reply = call(served, "POST", "/v1/responses", body)
    assert status == 400 and needle in openai_error(reply)


def test_anthropic_file_sources_and_tool_result_images_are_one_line(served):
    file_source = {"model": "seer", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}]}
    status, _, reply = call(served, "POST", "/v1/messages", file_source)
    assert status == 400 and "messages.0.content.0: a file source" in anthropic_error(reply)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(PNG).decode()}}
    in_result = {"model": "seer", "max_tokens": 2, "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]}]}
    status, _, reply = call(served, "POST", "/v1/messages", in_result)
    assert status == 400 and "an image in a tool result is not taken" in anthropic_error(reply)


def test_an_image_outside_a_user_message_is_refused(served):
    body = {"model": "seer", "messages": [{"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": data_url(PNG)}}]}, {"role": "user", "content": "hi"}]}
    status, _, reply = call(served, "POST", "/v1/chat/completions", body)
    assert status == 400 and "an image comes in a user message" in openai_error(reply)
    status, _, reply = call(served, "POST", "/api/chat", {"model": "seer", "stream": False, "messages": [
        {"role": "assistant", "content": "x", "images": [base64.b64encode(PNG).decode()]}]})
    assert status == 400 and "images: only in a user message" in ollama_error(reply)


def test_detail_is_accepted_and_named_as_ignored(served):
    status, headers, _ = call(served, "POST", *openai_body("small", data_url(PNG), detail="high"))
    assert status == 400 and "messages.content.image_url.detail" in headers["x-mlx-stream-ignored"]
    status, headers, _ = call(served, "POST", *responses_body("small", data_url(PNG), detail="low"))
    assert status == 400 and "input.content.detail" in headers["x-mlx-stream-ignored"]


def test_the_sdks_get_the_refusal_and_the_server_keeps_answering(served):
    import anthropic
    import ollama
    import openai

    url = served.server.url
    chat = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    expected = "mlx-stream/small takes no images: it is a text-only model"
    with pytest.raises(openai.BadRequestError, match=expected):
        chat.chat.completions.create(model="small", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what"}, {"type": "image_url", "image_url": {"url": data_url(PNG), "detail": "auto"}}]}])
    with pytest.raises(openai.BadRequestError, match=expected):
        chat.responses.create(model="small", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what"}, {"type": "input_image", "image_url": data_url(PNG), "detail": "auto"}]}])
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match=expected):
        claude.messages.create(model="small", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}},
            {"type": "text", "text": "what"}]}])
    llama = ollama.Client(host=url, timeout=60)
    with pytest.raises(ollama.ResponseError, match=expected):
        llama.chat(model="small", messages=[{"role": "user", "content": "what", "images": [PNG]}])
    with pytest.raises(ollama.ResponseError, match=expected):
        llama.generate(model="small", prompt="what", images=[PNG])

    reply = chat.chat.completions.create(model="small", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content is not None
    assert llama.chat(model="small", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}).message


# -- image URLs, with image_urls on -------------------------------------------------------

@pytest.fixture
def pictures():
    """A local web server: /red.png, /big.png (over MAX_IMAGE), anything else a 404."""
    files = {"/red.png": PNG, "/big.png": noise_png()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = files.get(self.path)
            self.send_response(200 if data else 404)
            self.send_header("Content-Type", "image/png" if data else "text/plain")
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def urls_on(served):
    write_settings(served, image_urls="on")
    yield served
    write_settings(served)


@pytest.mark.parametrize("api", ["openai", "responses", "anthropic"])
def test_with_image_urls_on_a_fetch_is_bounded_and_its_failure_one_line(urls_on, pictures, api):
    assert "could not be fetched: HTTP Error 404" in refusal(urls_on, api, "seer", pictures + "/gone.png")
    assert f"more than max_image_bytes ({MAX_IMAGE})" in refusal(urls_on, api, "seer", pictures + "/big.png")
    assert "takes no images" in refusal(urls_on, api, "small", pictures + "/red.png")


def test_a_fetched_image_is_read_as_its_bytes(served, pictures):
    from llm_mlx_streaming.server.images import read_images
    from llm_mlx_streaming.server.openai.schemas import ChatCompletionRequest

    write_settings(served, image_urls="on")
    try:
        body = ChatCompletionRequest.model_validate(openai_body("seer", pictures + "/red.png")[1])
        chat = [message.message() for message in body.messages]
        asyncio.run(read_images(Seeing(), "mlx-stream/seer", chat))
    finally:
        write_settings(served)
    (image,) = [part.image() for part in chat[0].images()]
    assert image.data == PNG and image.media_type == "image/png"


# -- every API's form becomes the same llm AttachmentPart ---------------------------------

class Seeing:
    """A service whose every model takes images."""

    def takes_images(self, model_id):
        return True


def llm_chain(api: str, url: str) -> list:
    """llm's messages of `api`'s request with the image at `url`, as its route makes them."""
    from llm_mlx_streaming.prompt.messages import llm_messages
    from llm_mlx_streaming.server.anthropic.routes import chat_messages as anthropic_chat
    from llm_mlx_streaming.server.anthropic.schemas import MessagesRequest
    from llm_mlx_streaming.server.conversation import ChatMessage
    from llm_mlx_streaming.server.images import read_images
    from llm_mlx_streaming.server.ollama.routes import chat_messages as ollama_chat, with_images
    from llm_mlx_streaming.server.ollama.schemas import ChatRequest, GenerateRequest
    from llm_mlx_streaming.server.openai.schemas import ChatCompletionRequest
    from llm_mlx_streaming.server.responses.routes import chat_messages as responses_chat
    from llm_mlx_streaming.server.responses.schemas import ResponseRequest

    body = APIS[api][0]("seer", url)[1]
    chat = {
        "openai": lambda: [m.message() for m in ChatCompletionRequest.model_validate(body).messages],
        "responses": lambda: responses_chat(ResponseRequest.model_validate(body)),
        "anthropic": lambda: anthropic_chat(MessagesRequest.model_validate(body)),
        "ollama": lambda: ollama_chat(ChatRequest.model_validate(body).messages),
        "ollama-generate": lambda: [ChatMessage("user", with_images(
            (g := GenerateRequest.model_validate(body)).prompt, g.images))],
    }[api]()
    asyncio.run(read_images(Seeing(), "mlx-stream/seer", chat))
    return llm_messages(chat)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                            ("GIF", "image/gif")])
def test_each_apis_image_becomes_the_same_attachment_part(served, api, fmt, media_type):
    from llm.parts import AttachmentPart, TextPart

    data = picture(fmt)
    (message,) = llm_chain(api, data_url(data, media_type))
    assert message.role == "user"
    (image,) = [p for p in message.parts if isinstance(p, AttachmentPart)]
    assert image.attachment.content == data and image.attachment.type == media_type
    assert image.attachment.resolve_type() == media_type and image.attachment.content_bytes() == data
    assert "".join(p.text for p in message.parts if isinstance(p, TextPart)) == "what is it"
    text_first = api in ("openai", "responses")
    assert [type(p) for p in message.parts] == ([TextPart, AttachmentPart] if text_first else [AttachmentPart, TextPart])


def test_a_mislabelled_image_takes_the_type_of_its_bytes(served):
    from llm.parts import AttachmentPart

    (message,) = llm_chain("openai", data_url(PNG, "image/jpeg"))
    (image,) = [p for p in message.parts if isinstance(p, AttachmentPart)]
    assert image.attachment.type == "image/png"


def test_text_alone_is_one_text_part_as_before(served):
    from llm.parts import TextPart

    from llm_mlx_streaming.prompt.messages import llm_messages
    from llm_mlx_streaming.server.openai.schemas import OpenAIMessage

    (message,) = llm_messages([OpenAIMessage(role="user", content=[{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]).message()])
    assert [type(p) for p in message.parts] == [TextPart] and message.parts[0].text == "ab"


# -- the client path: llm's attachments go to a running server as data URLs --------------

def test_attachments_are_sent_to_a_running_server_as_data_urls():
    from llm import Attachment
    from llm.parts import AttachmentPart, Message, TextPart

    from llm_mlx_streaming.prompt.messages import openai_messages

    chain = [Message(role="system", parts=[TextPart(text="be brief")]),
             Message(role="user", parts=[TextPart(text="what is it"),
                                         AttachmentPart(attachment=Attachment(type="image/png", content=PNG))])]
    system, user = openai_messages(chain)
    assert system == {"role": "system", "content": "be brief"}
    assert user["content"] == [{"type": "text", "text": "what is it"},
                               {"type": "image_url", "image_url": {"url": data_url(PNG)}}]


def test_an_attachment_by_path_is_read_and_typed(tmp_path):
    from llm import Attachment
    from llm.parts import AttachmentPart, Message

    from llm_mlx_streaming.prompt.messages import openai_messages

    path = tmp_path / "red.jpg"
    path.write_bytes(picture("JPEG"))
    (user,) = openai_messages([Message(role="user", parts=[AttachmentPart(attachment=Attachment(path=str(path)))])])
    assert user["content"] == [{"type": "image_url", "image_url": {"url": data_url(path.read_bytes(), "image/jpeg")}}]
