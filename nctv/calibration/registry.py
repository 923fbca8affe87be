"""The method registry, as the calibration package names it: it lives in :mod:`nctv.methods`, which
imports no fitter and no torch, so that the command line and the app's menus read it cheaply."""
from nctv.methods import (CLASSES, METHODS, RUN_OPTIONS, MethodSpec, abbreviation, calibration_class, colour,  # noqa: F401
                          make_method, method_spec, short_names, trained_input_methods)
