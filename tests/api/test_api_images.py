"""Images in, on every route that takes them, over the tiny Idefics3 (tests/helpers/tiny_vision.py):
OpenAI chat `image_url` parts, TGI's markdown images, Anthropic `image` blocks and Responses
`input_image`; the intake's refusals (api/images.py) in each dialect's error shape. (A text-only
model's refusal: test_openai_chat_template.py, test_anthropic_app.py.)"""

from __future__ import annotations

import base64

import pytest
import torch

from opentgi.api.images import ImageLimits, load_image, refused_address
from opentgi.engine.errors import ValidationError
from tests.helpers.tiny_vision import (
    png_bytes,
    tiny_gemma3_vl_path,
    tiny_idefics3_path,
    tiny_llava_next_path,
    tiny_qwen2_5_vl_path,
)

torch.set_num_threads(1)


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


IMAGE = data_url(png_bytes(90, 40, seed=1))
OTHER = data_url(png_bytes(30, 30, seed=2))


@pytest.fixture(scope="module")
def vlm_client():
    from opentgi.api.app import create_app
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    settings = Settings(model_id=str(tiny_idefics3_path()), device="cpu", max_input_tokens=200,
                        max_total_tokens=256, max_batch_total_tokens=2048, max_images=3)
    with create_app(settings, Engine.from_settings(settings)).test_client() as client:
        yield client


def chat(client, content, **extra):
    body = {"model": "tgi", "messages": [{"role": "user", "content": content}], "max_tokens": 3,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_openai_chat_takes_several_images_per_message_and_per_request(vlm_client):
    one = chat(vlm_client, [{"type": "image_url", "image_url": {"url": IMAGE}}, {"type": "text", "text": "What?"}])
    assert one.status_code == 200, one.text
    body = {"model": "tgi", "max_tokens": 3, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                     {"type": "image_url", "image_url": {"url": OTHER}},
                                     {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": IMAGE}}]}]}
    many = vlm_client.post("/v1/chat/completions", json=body)
    assert many.status_code == 200, many.text
    # the images' tokens are prompt tokens: 3 tiles of 4 for IMAGE, 5 of 4 for OTHER, and more
    assert many.json()["usage"]["prompt_tokens"] > one.json()["usage"]["prompt_tokens"] + 2 * 12


def test_too_many_images_is_a_422_that_says_image(vlm_client):
    response = chat(vlm_client, [{"type": "image_url", "image_url": {"url": IMAGE}}] * 4)
    assert response.status_code == 422
    assert "image" in response.json()["error"]


@pytest.mark.parametrize("url, reason", [
    (data_url(b"not an image at all"), "not an image"),
    ("ftp://example.com/a.png", "unsupported URL scheme"),
    ("http://127.0.0.1:1/a.png", "loopback, private"),
    ("http://169.254.169.254/latest/meta-data", "loopback, private"),
    ("data:image/png;base64,@@@", "not valid base64"),
])
def test_bad_images_are_422_naming_the_image(vlm_client, url, reason):
    response = chat(vlm_client, [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}])
    assert response.status_code == 422, response.text
    assert "image 0" in response.json()["error"] and reason in response.json()["error"]


def test_a_decompression_bomb_is_refused_from_its_header():
    import io
    import zlib

    # a PNG declaring 20,000 x 20,000 (1.2 GB of pixels) in a few hundred bytes: refused unread
    from PIL import Image

    small = io.BytesIO()
    Image.new("L", (1, 1)).save(small, format="PNG")
    raw = bytearray(small.getvalue())
    ihdr = raw.index(b"IHDR")
    raw[ihdr + 4:ihdr + 12] = (20000).to_bytes(4, "big") * 2
    raw[ihdr + 17:ihdr + 21] = zlib.crc32(bytes(raw[ihdr:ihdr + 17])).to_bytes(4, "big")
    with pytest.raises(ValidationError, match=r"image 2: .*more .*than 40000000 \(--max-image-pixels\)"):
        load_image(2, data_url(bytes(raw)), ImageLimits())
    raw[ihdr + 4:ihdr + 12] = (8000).to_bytes(4, "big") * 2  # 64 M: past our limit, not Pillow's
    raw[ihdr + 17:ihdr + 21] = zlib.crc32(bytes(raw[ihdr:ihdr + 17])).to_bytes(4, "big")
    with pytest.raises(ValidationError, match="8000 x 8000 pixels, more than 40000000"):
        load_image(0, data_url(bytes(raw)), ImageLimits())


def test_size_limit_and_address_checks():
    with pytest.raises(ValidationError, match="larger than 100 bytes"):
        load_image(0, IMAGE, ImageLimits(max_bytes=100))
    assert all(refused_address(a) for a in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1",
                                            "fd00::1", "::ffff:127.0.0.1", "100.64.0.1", "0.0.0.0"))
    assert not refused_address("93.184.216.34")


def test_tgi_generate_takes_markdown_images(vlm_client):
    inputs = f"User:![]({IMAGE})What is this?<end_of_utterance>\nAssistant:"
    response = vlm_client.post("/generate", json={"inputs": inputs, "parameters": {"max_new_tokens": 3,
                                                                                    "details": True}})
    assert response.status_code == 200, response.text
    plain = vlm_client.post("/generate", json={"inputs": "User:What is this?<end_of_utterance>\nAssistant:",
                                               "parameters": {"max_new_tokens": 3, "details": True}})
    assert plain.status_code == 200
    bad = vlm_client.post("/generate", json={"inputs": "![](data:image/png;base64,AAAA)hi",
                                             "parameters": {"max_new_tokens": 3}})
    assert bad.status_code == 422 and "image 0" in bad.json()["error"]


def test_anthropic_image_blocks(vlm_client):
    b64 = IMAGE.split(",", 1)[1]
    body = {"model": "tgi", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "What is this?"}]}]}
    response = vlm_client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    body["messages"][0]["content"][0]["source"] = {"type": "url", "url": "http://10.0.0.1/a.png"}
    refused = vlm_client.post("/v1/messages", json=body)
    assert refused.status_code in (400, 422) and "image 0" in refused.text


