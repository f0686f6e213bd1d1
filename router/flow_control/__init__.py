"""Flow control under saturation: requests wait in the router in priority bands,
tenants sharing each band by what they cost, and are routed once their engines have
room (docs/router.md "Flow control")."""

from router.flow_control.bands import DEADLINE_HEADER, PRIORITY_HEADER, Placement, placement
from router.flow_control.counters import ServiceCounters
from router.flow_control.gate import SHED_REASON_HEADER, FlowGate, FlowPass, Shed

__all__ = [
    "DEADLINE_HEADER",
    "PRIORITY_HEADER",
    "SHED_REASON_HEADER",
    "FlowGate",
    "FlowPass",
    "Placement",
    "ServiceCounters",
    "Shed",
    "placement",
]
