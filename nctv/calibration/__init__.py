"""Post-hoc calibrators and the registry of the paper's methods.

Every calibrator derives from :class:`BaseCalibrator` (``get_params``, ``set_params``, ``clone``,
``save_pretrained``). Logit-space calibrators: ``fit(logits, labels) -> self``,
``transform(logits) -> logits``. Input-space ones (Neural Clamping): ``fit(inputs_or_loader,
labels=None) -> self``, ``predict_logits(inputs_or_loader)``. ``METHODS`` maps the paper's method
names to a :class:`MethodSpec` whose ``factory`` builds a ready-to-fit object::

    from nctv.calibration import METHODS, make_method
    ts = make_method("Temperature Scaling").fit(cal_logits, cal_labels)
    nc = make_method("Neural Clamping (FL)", model=my_model, seed=1).fit(cal_x, cal_y)

Saved calibrators come back with ``load_calibrator(folder or "hf-hub:org/name", model=None)``;
``CalibratedModel(model, calibrator)`` is the deployable ``nn.Module`` (docs/calibrators.md).
"""
from __future__ import annotations

from typing import Any

from nctv.calibration.base import BaseCalibrator, Calibrator, NotFittedError, focal_loss

# Classes are imported on first use so that `import nctv.calibration` stays light (the app and
# the CLI import it at start-up) and a module is loaded only when one of its methods is asked for.
from nctv.calibration.registry import CLASSES as _CLASSES
from nctv.calibration.registry import METHODS, MethodSpec, calibration_class, make_method


def __getattr__(name: str) -> Any:
    return calibration_class(name)


__all__ = ["BaseCalibrator", "Calibrator", "NotFittedError", "focal_loss", "METHODS", "MethodSpec", "make_method",
           *_CLASSES]
