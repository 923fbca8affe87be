"""The launched app as an MCP server: its schema lists the four tools (and none of the page's own
endpoints) with descriptions, and a real MCP client (the ``mcp`` package, streamable HTTP) calls them
over ``/gradio_api/mcp`` and gets the library's figures."""
import asyncio
import json
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TOOLS = {"calibrate_logits", "calibration_test", "classify", "explain_temperature"}
#: The page's endpoints, public for gradio_client, that an agent is not offered.
PAGE = {"calibrate", "gamma_sweep", "init_study", "classify_drawing", "explore_temperature"}


@pytest.fixture(scope="module")
def shipped():
    """400 + 400 rows of the shipped test logits of the embedded model (uncalibrated), and its labels."""
    saved = load_file(str(REPO / "assets" / "precomputed" / "test_logits.safetensors"))
    z, y = saved["Uncalibrated"].double(), saved["labels"].long()
    return z[:400], y[:400], z[400:800], y[400:800]


def _upload(server: str, path) -> str:
    """The address of ``path`` once uploaded to the app, as Gradio's upload tool gives it."""
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{path.name}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + path.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(server + "gradio_api/upload", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return f"{server}gradio_api/file={json.loads(r.read())[0]}"


def _session(server: str, work):
    """``work(session)`` run in an MCP client session with the launched app; returns its result."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def run():
        async with streamablehttp_client(server + "gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await work(session)

    return asyncio.run(run())


def _answer(result) -> tuple[str, dict]:
    """(the Markdown, the figures of the fenced JSON block) of a tool's one text."""
    assert not result.isError, result.content
    assert len(result.content) == 1
    markdown, _, block = result.content[0].text.partition("\n\n```json\n")
    assert block.endswith("\n```")
    return markdown, json.loads(block[:-4])


def test_the_schema_lists_the_tools_with_descriptions_and_not_the_pages_endpoints(server):
    with urllib.request.urlopen(server + "gradio_api/mcp/schema", timeout=30) as r:
        schema = {tool["name"]: tool for tool in json.loads(r.read())}
    assert set(schema) == TOOLS
    assert not PAGE & set(schema)
    for name in ("calibrate_logits", "calibration_test"):
        assert "logits" in schema[name]["description"] and len(schema[name]["description"]) > 200
        properties = schema[name]["inputSchema"]["properties"]
        assert set(properties) == {"logits_file", "bins", "seed"}
        assert ".npz" in properties["logits_file"]["description"]
    assert schema["explain_temperature"]["inputSchema"]["properties"]["temperature"]["description"]


def test_an_mcp_client_lists_the_four_tools(server):
    async def listed(session):
        return await session.list_tools()

    tools = _session(server, listed).tools
    assert {t.name for t in tools} == TOOLS
    assert all(t.description for t in tools)


def test_calibration_test_gives_the_librarys_p_values_and_ece(server, shipped, tmp_path):
    from nctv import metrics
    from nctv.consistency import consistency_test

    zc, yc, zt, yt = shipped
    path = tmp_path / "model.npz"
    np.savez(path, logits=torch.cat([zc, zt]).numpy(), labels=torch.cat([yc, yt]).numpy())
    url = _upload(server, path)

    async def tested(session):
        return await session.call_tool("calibration_test", {"logits_file": url, "bins": 15, "seed": 0})

    text, figures = _answer(_session(server, tested))
    z, y = torch.cat([zc, zt]), torch.cat([yc, yt])
    expected = consistency_test(z, y, 15, seed=0)  # the run's resamples and seed
    assert figures["rows"] == 800 and figures["classes"] == 10
    assert figures["p_top_label"] == pytest.approx(expected.p_top_label, abs=1e-12)
    assert figures["p_classwise"] == pytest.approx(expected.p_classwise, abs=1e-12)
    assert figures["ece"] == pytest.approx(metrics.ece(z, y, 15), abs=1e-12)
    assert figures["classwise_ece"] == pytest.approx(metrics.sce(z, y, 15), abs=1e-12)
    assert figures["ece_low"] <= figures["ece"] <= figures["ece_high"]
    # The shipped model is over-confident: the top-label test rejects "calibrated".
    assert figures["p_top_label"] < 0.05 and "top-label test says it is not calibrated" in text


def test_calibrate_logits_gives_every_logit_methods_row_with_the_librarys_figures(server, shipped, tmp_path):
    from nctv import metrics
    from nctv.calibration import make_method
    from nctv.methods import METHODS

    zc, yc, zt, yt = shipped
    path = tmp_path / "split.npz"
    np.savez(path, calibration_logits=zc.numpy(), calibration_labels=yc.numpy(), test_logits=zt.numpy(),
             test_labels=yt.numpy())
    url = _upload(server, path)

    async def calibrated(session):
        return await session.call_tool("calibrate_logits", {"logits_file": url, "bins": 15, "seed": 0})

    markdown, table = _answer(_session(server, calibrated))
    rows = {row["method"]: row["cells"] for row in table["rows"]}
    assert set(rows) == {name for name, spec in METHODS.items() if not spec.needs_model}
    ts = make_method("Temperature Scaling").fit(zc, yc)
    for name, logits in (("Uncalibrated", zt), ("Temperature Scaling", ts.transform(zt))):
        assert rows[name]["ece"]["mean"] == pytest.approx(100 * metrics.ece(logits, yt, 15), abs=1e-9)
        assert rows[name]["accuracy"]["mean"] == pytest.approx(100 * metrics.accuracy(logits, yt), abs=1e-9)
        assert name in markdown


def test_a_file_that_was_not_uploaded_here_is_refused_in_words(server):
    async def refused(session):
        return await session.call_tool("calibration_test", {"logits_file": "https://example.com/logits.npz"})

    result = _session(server, refused)
    assert result.isError
    assert "Upload the file to this app first" in result.content[0].text


def test_explain_temperature_and_classify_give_the_librarys_numbers(server):
    from nctv import metrics
    from nctv.ui.shipped import load_precomputed
    from nctv.ui.try_image import example_images

    url = _upload(server, __import__("pathlib").Path(example_images()[0]))

    async def both(session):
        return (await session.call_tool("explain_temperature", {"temperature": 2.0, "bins": 15}),
                await session.call_tool("classify", {"picture": url}))

    explained, classified = _session(server, both)
    text, figures = _answer(explained)
    pre = load_precomputed().result
    z, y = pre.methods["Uncalibrated"].test_logits.double(), pre.test_labels
    assert figures["T = 2"]["ece"] == pytest.approx(metrics.ece(z / 2, y, 15), abs=1e-12)
    assert figures["T = 1"]["ece"] == pytest.approx(metrics.ece(z, y, 15), abs=1e-12)
    assert "T = 2.00" in text
    answer, details = _answer(classified)
    assert set(details["answers"]) == {"uncalibrated", "temperature scaling", "Neural Clamping"}
    # The shipped example is an ankle boot; calibration softens the answer but keeps it.
    assert details["answers"]["uncalibrated"]["class"] == "Ankle boot"
    assert details["answers"]["temperature scaling"]["confidence"] < details["answers"]["uncalibrated"]["confidence"]
    assert "Ankle boot" in answer


@pytest.mark.parametrize("path, forged, expected", [
    ("/gradio_api/mcp/", b"6.6.6.6", b"203.0.113.7"),  # an agent's own header is replaced by its address
    ("/gradio_api/mcp/", None, b"203.0.113.7"),
    ("/gradio_api/queue/join", b"6.6.6.6", b"6.6.6.6"),  # other routes are left alone
])
def test_a_tool_request_carries_its_callers_address_to_the_queue(path, forged, expected):
    """Gradio runs a tool by calling the app's own queue from the server with the tool request's headers:
    the address the queue counts is the one uvicorn read for the tool request, never one an agent wrote."""
    from nctv.ui.mcp_tools import CallerAddress

    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    headers = [(b"host", b"example")] + ([(b"X-Forwarded-For", forged)] if forged else [])
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "client": ("203.0.113.7", 5000)}
    asyncio.run(CallerAddress(app)(scope, None, None))
    assert [v for k, v in seen["headers"] if k.lower() == b"x-forwarded-for"] == [expected]

