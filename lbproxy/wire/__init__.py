"""Wire formats, sans-io (PURE): PROXY protocol, TLS ClientHello."""
