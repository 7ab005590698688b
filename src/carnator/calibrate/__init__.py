"""Calibration: from request-cache pairs to certified thresholds (PAPER step 6; docs/CALIBRATION.md).

:mod:`.certify` is the maths: the pairs' split, the thresholds' (or risk score's) selection, the Clopper-Pearson
certificate and the per-kind tiers; it knows no model and no store. :mod:`.run` is ``carnator calibrate``: it
generates and judges the pairs through an engine and writes the thresholds file with :mod:`.certify`.
"""
