"""The part of the shapes world that reads a caption and a clip back, for the embedded model's judge.

``scene``: the vocabularies, :class:`~carnator.embedded.world.scene.Scene` and the colour science; ``captions``: the
caption parser; ``render``: the shapes' signed distance functions; ``judge``: reading a clip and scoring it against a
prompt. The rest of the world (sampler, renderer, caption writer, traces, training) is carnator-lab's, which imports
these.
"""
