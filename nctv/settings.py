"""Every setting that more than one part of NCTV uses, defined once (no heavy imports here).

The library, the command line, the web app, the bench and the scripts read these names; docs/method.md
explains the choices and docs/glossary.md the names.
"""
from __future__ import annotations

#: Neural Clamping fitters: "fast" (the default: L-BFGS, then T chosen by calibration ECE), and the
#: two published SGD recipes run exactly, "paper" (the paper's text with the authors' momentum) and
#: "toolkit" (the authors' released demo).
FITTERS = ("fast", "paper", "toolkit")
DEFAULT_FITTER = "fast"
