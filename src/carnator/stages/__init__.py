"""The stages the engine runs for one request, each a small function with typed input and output.

``recall`` (candidates from the store) -> ``probe`` (dense first steps, :class:`Evidence`) -> ``read_signature``
(:class:`~carnator.signature.EarlySignature` and Evidence Regions). The decision and the plan are the policy's
(:mod:`carnator.policies`), the denoising the loop's (:mod:`carnator.denoise`), storing the store's.
"""

from .probe import Evidence, probe, read_signature
from .recall import recall, recall_content

__all__ = ["Evidence", "probe", "read_signature", "recall", "recall_content"]