def test_responses_input_image(vlm_client):
    body = {"model": "tgi", "max_output_tokens": 3, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": IMAGE}, {"type": "input_text", "text": "What is this?"}]}]}
    response = vlm_client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    content = body["input"][0]["content"]
    content[0] = {"type": "input_image"}
    assert vlm_client.post("/v1/responses", json=body).status_code == 400  # no image_url
    content[0] = {"type": "input_file"}
    refused = vlm_client.post("/v1/responses", json=body)
    assert refused.status_code == 400 and "input.0.content.0: `input_file`" in refused.text


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /png (a PNG sent as text/html), /text (text sent as image/png), /slow
    (answers after 3 s), /loop (redirects to itself), /big (a 2 MB body)."""
    import http.server
    import threading
    import time

    png = png_bytes(20, 20, seed=3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == "/loop":
                self.send_response(302)
                self.send_header("Location", "/loop")
                self.end_headers()
                return
            if self.path == "/slow":
                time.sleep(3)
            body, kind = {"/png": (png, "text/html"), "/text": (b"hello", "image/png"),
                          "/big": (b"\0" * 2_000_000, "image/png")}.get(self.path, (png, "image/png"))
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that gave up (/slow, /big) closed its socket: expected here

    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()


def test_http_fetch_sniffs_bytes_caps_redirects_size_and_time(image_host):
    import hashlib
    import time

    base, png = image_host
    limits = ImageLimits(allow_private=True, timeout_s=1.0, max_bytes=1_000_000)
    fetched = load_image(0, f"{base}/png", limits)  # a PNG served as text/html: the bytes decide
    assert fetched.sha256 == hashlib.sha256(png).hexdigest() and fetched.image.size == (20, 20)
    with pytest.raises(ValidationError, match="image 1: the bytes are not an image"):
        load_image(1, f"{base}/text", limits)
    with pytest.raises(ValidationError, match="more than 3 redirects"):
        load_image(0, f"{base}/loop", limits)
    with pytest.raises(ValidationError, match="larger than 1000000 bytes"):
        load_image(0, f"{base}/big", limits)
    started = time.monotonic()
    with pytest.raises(ValidationError, match="longer than 1 s"):
        load_image(0, f"{base}/slow", limits)
    assert time.monotonic() - started < 2.5
    with pytest.raises(ValidationError, match="loopback, private"):  # the same host, without the flag
        load_image(0, f"{base}/png", ImageLimits())


def test_a_stuck_fetch_gives_the_request_its_answer(monkeypatch):
    import asyncio
    import time

    from opentgi.api import images

    monkeypatch.setattr(images, "GIVE_UP_MARGIN_S", 0.0)
    monkeypatch.setattr(images, "load_image", lambda index, url, limits: time.sleep(1.5))
    started = time.monotonic()
    with pytest.raises(ValidationError, match="image 0: reading the image took longer than 0.2 s"):
        asyncio.run(images.load_images(["http://example.com/a.png"], ImageLimits(timeout_s=0.1)))
    assert time.monotonic() - started < 1.0



@pytest.fixture(scope="module", params=["qwen2_5_vl", "gemma3", "llava_next"])
def family_client(request):
    from opentgi.api.app import create_app
    from opentgi.config import Settings
    from opentgi.engine.engine import Engine

    path = {"qwen2_5_vl": tiny_qwen2_5_vl_path, "gemma3": tiny_gemma3_vl_path,
            "llava_next": tiny_llava_next_path}[request.param]()
    settings = Settings(model_id=str(path), device="cpu", max_input_tokens=200, max_total_tokens=256,
                        max_batch_total_tokens=2048)
    with create_app(settings, Engine.from_settings(settings)).test_client() as client:
        yield request.param, client


def test_qwen2_5_vl_gemma3_and_llava_next_take_chat_and_markdown_images(family_client):
    """Qwen2.5-VL, Gemma 3 and LLaVA-NeXT (tests/helpers/tiny_vision.py): the chat template's image
    becomes the image's tokens (Qwen2.5-VL, 90 x 40 pixels: 56 x 84 after smart_resize, 24 patches,
    6 merged, and the vision start and end tokens; Gemma 3: 4 soft tokens between its start and
    end tokens; LLaVA-NeXT: 16 for the base image, 4 rows of 8 unpadded features and a newline
    each), and the image's pixels reach the model (another image, other logprobs)."""
    family, client = family_client

    def ask(url=None):
        parts = [{"type": "image_url", "image_url": {"url": url}}] if url else []
        response = chat(client, [*parts, {"type": "text", "text": "What?"}], logprobs=True)
        assert response.status_code == 200, response.text
        body = response.json()
        return body["usage"]["prompt_tokens"], [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]

    (plain, _), (one, first), (same, again) = ask(), ask(IMAGE), ask(IMAGE)  # the second one cached
    other = ask(data_url(png_bytes(90, 40, seed=9)))
    assert one == plain + 8 if family == "qwen2_5_vl" else one >= plain + (16 + 4 * 9 if family == "llava_next" else 6)
    assert same == one and other[0] == one
    assert first == again and other[1] != first
    marker = {"qwen2_5_vl": "<|im_start|>user\n", "gemma3": "<start_of_turn>user\n", "llava_next": "[INST] "}[family]

    def prefill(inputs: str) -> int:
        response = client.post("/generate", json={"inputs": inputs, "parameters": {
            "max_new_tokens": 3, "decoder_input_details": True}})
        assert response.status_code == 200, response.text
        return len(response.json()["details"]["prefill"])

    assert prefill(f"{marker}![]({IMAGE})What?") >= prefill(f"{marker}What?") + 6  # the image's tokens
