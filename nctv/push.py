"""One fitted calibrator of a run, on the Hugging Face Hub beside the model it calibrates.

``nctv run`` writes a run folder: ``results.json``, the test logits, and ``calibrators/<method>/`` (each
fitted calibrator as ``save_pretrained`` writes it). :func:`prepare` makes the repository's folder for one
of them: its ``config.json`` and ``calibrator.safetensors``, ``reliability.png`` (the method's reliability
diagram against the uncalibrated model's, on the test split) and ``README.md``, a model card whose
``model-index`` holds ECE, AECE, smooth ECE, NLL and Brier score on the test split (fractions; their 95 %
intervals are in the card's text), with the base model, the splits and how to load it
(``load_calibrator("hf-hub:ORG/NAME")``). :func:`push` uploads that folder as one commit: every file or
none, so that a failure leaves nothing half-uploaded. ``nctv push --dry-run --to DIR`` writes exactly the
folder that would be uploaded.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

#: The test-split figures of the card's model-index: (metric, its name in words).
CARD_METRICS = (("ece", "ECE"), ("aece", "AECE"), ("smooth_ece", "smooth ECE"), ("nll", "NLL"), ("brier", "Brier score"))
#: Metrics shown in per cent in the card's text (the model-index holds fractions).
PERCENT = ("ece", "aece", "smooth_ece")
DIAGRAM = "reliability.png"
CARD = "README.md"
REFERENCE = "Uncalibrated"


def _method(result: Any, name: str) -> str:
    """The run's method called ``name`` (full or short name), refused in words if the run has no calibrator of it."""
    from nctv.methods import short_names

    method = short_names().get(name.strip().lower(), name.strip())
    fitted = [m for m in result.methods if m != REFERENCE]
    if method not in fitted:
        raise ValueError(f"This run has no fitted {name!r}; it has {', '.join(fitted) or 'no calibrator'} "
                         "(full or short names, e.g. ts for Temperature Scaling).")
    return method


