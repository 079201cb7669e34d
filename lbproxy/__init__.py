"""lbproxy: a Layer-4 TCP reverse proxy and load balancer on trio."""

__version__ = "0.1.0"
