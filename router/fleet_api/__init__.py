"""The fleet API: the operators' view of the workers a router serves (`/fleet/...`),
its typed models, and the page that shows it in a browser."""

from router.fleet_api.api import FleetApi
from router.fleet_api.page import fleet_page_routes

__all__ = ["FleetApi", "fleet_page_routes"]
