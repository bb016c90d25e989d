"""The cluster-level anchors (docs/design.md, Anchors), each a router policy with its defaults.

Every anchor here reads the same ``ReplicaState`` fields, so they differ only by rule:

- the approximate ones (Ray, SGLang, AIBrix, production-stack) see ``matched_blocks`` from an
  index of the router's own decisions, Dynamo and llm-d's precise mode from engine events; the
  host picks the index mode, the rule is the same;
- matches are in blocks of tokens, where Ray, SGLang and production-stack match characters
  (docs/design.md, Block hashes in token units): a "match rate" is matched block tokens / prompt
  tokens;
- ties that the originals break at random or by map order go by replica id here, unless the
  rule itself is random (``pow2``'s sampling and its ties, ``vllm-prefixaware``,
  ``session-hash`` without a session) or the anchor has been checked against its source's tie
  rule (``sglang``, ``aibrix``, ``llmd``, ``llmd-baseline``): those draw from the injected
  ``rng`` where the original is random.

Complexity: every ``rank`` is O(R log R) in the number of candidate replicas R (a sort), plus
O(k) for a ring anchor's key and an expected O(R log R) ring walk.
"""

from fairway.routing.anchors.aibrix import AIBrix
from fairway.routing.anchors.common import pow2_ranks
from fairway.routing.anchors.dynamo import Dynamo
from fairway.routing.anchors.hashing import ConsistentHash, PrefixHash, SessionHash
from fairway.routing.anchors.llmd import LLMD, LLMDBaseline
from fairway.routing.anchors.ray import RayPrefix
from fairway.routing.anchors.sglang import SGLang, SGLangClassic
from fairway.routing.anchors.simple import Pow2, RoundRobin
from fairway.routing.anchors.vllm import VLLMLoadAware, VLLMPrefixAware

__all__ = [
    "AIBrix",
    "ConsistentHash",
    "Dynamo",
    "LLMD",
    "LLMDBaseline",
    "Pow2",
    "PrefixHash",
    "RayPrefix",
    "RoundRobin",
    "SGLang",
    "SGLangClassic",
    "SessionHash",
    "VLLMLoadAware",
    "VLLMPrefixAware",
    "pow2_ranks",
]
