"""The admin endpoint: HTTP/1.1 server on h11, the API, metrics, dashboard, and its client."""
