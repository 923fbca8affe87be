"""Post-hoc calibrators (SPEC §2–3). The registry METHODS is filled in below."""
from nctv.calibration.base import Calibrator, NotFittedError, Uncalibrated, focal_loss

__all__ = ["Calibrator", "NotFittedError", "Uncalibrated", "focal_loss"]
