"""A visitor picks a menu model whose pre-computed study the operator serves from a Hub dataset
repository (NCTV_PRECOMPUTED_REPO, here in the Hub's cache layout, the server offline): the launched
app shows that study at once, labelled as the default's, in Calibrate, γ sweep, Initialisation and Shift."""
import pytest

from conftest import PAGE_WAIT_MS, start_app, stop_app
from test_browser import ARGS, CHROMIUM, open_app, open_panel, pytestmark, wait_for_status  # noqa: F401
from test_precomputed_studies import write_study

MODEL = "fmnist-vit"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url of an app server whose operator serves ``MODEL``'s study, the study's folder)."""
    tmp = tmp_path_factory.mktemp("precomputed-app")
    repo = tmp / "hf" / "hub" / "datasets--nctv-test--studies"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    folder = write_study(repo / "snapshots" / ("c" * 40) / MODEL, MODEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp / "hf"))
        mp.setenv("NCTV_PRECOMPUTED_REPO", "nctv-test/studies")
        proc, url = start_app(tmp)
    yield url, folder
    stop_app(proc)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_picking_a_menu_model_shows_its_precomputed_study(browser, served):
    url, folder = served
    pg = open_app(browser, url, 1400, 1000)
    wait_for_status(pg, "model fmnist-resnet-overconfident", 30_000)
    open_panel(pg)
    box = pg.locator("#shared-panel").get_by_label("Model", exact=True)
    box.click()
    pg.get_by_role("option", name=f"{MODEL} (embedded, offline)").click()
    wait_for_status(pg, f"Showing the result pre-computed, shipped with the app (model {MODEL}, 5000 calibration "
                        "images", 60_000)
    assert "Neural Clamping (FL)" in pg.locator("#results-table").inner_text()
    assert pg.locator("#calibrate-diagrams .nc-card svg").count() == 10
    for tab, status in (("γ sweep", "#gamma-status"), ("Initialisation", "#init-status")):
        pg.get_by_role("tab", name=tab).click()
        pg.wait_for_function(f"document.querySelector({status!r}).innerText.includes('model {MODEL}')",
                             timeout=PAGE_WAIT_MS)
        assert "pre-computed, shipped with the app" in pg.locator(status).inner_text()
    # The Shift tab, never opened before the pick: its status and the page's own numbers are that model's.
    pg.get_by_role("tab", name="Shift").click()
    pg.wait_for_function("document.querySelector('#shift-status').innerText.includes('model fmnist-vit')",
                         timeout=PAGE_WAIT_MS)
    pg.wait_for_selector("#shift-diagrams .ns-card svg")
    assert pg.locator("#shift-note").inner_text().startswith(f"Model {MODEL};")
    pg.context.close()
