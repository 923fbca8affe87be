"""NCTV — Neural Clamping Toolkit & Visualizer.

Post-hoc calibration of neural-network classifiers: Neural Clamping (a learned input perturbation δ
plus a temperature T on a frozen model) and the standard baselines, with exact calibration metrics,
paper-style tables and figures, a command line and a Gradio app.
"""
__version__ = "0.1.0"
