"""A generation request's life in the router, shared by its front doors (the embedded
proxy and the gateway's endpoint picker): see flow.py."""

from router.lifecycle.accounting import AnswerAccounting, SentTo
from router.lifecycle.flow import (
    Dispatch,
    RequestFlow,
    RequestLifecycle,
    RoutedRequest,
    route_prompt,
)

__all__ = [
    "AnswerAccounting",
    "Dispatch",
    "RequestFlow",
    "RequestLifecycle",
    "RoutedRequest",
    "SentTo",
    "route_prompt",
]