def check_repo(repo: str) -> str:
    """``ORG/NAME``, checked as the Hub checks a repository id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    text = (repo or "").strip()
    try:
        validate_repo_id(text)
    except HFValidationError:
        text = ""
    if text.count("/") != 1:
        raise ValueError(f"{repo!r} is not a Hub repository name: give ORG/NAME, e.g. my-name/resnet101-ts "
                         "(letters, digits, '-', '_' and '.').")
    return text


def _run(run: str | os.PathLike) -> Any:
    from nctv.results import RunResult

    folder = Path(run)
    if not (folder / "results.json").is_file():
        raise ValueError(f"{folder} holds no results.json: give a run folder written by nctv run (its --out).")
    return RunResult.load(folder)


def _base_model(result: Any) -> tuple[str | None, str]:
    """(the base model's Hub id or None, how the card names it and loads it)."""
    name, source = result.model.get("name", "?"), str(result.model.get("source", ""))
    if source.startswith("hf-hub:"):
        repo = source[len("hf-hub:"):].split("@")[0]
        return repo, f"[{repo}](https://huggingface.co/{repo}) (`load_model(\"hf-hub:{repo}\")`)"
    return None, f"`{name}` (`load_model(\"{name}\")`)"


def _figures(result: Any, method: str, bins: int) -> dict[str, Any]:
    return {metric: result.stats(method, metric, bins) for metric, _ in CARD_METRICS}


def _shown(metric: str, value: float) -> str:
    return f"{100 * value:.2f} %" if metric in PERCENT else f"{value:.4f}"


def _interval(metric: str, s: Any) -> str:
    if s.ci_low is None:
        return ""
    return f" [{_shown(metric, s.ci_low)}, {_shown(metric, s.ci_high)}]"


def _diagram(result: Any, method: str, bins: int, run: Path, out: Path) -> None:
    """The method's reliability diagram beside the uncalibrated model's, drawn from the run's test logits;
    a run that kept none (the app's downloads) gives its own diagram of every method."""
    from nctv import plots

    if result.test_labels is not None:
        data = plots.reliability_data_from_result(result, bins, [REFERENCE, method])
        plots.save_figure(plots.reliability_figure(data, backend="matplotlib"), out / DIAGRAM, dpi=120)
        return
    drawn = next((p for p in (run / "figures" / DIAGRAM, run / DIAGRAM) if p.is_file()), None)
    if drawn is None:
        raise ValueError(f"{run} keeps neither its test logits nor a reliability diagram; run it again with nctv run.")
    shutil.copyfile(drawn, out / DIAGRAM)


def model_card(result: Any, method: str, repo: str) -> Any:
    """The card of ``repo``: ``huggingface_hub.ModelCard`` with a model-index of the test-split figures."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    from nctv import __version__
    from nctv.methods import METHODS
    from nctv.results import method_slug

    bins = 15 if 15 in result.bins else result.bins[0]
    figures = _figures(result, method, bins)
    reference = _figures(result, REFERENCE, bins)
    base_id, base = _base_model(result)
    cal, test = result.calibration, result.test
    dataset = str(test.get("name", "test")).removesuffix(" test")
    results = [EvalResult(task_type="image-classification", dataset_type=dataset, dataset_name=dataset,
                          dataset_split="test", metric_type=metric, metric_name=f"{name} ({bins} bins)" if metric in
                          ("ece", "aece") else name, metric_value=figures[metric].mean)
               for metric, name in CARD_METRICS]
    data = ModelCardData(model_name=repo, library_name="nctv", base_model=base_id, eval_results=results,
                         tags=["nctv", "calibration", "post-hoc-calibration", method_slug(method)])
    level = result.settings.get("intervals", {}).get("level", 0.95)
    rows = "\n".join(f"| {name} | {_shown(m, figures[m].mean)}{_interval(m, figures[m])} | "
                     f"{_shown(m, reference[m].mean)}{_interval(m, reference[m])} |" for m, name in CARD_METRICS)
    needs_model = METHODS[method].needs_model
    if needs_model:
        load = ("from nctv.calibration import CalibratedModel, load_calibrator\nfrom nctv.zoo import load_model\n\n"
                f'model = load_model("{"hf-hub:" + base_id if base_id else result.model.get("name")}")\n'
                f'calibrator = load_calibrator("hf-hub:{repo}", model=model)\n'
                "calibrated = CalibratedModel(model, calibrator)   # one nn.Module: images in, calibrated logits out")
    else:
        load = ("from nctv.calibration import load_calibrator\n\n"
                f'calibrator = load_calibrator("hf-hub:{repo}")\n'
                "calibrated_logits = calibrator.transform(logits)   # logits of the base model in, calibrated out")
    params = result.methods[method].params
    fitted = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in params.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool))
    body = f"""# {repo.split("/")[1]}: {method} for {result.model.get("name")}

A post-hoc calibrator fitted with NCTV (Neural Clamping Toolkit & Visualizer, version {__version__}): **{method}**, which makes the confidences of the base model {base} match how often it is right. The base model is not changed: the calibrator maps its logits{" and its inputs (x + δ)" if needs_model else ""} to calibrated ones.

- Calibration split (fitted on): {cal.get("name")} ({cal.get("size", "?"):,} images)
- Test split (scored on): {test.get("name")} ({test.get("size", "?"):,} images)
- Fitted: {fitted or "see config.json"}

## How to load it

```python
{load}
```

`config.json` holds the method, its settings and fitted numbers, and the model it was fitted for (name and fingerprint); `calibrator.safetensors` holds its tensors. Loading builds only NCTV's own classes, checks every value and unpickles nothing.

## Test-split figures ({bins} bins, {100 * level:g} % intervals from resampling the test split)

| metric | {method} | uncalibrated |
| --- | --- | --- |
{rows}

The model-index holds the same values as fractions. ECE uses {bins} equal-width bins and AECE {bins} equal-mass ones; smooth ECE is the kernel-smoothed calibration error of Błasiok & Nakkiran.

![Reliability diagram on the test split]({DIAGRAM})
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def prepare(run: str | os.PathLike, method: str, repo: str, out: str | os.PathLike) -> Path:
    """Write into ``out`` (made if need be; it must hold nothing yet) the folder :func:`push` uploads
    for ``method`` (full or short name) of the run folder ``run``, to be published as ``repo``; returns it."""
    from nctv.calibration.saving import CONFIG_NAME, TENSORS_NAME, calibrator_folder, read_config
    from nctv.results import CALIBRATORS_FOLDER, method_slug

    repo = check_repo(repo)
    run = Path(run)
    result = _run(run)
    method = _method(result, method)
    source = run / CALIBRATORS_FOLDER / method_slug(method)
    if not source.is_dir():
        raise ValueError(f"{run} kept no fitted {method} in {CALIBRATORS_FOLDER}/ (a run of a logits file saves "
                         "none): run it with nctv run, which saves every fitted calibrator.")
    config = read_config(calibrator_folder(source))
    if config.get("method") != method:
        raise ValueError(f"{source} holds a {config.get('method')!r} calibrator, not {method!r}.")
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} is not empty: give a new folder, so that it holds exactly what would be uploaded.")
    target.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_NAME, TENSORS_NAME):
        shutil.copyfile(source / name, target / name)
    bins = 15 if 15 in result.bins else result.bins[0]
    _diagram(result, method, bins, run, target)
    model_card(result, method, repo).save(target / CARD)
    return target


