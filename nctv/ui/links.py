"""Links that open a view: ``/?tab=learn&t=1.5&bins=10&presenter=1`` opens the Learn tab in presenter
mode at T = 1.5 with 10 bins; ``model`` picks a menu model, ``step`` a step of the lesson, ``bin`` an
opened group of the Learn diagram (1 = the lowest confidences).

The page sends its address with its load event (Gradio passes the page's query with every call), so
the server reads each value with the readers that a typed value goes through (``read_number``,
``parse_whole``) and the controls' own bounds: one reader, no twin in the page. The call is light (no
model, no queue). A bad or unknown value is named in a note above the tabs and otherwise ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import gradio as gr

from nctv.checks import read_number, shown
from nctv.settings import APP_BINS
from nctv.ui import learn, lesson
from nctv.ui.common import parse_whole

#: The tabs' ids, as a link names them.
TABS = ("calibrate", "gamma", "init", "try", "learn", "shift")
#: What a link may set: the tab, the menu model, and Learn's view (T, bins, presenter mode, a lesson's
#: step, an opened group); a Learn parameter given without a tab opens Learn.
LEARN_PARAMETERS = ("t", "bins", "presenter", "step", "bin")
PARAMETERS = ("tab", "model") + LEARN_PARAMETERS
#: Parameters of Gradio's own (the theme, the API page), left to it.
GRADIO_PARAMETERS = ("__theme", "view")
YES, NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Link:
    """What a link asks for (None: not asked, or asked with a value that was ignored) and ``problems``,
    one phrase per ignored value or parameter."""

    tab: str | None = None
    model: str | None = None
    t: float | None = None
    bins: int | None = None
    presenter: bool = False
    step: int | None = None
    bin: int | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)

    def view(self) -> dict[str, Any]:
        """Learn's part, as the page reads it (learn.js applyLink)."""
        return {k: v for k, v in (("t", self.t), ("bins", self.bins), ("presenter", self.presenter),
                                  ("step", self.step), ("bin", self.bin)) if v}


def _menu() -> list[str]:
    from nctv.ui.limits import model_choices

    return [name for _, name in model_choices()]


def _whole(value: str, name: str, low: int, high: int) -> int:
    try:
        return parse_whole(value, name, low, high)
    except ValueError as e:
        raise ValueError(str(e).rstrip(".")) from None


def read_link(query: Mapping[str, Sequence[str]]) -> Link:
    """The view asked for by a page's query (each parameter with the values it was given)."""
    problems, got = [], {}
    for name, values in query.items():
        if name in GRADIO_PARAMETERS:
            continue
        if name not in PARAMETERS:
            problems.append(f"{shown(name)} is not a part of a link (they are {', '.join(PARAMETERS)})")
        elif len(values) != 1:
            problems.append(f"{name} is given {len(values)} times")
        else:
            got[name] = values[0]
    out: dict[str, Any] = {}
    readers = (("tab", _tab), ("model", _model), ("t", _temperature), ("bins", _bins), ("presenter", _presenter),
               ("step", _step), ("bin", lambda v: _whole(v, "bin", 1, out.get("bins") or APP_BINS)))
    for name, reader in readers:
        if name in got:
            try:
                out[name] = reader(got[name])
            except ValueError as e:
                problems.append(str(e))
    learn_asked = any(out.get(p) for p in LEARN_PARAMETERS)
    if "tab" not in out and "tab" not in got and learn_asked:
        out["tab"] = "learn"
    if out.get("presenter") and out.get("tab") != "learn":
        problems.append(f"presenter mode is the Learn tab's; this link opens {out.get('tab') or 'calibrate'}")
        out["presenter"] = False
    return Link(**out, problems=tuple(problems))


def _tab(value: str) -> str:
    if value not in TABS:
        raise ValueError(f"tab = {shown(value)} is not a tab (they are {', '.join(TABS)})")
    return value


def _model(value: str) -> str:
    menu = _menu()
    if value not in menu:
        raise ValueError(f"model = {shown(value)} is not a model of the menu ({', '.join(menu)})")
    return value


def _temperature(value: str) -> float:
    t = read_number(value)
    if t is None or not math.isfinite(t) or not learn.T_MIN <= t <= learn.T_MAX:
        raise ValueError(f"t = {shown(value)} is not a temperature from {learn.T_MIN:g} to {learn.T_MAX:g}")
    return t


def _bins(value: str) -> int:
    return _whole(value, "bins", learn.BINS_MIN, learn.BINS_MAX)


def _step(value: str) -> int:
    return _whole(value, "step", 1, len(lesson.STEPS))


def _presenter(value: str) -> bool:
    word = value.strip().lower()
    if word not in YES + NO:
        raise ValueError(f"presenter = {shown(value)} is not 1 or 0")
    return word in YES


def note(link: Link) -> str:
    """The note above the tabs: which values of the link were ignored, and why ('' when none)."""
    if not link.problems:
        return ""
    return "**Part of this link was ignored**; the rest of it is shown.\n\n" + "\n".join(f"- {p}." for p in link.problems)


def _query(request: gr.Request | None) -> dict[str, list[str]]:
    """The page's query, each parameter with every value it was given (Gradio passes the page's own
    query with each call of the page)."""
    query = getattr(request, "query_params", None) or {}
    if hasattr(query, "getlist"):
        return {name: query.getlist(name) for name in query}
    return {name: [value] for name, value in dict(query).items()}


def open_link(request: gr.Request) -> tuple:
    """The page's load event: (the tabs, the model menu, the note) as the page's address asks, each
    left as it is where the address says nothing. Learn's part goes with Learn's data
    (:func:`learn_data`): an update sent to a tab's widget before the tab is first shown would replace
    the widget's properties."""
    link = read_link(_query(request))
    words = note(link)
    return (gr.update(selected=link.tab) if link.tab else gr.skip(),
            gr.update(value=link.model) if link.model else gr.skip(),
            gr.update(value=words, visible=True) if words else gr.skip())


def learn_data(state: Any, request: gr.Request) -> dict:
    """The Learn tab's first data (:func:`nctv.ui.learn.page_data`) with the view the page's address
    asks for (``link``: T, bins, presenter mode, a step, an opened group; the page applies it once)."""
    return {**learn.page_data(state), "link": read_link(_query(request)).view()}
