"""The stages the engine runs for one request, each a small function with typed input and output, over one
:class:`RequestState`.

``exact_hit`` (the exact tier) -> ``recall`` (candidates from the store) -> ``probe`` (dense first steps,
:class:`Evidence`) -> ``read_signature`` (:class:`~carnator.signature.EarlySignature` and Evidence Regions) ->
``decide`` (the policy's decision, held to the certification rule) -> ``plan`` (the policy's plan, bound to the
source's tensors) -> denoising (:mod:`carnator.denoise`) -> ``store`` (admit the entry). The decision and the plan are
the policy's (:mod:`carnator.policies`); a stage only runs them and records what they said.
"""

from .decide import decide
from .exact import exact_hit
from .plan import bind, load_source, plan
from .probe import Evidence, probe, read_signature
from .recall import near_keys, recall, recall_content
from .state import RequestState
from .store import admit, store

__all__ = ["Evidence", "RequestState", "admit", "bind", "decide", "exact_hit", "load_source", "near_keys", "plan",
           "probe", "read_signature", "recall", "recall_content", "store"]
