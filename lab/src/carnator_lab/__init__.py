"""The Carnator lab: where the library is measured.

The shapes world the embedded model was trained on (scene sampler, renderer, caption grammar; the parser and the
judge that read a caption and a clip back ship with the library, ``carnator.embedded.world``), the world's benchmark traces and calibration pairs, the training script of the embedded model,
the real-size speed benchmark (``bench-scale``) and the experiment scripts. The lab imports the library; the library
never imports the lab. Its command line: ``carnator-lab`` (``python -m carnator_lab``).
"""

__version__ = "0.1.0"