def hub_token(token: str | None = None) -> str:
    """``token``, else ``$HF_TOKEN``, else the Hub's login (``hf auth login``); refused in words without one."""
    from huggingface_hub import get_token

    found = token or get_token()
    if not found:
        raise ValueError("No Hugging Face token: set HF_TOKEN (a token with write access) or log in with "
                         "`hf auth login`; nothing was uploaded. `nctv push --dry-run --to DIR` writes the folder "
                         "without one.")
    return found


def push(run: str | os.PathLike, method: str, repo: str, private: bool = False, token: str | None = None) -> str:
    """Upload :func:`prepare`'s folder to the Hub repository ``repo`` (made if need be, private with
    ``private``) in one commit; returns the commit's address. Everything is written and checked before
    anything is sent, and the commit holds every file or none."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from nctv.calibration.saving import read_config
    from nctv.hub import hub_reachable

    token = hub_token(token)
    with tempfile.TemporaryDirectory(prefix="nctv-push-") as tmp:
        folder = prepare(run, method, repo, Path(tmp) / "repo")
        if not hub_reachable():
            raise ValueError("The Hugging Face Hub cannot be reached (no connection, or HF_HUB_OFFLINE=1); nothing "
                             "was uploaded. `nctv push --dry-run --to DIR` writes the folder it would upload.")
        api = HfApi(token=token)
        name = read_config(folder)["method"]
        # One create_commit, not upload_folder: with hf_xet installed, upload_folder may split a folder into
        # several commits, and a failure between them would leave part of it behind.
        files = [CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in sorted(folder.iterdir())]
        try:
            api.create_repo(repo, private=private, exist_ok=True)
            info = api.create_commit(repo, files, commit_message=f"{name} calibrator, fitted with NCTV")
        except HfHubHTTPError as e:
            status = getattr(e.response, "status_code", None)
            why = {401: "the token was refused (is it valid?)",
                   403: f"the token may not write to {repo} (a token with write access to it is needed)"}.get(
                status, f"the Hub answered {status}: {' '.join(str(e).split())[:200]}")
            raise ValueError(f"Nothing was uploaded to {repo}: {why}.") from None
        except OSError as e:  # the connection broke: the commit was not made
            raise ValueError(f"Nothing was uploaded to {repo}: the connection to the Hub failed ({e}).") from None
    return info.commit_url
