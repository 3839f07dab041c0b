"""The chat page at GET / on the real app: served to browsers (Accept: text/html) beside TGI's POST /,
TGI's 405 for other clients, open without the API key, off with --disable-ui, and self-contained
(nothing loaded from another origin)."""

from __future__ import annotations

import re

import httpx
import pytest

from opentgi.api.app import create_app
from opentgi.config import Settings
from tests.helpers.fake_engine import FakeEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # Chrome's
METHOD_NOT_ALLOWED = {"error": "Method Not Allowed", "error_type": "method_not_allowed"}


def client(**settings) -> httpx.AsyncClient:
    app = create_app(Settings(**settings), FakeEngine())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=BROWSER)


@pytest.mark.parametrize("api", ["tgi", "lightllm"])
async def test_get_root_is_the_chat_page_and_post_root_is_tgi(api):
    async with client(api=api) as http:
        page = await http.get("/")
        head = await http.head("/")
        api_client = await http.get("/", headers={"Accept": "*/*"})  # curl's, and API clients'
        post = await http.post("/", json={})  # TGI's POST /: still validated by its document
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "/v1/chat/completions" in page.text and 'name="viewport"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert head.status_code == 200 and head.content == b""
    assert api_client.status_code == 405 and api_client.json() == METHOD_NOT_ALLOWED
    assert post.status_code == 422 and "missing field `inputs`" in post.json()["error"]


async def test_page_loads_nothing_from_elsewhere():
    async with client() as http:
        text = (await http.get("/")).text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert not re.search(r"""(fetch|import)\(\s*["'`]https?:""", text)


async def test_page_is_open_with_an_api_key_but_the_api_is_not():
    async with client(api_key="k") as http:
        page = await http.get("/")
        chat = await http.post("/v1/chat/completions", json={"messages": []})
    assert page.status_code == 200
    assert chat.status_code == 401


async def test_disable_ui_gives_tgi_405_back():
    async with client(disable_ui=True) as http:
        response = await http.get("/")
    assert response.status_code == 405
    assert response.json() == METHOD_NOT_ALLOWED


async def test_page_attaches_an_image_as_an_image_url_part():
    async with client() as http:
        text = (await http.get("/")).text
    assert re.search(r'<input id="image" type="file" accept="image/\*"', text)
    assert 'type: "image_url", image_url: { url: image }' in text and "readAsDataURL" in text
