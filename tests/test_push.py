"""``nctv push``: one fitted calibrator of a run, with its model card, as the Hub repository's folder.

The run is the shipped one (assets/precomputed: results.json, the test logits and calibrators/, as
``nctv run`` writes them). The card is read back with ``huggingface_hub.ModelCard`` and its figures checked
against the library's, computed here from the calibrator the folder holds and the shipped test logits.

The Hub itself cannot be reached from where this project is built, so the uploads go to a local stand-in
of the Hub's HTTP API (tests/hub_standin.py: repository creation, pre-upload and commit, as
``huggingface_hub`` calls them); everything on this side of the network is the real client.
"""
import socket

import pytest
from safetensors.torch import load_file

from nctv import cli, metrics
from nctv.calibration import load_calibrator
from tests.conftest import REPO
from tests.hub_standin import committing

RUN = REPO / "assets" / "precomputed"
FILES = {"README.md", "config.json", "calibrator.safetensors", "reliability.png"}


@pytest.fixture(scope="module")
def shipped_test():
    saved = load_file(str(RUN / "test_logits.safetensors"))
    return saved["Uncalibrated"], saved["labels"]


def test_a_dry_run_writes_a_card_that_the_hub_client_parses_and_a_calibrator_that_loads(tmp_path, capsys,
                                                                                          shipped_test):
    from huggingface_hub import ModelCard

    out = tmp_path / "card"
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts", "--dry-run",
                     "--to", str(out)]) == 0
    assert "nothing uploaded" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == FILES
    card = ModelCard.load(out / "README.md")
    figures = {r.metric_type: r for r in card.data.eval_results}
    assert set(figures) == {"ece", "aece", "smooth_ece", "nll", "brier"}
    assert {r.dataset_split for r in card.data.eval_results} == {"test"}
    assert card.data.library_name == "nctv"
    # The card's figures are the calibrator's own on the test split.
    calibrator = load_calibrator(out)
    z, y = shipped_test
    calibrated = calibrator.transform(z)
    assert figures["ece"].metric_value == pytest.approx(metrics.ece(calibrated, y, 15), abs=1e-9)
    assert figures["nll"].metric_value == pytest.approx(metrics.nll(calibrated, y), abs=1e-9)
    assert figures["brier"].metric_value == pytest.approx(metrics.brier(calibrated, y), abs=1e-9)
    # Its text gives the intervals, the splits, the base model and how to load it.
    text = card.text
    assert 'load_calibrator("hf-hub:my-name/fmnist-ts")' in text
    assert "fmnist-resnet-overconfident" in text and "5,000 images" in text and "10,000 images" in text
    assert f"{100 * figures['ece'].metric_value:.2f} % [" in text
    assert "](reliability.png)" in text


def test_a_neural_clamping_card_loads_it_with_its_model(tmp_path):
    from huggingface_hub import ModelCard

    from nctv.push import prepare

    folder = prepare(RUN, "Neural Clamping (FL)", "my-name/fmnist-nc", tmp_path / "nc")
    text = ModelCard.load(folder / "README.md").text
    assert 'load_calibrator("hf-hub:my-name/fmnist-nc", model=model)' in text
    assert 'load_model("fmnist-resnet-overconfident")' in text


@pytest.mark.parametrize("args, words", [
    (["--method", "ms", "--repo", "a/b", "--dry-run", "--to", "{tmp}/x"], "no fitted 'ms'"),
    (["--method", "ts", "--repo", "no-slash", "--dry-run", "--to", "{tmp}/x"], "not a Hub repository name"),
    (["--method", "ts", "--repo", "a/b", "--dry-run"], "--dry-run and --to go together"),
    (["--method", "ts", "--repo", "a/b", "--to", "{tmp}/x"], "--dry-run and --to go together"),
])
def test_mistakes_are_one_line_in_words(tmp_path, capsys, args, words):
    assert cli.main(["push", str(RUN)] + [a.format(tmp=tmp_path) for a in args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_folder_that_is_no_run_is_refused(tmp_path, capsys):
    assert cli.main(["push", str(tmp_path), "--method", "ts", "--repo", "a/b", "--dry-run", "--to",
                     str(tmp_path / "x")]) == 2
    assert "holds no results.json" in capsys.readouterr().err


def test_push_uploads_the_dry_runs_folder_in_one_commit(local_hub, monkeypatch, tmp_path, capsys):
    repos = {}
    local_hub(committing(repos))
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts", "--private"]) == 0
    assert "in one commit" in capsys.readouterr().out
    assert list(repos) == ["my-name/fmnist-ts"] and len(repos["my-name/fmnist-ts"]) == 1
    commit = repos["my-name/fmnist-ts"][0]
    assert set(commit) == FILES
    dry = tmp_path / "dry"
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts", "--dry-run", "--to",
                     str(dry)]) == 0
    for name in ("README.md", "config.json", "calibrator.safetensors"):
        assert commit[name] == (dry / name).read_bytes()


@pytest.mark.parametrize("route, status, words", [("commit", 403, "may not write to"),
                                                  ("create", 401, "token was refused")])
def test_a_refusal_uploads_nothing_and_says_why(local_hub, monkeypatch, capsys, route, status, words):
    repos = {}
    local_hub(committing(repos, refuse={route: status}))
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts"]) == 2
    err = capsys.readouterr().err
    assert "Nothing was uploaded to my-name/fmnist-ts" in err and words in err
    assert not any(repos.values())


def test_without_a_token_or_a_network_nothing_is_sent(local_hub, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    repos = {}
    handler = committing(repos)
    local_hub(handler)
    monkeypatch.setenv("HF_TOKEN", "")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-login"))  # no stored login either
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-login" / "stored_tokens"))
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts"]) == 2
    assert "No Hugging Face token" in capsys.readouterr().err
    assert handler.seen == []
    # A token but no network: a closed port where the Hub should be.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
    assert cli.main(["push", str(RUN), "--method", "ts", "--repo", "my-name/fmnist-ts"]) == 2
    assert "cannot be reached" in capsys.readouterr().err
    assert not repos
