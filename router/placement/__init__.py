"""Where a request goes: the policies (the default `prefix_aware` and the baselines), the
`Placement` they answer, and the router's `Ledger` of its recent placements."""

from router.placement.ledger import Ledger, PendingPlacements
from router.placement.policy import PlacedShare, Placement, Policy, rendezvous
from router.placement.prefix_aware import LoadBound, PrefixAware, PrefixAwareConfig
from router.placement.registry import POLICIES, LeastLoaded, PrefixHash, RoundRobin, make_policy

__all__ = [
    "POLICIES",
    "Ledger",
    "LeastLoaded",
    "LoadBound",
    "PendingPlacements",
    "PlacedShare",
    "Placement",
    "Policy",
    "PrefixAware",
    "PrefixAwareConfig",
    "PrefixHash",
    "RoundRobin",
    "make_policy",
    "rendezvous",
]
